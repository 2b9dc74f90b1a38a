"""Per-rank tensor cache in one Zarr v3 store: raw bytes in a flat sharded array plus an index.

Layout of `tensors.zarr`: an attribute-free root group and `ranks` group, and for each rank a group
`ranks/<rank>` with a flat uint8 array `data` (chunked, sharded, zstd + CRC32C per chunk), index
arrays `offsets`/`nbytes` (int64) and `checksums` (uint32 zlib.crc32 of each entry's raw bytes), and
attributes naming each entry's key, torch dtype and shape. Every dtype (bf16 included) is stored as
its raw bytes, so a round trip is exact. A writer stages its group as a separate directory next to
the store and renames it into place, setting the `complete` marker attribute last; readers refuse a
group without it. Writers of different ranks only ever create the shared parent groups'
metadata if it is missing, so they can run concurrently in different processes.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import uuid
import zlib
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20           # 1 MiB inner chunks
SHARD_BYTES = 64 << 20          # 64 MiB shards (one file each)
PREFETCH_DEPTH = 4              # tensors held ready by the prefetch thread


class CacheError(RuntimeError):
    """A cache entry or rank group that cannot be written or read back intact; the message names it."""


def _codecs():
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=3), Crc32cCodec()]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A private copy of the tensor's elements as flat uint8 (row-major, any dtype, any strides)."""
    t = tensor.detach()
    if t.layout != torch.strided:
        raise TypeError(f"only strided (dense) tensors can be cached, not {t.layout}")
    t = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return np.array(t.view(torch.uint8).numpy(), copy=True)


def _ensure_parents(root: Path) -> None:
    """Create the root and `ranks` groups if missing, without rewriting them if present.

    Root metadata is written by zarr with set-if-not-exists (an exclusive link); the `ranks` group
    is created with overwrite=False, and a concurrent writer winning that race is fine (both write
    the same attribute-free metadata atomically, or we get ContainsGroupError and just open it).
    """
    import zarr
    from zarr.errors import ContainsGroupError
    from zarr.storage import LocalStore

    for _ in range(3):
        try:
            zarr.open_group(LocalStore(str(root)), path="ranks", mode="a")
            return
        except ContainsGroupError:
            continue
    zarr.open_group(LocalStore(str(root)), path="ranks", mode="r")


class TensorCacheWriter:
    """Collects one rank's tensors in memory and writes them as the group `ranks/<rank>` on close()."""

    def __init__(self, root: Path, rank: int):
        self.root = Path(root)
        self.rank = int(rank)
        self._keys: list[str] = []
        self._seen: set[str] = set()
        self._dtypes: list[str] = []
        self._shapes: list[list[int]] = []
        self._chunks: list[np.ndarray] = []
        self._closed = False

    @property
    def group_path(self) -> Path:
        return self.root / "ranks" / str(self.rank)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise CacheError(f"cache writer of rank {self.rank} ({self.group_path}) is already closed")
        if not isinstance(key, str) or not key:
            raise ValueError(f"cache key must be a non-empty string, not {key!r}")
        if key in self._seen:
            raise CacheError(f"cache tensor {key} of rank {self.rank} was put twice")
        raw = _raw_bytes(tensor)
        self._seen.add(key)
        self._keys.append(key)
        self._dtypes.append(_dtype_name(tensor.dtype))
        self._shapes.append([int(s) for s in tensor.shape])
        self._chunks.append(raw)

    def close(self) -> None:
        """Write the rank group atomically (stage next to the store, marker last, rename)."""
        if self._closed:
            return
        import zarr
        from zarr.storage import LocalStore

        nbytes = np.array([c.size for c in self._chunks], dtype=np.int64)
        offsets = np.zeros(len(nbytes), dtype=np.int64)
        if len(nbytes):
            offsets[1:] = np.cumsum(nbytes)[:-1]
        checksums = np.array([zlib.crc32(c) for c in self._chunks], dtype=np.uint32)
        data = np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.uint8)
        self._chunks = []

        self.root.parent.mkdir(parents=True, exist_ok=True)
        stage = self.root.parent / f".{self.root.name}.rank{self.rank}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            group = zarr.open_group(LocalStore(str(stage)), mode="w")
            chunk = max(1, min(CHUNK_BYTES, data.size))
            per_shard = max(1, min(SHARD_BYTES // chunk, -(-data.size // chunk)))
            arr = group.create_array("data", shape=data.shape, dtype=np.uint8, chunks=(chunk,),
                                     shards=(chunk * per_shard,), compressors=_codecs())
            if data.size:
                arr[:] = data
            for name, values in (("offsets", offsets), ("nbytes", nbytes), ("checksums", checksums)):
                a = group.create_array(name, shape=values.shape, dtype=values.dtype,
                                       chunks=(max(1, len(values)),), compressors=_codecs())
                if len(values):
                    a[:] = values
            group.attrs.update({"format_version": FORMAT_VERSION, "rank": self.rank, "keys": self._keys,
                                "dtypes": self._dtypes, "shapes": self._shapes})
            group.attrs.update({"complete": True})       # marker last
            _ensure_parents(self.root)
            final = self.group_path
            old = None
            if final.exists():
                old = final.with_name(f".{self.rank}.old.{uuid.uuid4().hex[:8]}")
                os.replace(final, old)
            os.replace(stage, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except Exception:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        self._closed = True

    def __enter__(self) -> TensorCacheWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()              # a failed block leaves no (partial) group behind


class TensorCacheReader:
    """Reads one rank's cached tensors, verifying each entry's checksum; optional background prefetch."""

    def __init__(self, root: Path, rank: int, prefetch_depth: int = PREFETCH_DEPTH):
        import zarr

        self.root = Path(root)
        self.rank = int(rank)
        self.path = self.root / "ranks" / str(self.rank)
        meta = self.path / "zarr.json"
        if not meta.is_file():
            raise CacheError(f"no cache group for rank {self.rank} at {self.path} (missing {meta})")
        try:
            group = zarr.open_group(str(self.path), mode="r")
            attrs = dict(group.attrs)
        except Exception as err:  # noqa: BLE001 - any failure reading metadata is reported the same way
            raise CacheError(f"cache group metadata {meta} cannot be read: {err}") from None
        if attrs.get("complete") is not True:
            raise CacheError(f"cache group {self.path} of rank {self.rank} is incomplete (its writer never closed)")
        if attrs.get("format_version") != FORMAT_VERSION:
            raise CacheError(f"{meta}: cache format {attrs.get('format_version')!r}, "
                             f"this PrismLLM reads {FORMAT_VERSION}")
        index = {}
        for name in ("offsets", "nbytes", "checksums"):
            try:
                index[name] = group[name][:]
            except Exception as err:  # noqa: BLE001
                raise CacheError(f"cache index {self.path / name} is missing or corrupt: "
                                 f"{type(err).__name__}: {err}") from None
        try:
            self._data = group["data"]
        except Exception as err:  # noqa: BLE001
            raise CacheError(f"cache data {self.path / 'data'} is missing or corrupt: {err}") from None
        keys, dtypes, shapes = attrs["keys"], attrs["dtypes"], attrs["shapes"]
        if not (len(keys) == len(dtypes) == len(shapes) == len(index["offsets"])
                == len(index["nbytes"]) == len(index["checksums"])):
            raise CacheError(f"cache group {self.path}: index arrays and attributes disagree in length")
        self._entries = {k: (int(o), int(n), int(c), d, tuple(s)) for k, o, n, c, d, s in
                         zip(keys, index["offsets"], index["nbytes"], index["checksums"], dtypes, shapes)}
        self._order = list(keys)
        # prefetch state
        self._depth = max(1, int(prefetch_depth))
        self._ready: dict[str, object] = {}            # drained from the queue, not yet asked for
        self._inflight: set[str] = set()               # requested for prefetch, not yet drained
        self._pending: list[str] = []                  # not yet picked up by the thread
        self._cond = threading.Condition()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- reading ---------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key)[4]

    def nbytes(self, key: str) -> int:
        return self._entry(key)[1]

    def _entry(self, key: str):
        try:
            return self._entries[key]
        except KeyError:
            raise CacheError(f"cache tensor {key} is not in the cache of rank {self.rank} ({self.path})") from None

    def _read_range(self, start: int, stop: int) -> np.ndarray:
        """The only place that reads tensor bytes from the store (a seam tests count through)."""
        return self._data[start:stop]

    def _load(self, key: str) -> torch.Tensor:
        offset, nbytes, _, _, _ = self._entry(key)
        return self._build(key, self._read(key, offset, offset + nbytes))

    def _read(self, what: str, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0, dtype=np.uint8)
        try:
            return np.ascontiguousarray(self._read_range(start, stop), dtype=np.uint8)
        except Exception as err:  # noqa: BLE001 - codec CRC failures, missing shards, ...
            raise CacheError(f"cache tensor {what} of rank {self.rank} cannot be read from "
                             f"{self.path / 'data'}: {type(err).__name__}: {err}") from None

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors from one read of the bytes that span them (each checked on its own)."""
        entries = {k: self._entry(k) for k in keys}
        if not entries:
            return {}
        lo = min(e[0] for e in entries.values())
        hi = max(e[0] + e[1] for e in entries.values())
        span = self._read(f"range of {len(entries)} entries", lo, hi)
        return {k: self._build(k, span[e[0] - lo:e[0] - lo + e[1]]) for k, e in entries.items()}

    def _build(self, key: str, raw: np.ndarray) -> torch.Tensor:
        _, nbytes, checksum, dtype_name, shape = self._entry(key)
        if raw.size != nbytes or zlib.crc32(raw) != checksum:
            raise CacheError(f"cache tensor {key} of rank {self.rank} fails its checksum ({self.path / 'data'})")
        try:
            dtype = _dtype_from_name(dtype_name)
            if not nbytes:
                return torch.empty(shape, dtype=dtype)
            return torch.from_numpy(raw).view(dtype).reshape(shape)
        except Exception as err:  # noqa: BLE001
            raise CacheError(f"cache tensor {key} of rank {self.rank} cannot be rebuilt as "
                             f"{dtype_name}{list(shape)}: {err}") from None

    def get(self, key: str) -> torch.Tensor:
        """The tensor with its exact dtype and shape; CacheError naming rank and key if it is bad."""
        self._entry(key)
        with self._cond:
            hit = key in self._ready or key in self._inflight
        if hit:
            item = self._take_prefetched(key)
            if isinstance(item, BaseException):
                raise item
            return item
        return self._load(key)

    # -- prefetch --------------------------------------------------------------------------------

    def prefetch(self, keys: list[str]) -> None:
        """Load these entries in a background thread (at most `prefetch_depth` held at once)."""
        for key in keys:
            self._entry(key)
        with self._cond:
            for key in keys:
                if key not in self._inflight and key not in self._ready:
                    self._inflight.add(key)
                    self._pending.append(key)
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self._depth)
                self._thread = threading.Thread(target=self._worker, name=f"cache-prefetch-r{self.rank}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _worker(self) -> None:
        assert self._queue is not None
        while True:
            with self._cond:
                while not self._pending and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                key = self._pending.pop(0)
            try:
                item: object = self._load(key)
            except BaseException as err:  # noqa: BLE001 - handed to the get() of this key
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put((key, item), timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _take_prefetched(self, key: str) -> object:
        assert self._queue is not None
        while True:
            with self._cond:
                if key in self._ready:
                    return self._ready.pop(key)
            got, item = self._queue.get()
            with self._cond:
                self._inflight.discard(got)
                if got == key:
                    return item
                self._ready[got] = item

    def close(self) -> None:
        """Stop the prefetch thread and drop what it holds."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ready.clear()

    def __enter__(self) -> TensorCacheReader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
