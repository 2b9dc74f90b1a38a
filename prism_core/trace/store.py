"""Columnar storage of a job's PrismTrace: one Zarr store, one array per column, ranks concatenated.

Layout of `trace.zarr`: arrays named after the schema's columns, each the concatenation of all
ranks' nodes in rank order, plus `rank_offsets` [W+1] (rank r's nodes are
offsets[r]:offsets[r+1]). Each group's global ranks are `group_ranks`, cut by `group_offsets`
[G+1]; each rank's per-step peak memory `peak_bytes` (-1: not measured), cut by `peak_offsets`
[W+1]; these are arrays, not attributes, so that a replay reading a few ranks (replay/hosted.py)
reads only their step peaks, and the group members as 4 bytes each, not as JSON (Python objects
that zarr keeps while the store is open). Attributes hold the small name tables (group names,
labels, dtypes, ops, splits) and the schema version. Columns are stored in shards of
`SHARD_ROWS` nodes holding chunks of `CHUNK_ROWS`; reading some ranks' rows decodes only the
chunks they sit in (a million nodes each: smaller chunks cost more in whole writes and loads
than they saved, bench/trace_store.py). Every chunk carries a CRC32C checksum, so corruption is
detected on load and reported with the file. The store is written to a temporary directory and
renamed into place. Stores of schema 3 (the tables as JSON attributes) are still read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prism_core.trace.schema import COLUMNS, OPS, READS, SCHEMA_VERSION

STORE_NAME = "trace.zarr"
SHARD_ROWS = 1 << 20       # nodes a file holds
CHUNK_ROWS = 1 << 20       # nodes a chunk (one decode): 16K-node chunks wrote 6.5x, loaded 10x slower (item 79)
TABLE_ARRAYS = ("group_ranks", "group_offsets", "peak_bytes", "peak_offsets")
NOT_MEASURED = -1          # `peak_bytes` of a step whose peak was not measured


class TraceError(RuntimeError):
    """A trace that cannot be loaded or does not hold together; the message names the file or node."""


@dataclass
class Trace:
    world_size: int
    columns: dict[str, np.ndarray]
    offsets: np.ndarray
    groups: list[tuple[int, ...]]          # group id -> global ranks
    group_names: list[str]
    labels: list[str]
    dtypes: list[str]
    step_peaks: list[list[int | None]] = field(default_factory=list)
    splits: list[str] = field(default_factory=lambda: [""])   # all-to-all split table ("3,0,5"; "" = even)
    # loaded for some ranks only (`load_trace(ranks=...)`; the others hold no nodes): per node, its
    # index in the whole graph; None: every rank's nodes are here
    node_index: np.ndarray | None = None
    nodes_in_graph: int | None = None       # ... and how many nodes the whole graph holds

    def rank_slice(self, rank: int) -> slice:
        return slice(int(self.offsets[rank]), int(self.offsets[rank + 1]))

    def rank(self, rank: int) -> dict[str, np.ndarray]:
        s = self.rank_slice(rank)
        return {name: col[s] for name, col in self.columns.items()}

    def num_nodes(self, rank: int) -> int:
        return int(self.offsets[rank + 1] - self.offsets[rank])


def _read_part(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    try:
        with np.load(path) as data:
            tables = json.loads(bytes(data["tables"]).decode())
            cols = {name: data[name] for name in COLUMNS}
    except Exception as err:  # noqa: BLE001 - any failure reading a part is reported the same way
        raise TraceError(f"trace part {path} cannot be read: {err}") from None
    return cols, tables


def read_queued(part: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A rank's compute nodes (local indices), the seconds its thread waited for a core within each
    (trace/run_delay.py), the CPU seconds the rank's other threads ran within each, and those the
    launch's assistant ran, from its trace part; empty where none were noted. A part written before
    the last two were noted gives zeros for its own threads and infinity for the assistant (its
    whole wait was taken for the assistant's then)."""
    nodes, queued = _node_values(part, "queued_node", "queued_s")
    with np.load(part) as data:
        own = data["queued_own_s"].astype(np.float64) if "queued_own_s" in data.files else np.zeros(len(nodes))
        helper = (data["queued_helper_s"].astype(np.float64) if "queued_helper_s" in data.files
                  else np.full(len(nodes), np.inf))
    return nodes, queued, own, helper


def read_wire(part: Path) -> tuple[np.ndarray, np.ndarray]:
    """A rank's communication nodes (local indices) and the moment (its clock) the backend handed
    each op over to the wire, from its trace part; empty where none were noted."""
    return _node_values(part, "wire_node", "wire_t")


def _node_values(part: Path, nodes: str, values: str) -> tuple[np.ndarray, np.ndarray]:
    """Two columns of a trace part noted beside some nodes; empty where the part has none."""
    with np.load(part) as data:
        if nodes not in data.files:
            return np.empty(0, np.int64), np.empty(0)
        return data[nodes].astype(np.int64), data[values].astype(np.float64)


def merge_parts(parts_dir: Path, world_size: int, ranks: list[int] | None = None) -> Trace:
    """Combine the per-rank files the ranks left behind into one job trace (global name tables).

    `ranks`: only these ranks ran (the others get no nodes), as when one DP replica is collected.
    """
    wanted = set(range(world_size) if ranks is None else ranks)
    group_ids: dict[str, int] = {}
    groups: list[tuple[int, ...]] = []
    labels: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    splits: dict[str, int] = {"": 0}
    per_rank, peaks = [], []
    for rank in range(world_size):
        if rank not in wanted:
            per_rank.append({name: np.empty(0, dtype) for name, dtype in COLUMNS.items()})
            peaks.append([])
            continue
        path = parts_dir / f"{rank}.npz"
        if not path.exists():
            raise TraceError(f"rank {rank} left no trace ({path})")
        cols, tables = _read_part(path)
        gmap = np.empty(max(len(tables["group_order"]), 1), dtype=np.int32)
        for local, name in enumerate(tables["group_order"]):
            if name not in group_ids:
                group_ids[name] = len(groups)
                groups.append(tuple(tables["groups"][name]))
            gmap[local] = group_ids[name]
        lmap = np.array([labels.setdefault(s, len(labels)) for s in tables["labels"]], dtype=np.int16)
        dmap = np.array([dtypes.setdefault(s, len(dtypes)) for s in tables["dtypes"]], dtype=np.int16)
        has_group = cols["group"] >= 0
        cols["group"] = np.where(has_group, gmap[np.where(has_group, cols["group"], 0)], -1).astype(np.int32)
        cols["label"] = lmap[cols["label"]]
        cols["dtype"] = dmap[cols["dtype"]]
        smap = np.array([splits.setdefault(s, len(splits)) for s in tables["splits"]], dtype=np.int32)
        cols["splits"] = smap[cols["splits"]]
        per_rank.append(cols)
        peaks.append(tables["step_peaks"])
    offsets = np.zeros(world_size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c["kind"]) for c in per_rank])
    columns = {name: np.concatenate([c[name] for c in per_rank]).astype(dtype, copy=False)
               for name, dtype in COLUMNS.items()}
    return Trace(world_size=world_size, columns=columns, offsets=offsets, groups=groups,
                 group_names=list(group_ids), labels=list(labels), dtypes=list(dtypes), step_peaks=peaks,
                 splits=list(splits))


def write_trace(trace: Trace, path: Path) -> Path:
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    root = zarr.open_group(str(tmp), mode="w")
    codecs = [ZstdCodec(level=3), Crc32cCodec()]
    peaks = trace.step_peaks        # [] (none noted) is stored as no offsets at all
    tables = (np.array([r for g in trace.groups for r in g], dtype=np.int32),
              _offsets(len(g) for g in trace.groups),
              np.array([NOT_MEASURED if p is None else p for rank in peaks for p in rank], dtype=np.int64),
              _offsets(len(rank) for rank in peaks) if peaks else np.zeros(0, np.int64))
    arrays = dict(trace.columns, rank_offsets=trace.offsets, **dict(zip(TABLE_ARRAYS, tables)))
    for name, values in arrays.items():
        chunk = max(1, min(CHUNK_ROWS, len(values)))
        shard = chunk * -(-min(SHARD_ROWS, max(len(values), 1)) // chunk)
        arr = root.create_array(name, shape=values.shape, dtype=values.dtype, chunks=(chunk,), shards=(shard,),
                                compressors=codecs)
        if len(values):
            arr[:] = values
    root.attrs.update({
        "schema_version": SCHEMA_VERSION, "world_size": trace.world_size, "ops": list(OPS),
        "group_names": list(trace.group_names), "labels": trace.labels, "dtypes": trace.dtypes,
        "splits": trace.splits,
    })
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_trace(path: Path, columns: Iterable[str] | None = None, ranks: Iterable[int] | None = None) -> Trace:
    """Load a job's trace; TraceError naming the file on anything missing or corrupt.

    `columns`: only these of the schema's columns (the replay assistant leaves out those it never
    reads: 24 of a node's 76 bytes, in a graph of every rank of the job), and "kind"; None: all.
    `ranks`: only these ranks' nodes and step peaks (the others hold none; `Trace.node_index` maps
    the nodes loaded to the whole graph's), so that memory follows the ranks read; None: all.
    """
    return TraceStore(path).load(columns, ranks)


class TraceStore:
    """A trace store opened once (its metadata read and checked), to load from more than once."""

    def __init__(self, path: Path):
        import zarr

        path = self.path = Path(path)
        if not (path / "zarr.json").is_file():
            raise TraceError(f"no trace store at {path} (missing {path / 'zarr.json'})")
        try:
            self.root = zarr.open_group(str(path), mode="r")
            attrs = dict(self.root.attrs)
        except Exception as err:  # noqa: BLE001
            raise TraceError(f"trace store metadata {path / 'zarr.json'} cannot be read: {err}") from None
        version = attrs.get("schema_version")
        if version not in READS:
            raise TraceError(f"{path / 'zarr.json'}: schema version {version!r}, this PrismLLM reads "
                             f"{' and '.join(map(str, READS))}")
        self.world_size = int(attrs["world_size"])
        self.labels, self.dtypes, self.splits = attrs["labels"], attrs["dtypes"], attrs["splits"]
        self.offsets = self._read("rank_offsets", None)
        if len(self.offsets) != self.world_size + 1:
            raise TraceError(f"{path / 'rank_offsets'} holds {len(self.offsets)} offsets for {self.world_size} ranks")
        self._peaks: list[list[int | None]] | None = None      # schema 3: every rank's, from the attributes
        if version == 3:
            self.groups = [tuple(g["ranks"]) for g in attrs["groups"]]
            self.group_names = [g["name"] for g in attrs["groups"]]
            self._peaks = attrs.get("step_peaks", [])
        else:
            self.group_names = list(attrs["group_names"])
            cuts = self._read("group_offsets", None)
            self._check_cuts("group_offsets", cuts, len(self.group_names), "group_ranks", "groups")
            members, cuts = self._read("group_ranks", None).tolist(), cuts.tolist()
            self.groups = [tuple(members[a:b]) for a, b in zip(cuts, cuts[1:])]
            del members
            self._peak_offsets = self._read("peak_offsets", None)
            if len(self._peak_offsets):        # none: the trace noted no step peaks
                self._check_cuts("peak_offsets", self._peak_offsets, self.world_size, "peak_bytes", "ranks")
        del attrs
        try:
            n_all = int(self.root["kind"].shape[0])
        except Exception as err:  # noqa: BLE001
            raise TraceError(f"trace array {path / 'kind'} is missing or corrupt: {type(err).__name__}: {err}") \
                from None
        if self.offsets[-1] != n_all:
            raise TraceError(f"{path / 'rank_offsets'} does not match the columns ({n_all} nodes)")

    def load(self, columns: Iterable[str] | None = None, ranks: Iterable[int] | None = None) -> Trace:
        """The trace, or some ranks of it (`load_trace`)."""
        # "kind" always: the node count the rank offsets are checked against, and every reader's first column
        wanted = tuple(COLUMNS) if columns is None else tuple(dict.fromkeys(("kind", *columns)))
        unknown = sorted(set(wanted) - set(COLUMNS))
        if unknown:
            raise ValueError(f"not columns of the trace schema: {unknown}")
        offsets, spans, node_index, chosen = self.offsets, None, None, None
        if ranks is not None:
            chosen = sorted(set(int(r) for r in ranks))
            if chosen and not 0 <= chosen[0] <= chosen[-1] < self.world_size:
                raise ValueError(f"ranks {chosen[0]}..{chosen[-1]} are not all ranks of a {self.world_size}-rank trace")
            spans = _merged_spans([(int(offsets[r]), int(offsets[r + 1])) for r in chosen])
            counts = np.zeros(self.world_size, dtype=np.int64)
            for r in chosen:
                counts[r] = offsets[r + 1] - offsets[r]
            node_index = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans] or [np.zeros(0, np.int64)])
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(self.offsets.dtype)
        cols = {name: self._read(name, spans) for name in wanted}
        peaks = self._step_peaks(chosen)
        return Trace(world_size=self.world_size, columns=cols, offsets=offsets, groups=self.groups,
                     group_names=self.group_names, labels=self.labels, dtypes=self.dtypes, step_peaks=peaks,
                     splits=self.splits, node_index=node_index,
                     nodes_in_graph=None if node_index is None else int(self.offsets[-1]))

    def _step_peaks(self, ranks: list[int] | None) -> list[list[int | None]]:
        """Each rank's per-step peak bytes (None: not measured); `ranks`: only theirs are read, the
        other ranks share one empty list. [] where the trace holds none."""
        if self._peaks is not None:        # schema 3
            if ranks is None or not self._peaks:
                return self._peaks
            return _only(self._peaks, ranks, self.world_size)
        cuts = self._peak_offsets
        if not len(cuts):
            return []
        chosen = range(self.world_size) if ranks is None else ranks
        spans = [(int(cuts[r]), int(cuts[r + 1])) for r in chosen]
        values = self._read("peak_bytes", _merged_spans(spans)).tolist()
        taken, out = 0, {}
        for r, (a, b) in zip(chosen, spans):
            out[r] = [None if v == NOT_MEASURED else v for v in values[taken:taken + b - a]]
            taken += b - a
        return [out[r] for r in range(self.world_size)] if ranks is None else _only(out, ranks, self.world_size)

    def _check_cuts(self, name: str, cuts: np.ndarray, count: int, values: str, what: str) -> None:
        """TraceError naming `name` unless it cuts the array `values` into `count` runs, in order."""
        try:
            size = int(self.root[values].shape[0])
        except Exception as err:  # noqa: BLE001
            raise TraceError(f"trace array {self.path / values} is missing or corrupt: {type(err).__name__}: {err}") \
                from None
        if len(cuts) != count + 1 or cuts[0] != 0 or cuts[-1] != size or (np.diff(cuts) < 0).any():
            raise TraceError(f"{self.path / name} does not cut {self.path / values} ({size} values) into {count} "
                             f"{what}")

    def _read(self, name: str, spans: list[tuple[int, int]] | None) -> np.ndarray:
        """An array whole (`spans` None), or those ranges of it, concatenated."""
        try:
            arr = self.root[name]
            if spans is None:
                return arr[:]
            parts = [arr[a:b] for a, b in spans]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=arr.dtype)
        except Exception as err:  # noqa: BLE001
            raise TraceError(f"trace array {self.path / name} is missing or corrupt: {type(err).__name__}: {err}") \
                from None


def _offsets(lengths: Iterable[int]) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: where each of a list of runs starts, and the end."""
    return np.concatenate([[0], np.cumsum(list(lengths), dtype=np.int64)]).astype(np.int64)


def _only(peaks, ranks: list[int], world_size: int) -> list[list[int | None]]:
    """`peaks` (indexable by rank) for `ranks`; the other ranks share one empty list."""
    none: list = []
    keep = set(ranks)
    return [peaks[r] if r in keep else none for r in range(world_size)]


def _merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted node ranges with adjacent ones joined (one read each); empty ones left out."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
