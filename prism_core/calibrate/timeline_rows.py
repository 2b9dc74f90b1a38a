"""Some nodes' rows of a calibrated `timeline.npz`, read without reading the file whole.

A replay hosting a few virtual ranks of a large job (`emulation.virtual_ranks: neighbours`) needs
the timing of their nodes only; the timeline holds every node's (40 bytes a node and more). An
`np.savez` file is a zip of `.npy` members stored uncompressed, so a member's rows lie at a known
place in the file: each run of consecutive nodes is one read there. A member stored compressed,
or with a header this reader does not parse, is read whole and cut.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")     # a zip member's local file header (30 bytes)


def runs(nodes: np.ndarray) -> list[tuple[int, int]]:
    """Sorted node indices as [start, stop) runs of consecutive nodes."""
    nodes = np.asarray(nodes, dtype=np.int64)
    if not len(nodes):
        return []
    breaks = np.flatnonzero(np.diff(nodes) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(nodes)]])
    return [(int(nodes[a]), int(nodes[b - 1]) + 1) for a, b in zip(starts, stops)]


def read_rows(path: Path, nodes: np.ndarray, length: int, per_node: Iterable[str],
              whole: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """The members `per_node` (one value per node of a `length`-node graph) of the `.npz` at
    `path`, cut to `nodes` (sorted indices), and the members `whole`, whole; those the file holds.
    ValueError naming the file where a `per_node` member does not hold `length` values (the
    timeline is another graph's) or the file is not an uncompressed-or-zip `.npz`."""
    per_node, whole = set(per_node), set(whole)
    spans = runs(nodes)
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            for info in archive.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else None
                if name in whole:
                    with archive.open(info) as member:
                        out[name] = np.lib.format.read_array(member, allow_pickle=False)
                elif name in per_node:
                    out[name] = _rows(archive, raw, info, nodes, spans, length)
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    return out


def _rows(archive: zipfile.ZipFile, raw, info: zipfile.ZipInfo, nodes: np.ndarray, spans: list[tuple[int, int]],
          length: int) -> np.ndarray:
    """A per-node member's rows at `nodes`: read where they lie when it is stored uncompressed."""
    header = None
    if info.compress_type == zipfile.ZIP_STORED:
        raw.seek(info.header_offset)
        local = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
        if local[0] != b"PK\x03\x04":
            raise ValueError(f"{info.filename}: not a zip member's header")
        raw.seek(info.header_offset + _LOCAL_HEADER.size + local[9] + local[10])   # past its name and extra field
        version = np.lib.format.read_magic(raw)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(raw)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(raw)
    if header is None:      # compressed, or a header version read whole
        with archive.open(info) as member:
            values = np.lib.format.read_array(member, allow_pickle=False)
        if values.shape != (length,):
            raise ValueError(f"{info.filename} holds {values.shape} values, not one per node of a {length}-node graph")
        return values[nodes]
    shape, _, dtype = header
    if shape != (length,) or dtype.hasobject:
        raise ValueError(f"{info.filename} holds {shape} values, not one per node of a {length}-node graph")
    data = raw.tell()
    out = np.empty(len(nodes), dtype=dtype)
    at = 0
    for a, b in spans:
        raw.seek(data + a * dtype.itemsize)
        chunk = raw.read((b - a) * dtype.itemsize)
        if len(chunk) != (b - a) * dtype.itemsize:
            raise ValueError(f"{info.filename} ends before its node {b - 1}")
        out[at:at + b - a] = np.frombuffer(chunk, dtype=dtype)
        at += b - a
    return out
