"""Tests of the per-rank Zarr tensor cache: round trips, concurrent writers, corruption, prefetch, atomicity."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import zarr

import prism_core.cache.tensors as tensors_mod
from prism_core.cache import CacheError, TensorCacheReader, TensorCacheWriter

REPO = Path(__file__).resolve().parents[2]


def sample_tensors(rank: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors of many dtypes/shapes; the subprocess writer rebuilds the same ones."""
    g = torch.Generator().manual_seed(1234 + rank)
    # bf16 bit patterns including +-0, +-inf, a NaN with payload and a subnormal: exact bits must survive
    bf16_bits = torch.tensor([0, -32768, 0x7F80, -128, 0x7FC1, 0x0001, 0x3F80], dtype=torch.int16)
    return {
        f"r{rank}/f32": torch.randn(3, 5, generator=g),
        f"r{rank}/bf16": torch.randn(4, 7, generator=g).to(torch.bfloat16),
        f"r{rank}/bf16_bits": bf16_bits.view(torch.bfloat16),
        f"r{rank}/i64": torch.randint(-2**62, 2**62, (6,), generator=g, dtype=torch.int64),
        f"r{rank}/bool": torch.rand(9, generator=g) > 0.5,
        f"r{rank}/empty": torch.zeros(0, 4, dtype=torch.float16),
        f"r{rank}/noncontig": torch.randn(6, 8, generator=g).t()[::2],
        f"r{rank}/scalar": torch.tensor(2.5, dtype=torch.float64),
        f"r{rank}/big": torch.randn(300_000, generator=g),       # > 1 MiB: spans several chunks
    }


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.numel():
        # compare bits, so NaN payloads and -0 count
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def write_rank(root: Path, rank: int) -> dict[str, torch.Tensor]:
    ts = sample_tensors(rank)
    with TensorCacheWriter(root, rank) as w:
        for k, v in ts.items():
            w.put(k, v)
    return ts


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "tensors.zarr"


def test_round_trip_two_ranks_concurrent_writers(store: Path):
    # rank 1 is written by another process while this one writes rank 0, on a store that does not exist yet
    # (the child reports "ready" once its imports are done, so both writes really overlap)
    script = ("import sys; from pathlib import Path; from tests.cache.test_cache import write_rank; "
              "print('ready', flush=True); write_rank(Path(sys.argv[1]), 1)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(store)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    want0 = write_rank(store, 0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    want = {0: want0, 1: sample_tensors(1)}
    for rank in (0, 1):
        with TensorCacheReader(store, rank) as r:
            assert r.keys() == list(want[rank])
            for k, v in want[rank].items():
                assert_same(r.get(k), v)
    assert dict(zarr.open_group(str(store), mode="r").attrs) == {}
    assert not [p for p in store.parent.iterdir() if p.name.endswith(".tmp")]      # no staging left


def test_layout_and_bf16_stored_as_raw_bytes(store: Path):
    write_rank(store, 0)
    g = zarr.open_group(str(store / "ranks" / "0"), mode="r")
    assert g["data"].dtype == "uint8" and g["offsets"].dtype == "int64" and g["checksums"].dtype == "uint32"
    attrs = dict(g.attrs)
    assert attrs["complete"] is True
    i = attrs["keys"].index("r0/bf16")
    assert attrs["dtypes"][i] == "bfloat16" and attrs["shapes"][i] == [4, 7]
    off, n = int(g["offsets"][i]), int(g["nbytes"][i])
    t = sample_tensors(0)["r0/bf16"]
    assert bytes(g["data"][off:off + n]) == t.view(torch.int16).numpy().tobytes()


def test_rewriting_a_rank_replaces_it(store: Path):
    write_rank(store, 0)
    with TensorCacheWriter(store, 0) as w:
        w.put("only", torch.arange(3))
    with TensorCacheReader(store, 0) as r:
        assert r.keys() == ["only"]
        assert_same(r.get("only"), torch.arange(3))
    assert sorted(p.name for p in (store / "ranks").iterdir()) == ["0", "zarr.json"]


def _flip_a_byte(store: Path, entry: int) -> None:
    """Corrupt one byte of rank 0's entry number `entry`, rewriting it through zarr (codecs stay valid)."""
    g = zarr.open_group(str(store / "ranks" / "0"), mode="r+")
    off = int(g["offsets"][entry]) + 3
    g["data"][off:off + 1] = g["data"][off:off + 1] ^ 0xFF


def test_corrupted_bytes_rewritten_through_zarr_fail_checksum(store: Path):
    want = write_rank(store, 0)
    _flip_a_byte(store, list(want).index("r0/i64"))
    with TensorCacheReader(store, 0) as r:
        with pytest.raises(CacheError, match=r"cache tensor r0/i64 of rank 0 fails its checksum"):
            r.get("r0/i64")
        assert_same(r.get("r0/f32"), want["r0/f32"])             # other entries still fine
        r.prefetch(["r0/i64"])                                   # a prefetched bad entry fails at get
        with pytest.raises(CacheError, match=r"r0/i64 of rank 0"):
            r.get("r0/i64")


def test_get_many_equals_get_and_checks_each_tensor(store: Path):
    want = write_rank(store, 0)
    with TensorCacheReader(store, 0) as r:
        many = r.get_many(list(want))
        assert list(many) == list(want)
        for key, tensor in want.items():
            assert_same(many[key], tensor)
        assert r.get_many([]) == {}
    _flip_a_byte(store, list(want).index("r0/i64"))
    with TensorCacheReader(store, 0) as r:
        with pytest.raises(CacheError, match=r"cache tensor r0/i64 of rank 0 fails its checksum"):
            r.get_many(list(want))


def test_flipped_byte_in_chunk_file_is_detected(store: Path):
    write_rank(store, 2)
    shard = store / "ranks" / "2" / "data" / "c" / "0"
    raw = bytearray(shard.read_bytes())
    raw[20] ^= 0x01
    shard.write_bytes(bytes(raw))
    with TensorCacheReader(store, 2) as r, pytest.raises(CacheError) as info:
        r.get("r2/f32")
    msg = str(info.value)
    assert "r2/f32" in msg and "rank 2" in msg and str(store / "ranks" / "2" / "data") in msg


def test_prefetch_matches_get_and_does_not_read_in_get(store: Path):
    want = write_rank(store, 0)
    with TensorCacheReader(store, 0) as direct:
        direct_tensors = {k: direct.get(k) for k in want}
    reads: list[str] = []
    r = TensorCacheReader(store, 0, prefetch_depth=2)
    orig = r._read_range

    def counting(start: int, stop: int):
        reads.append(threading.current_thread().name)
        return orig(start, stop)

    r._read_range = counting
    keys = list(want)
    try:
        r.prefetch(keys[:5])
        r.prefetch(keys[5:])                                     # a second call extends the same queue
        order = [keys[2], *keys[:2], *keys[3:]]                  # one out of order: earlier ones wait ready
        for k in order:
            assert_same(r.get(k), direct_tensors[k])
        nonempty = sum(1 for v in want.values() if v.numel())
        assert len(reads) == nonempty
        assert threading.current_thread().name not in reads      # get() never touched the store
        # a key not prefetched (any more) is read directly, in the caller's thread
        assert_same(r.get(keys[0]), want[keys[0]])
        assert reads[-1] == threading.current_thread().name
    finally:
        r.close()


def test_missing_key_and_rank(store: Path):
    write_rank(store, 0)
    with TensorCacheReader(store, 0) as r:
        with pytest.raises(CacheError, match="cache tensor nope is not in the cache of rank 0"):
            r.get("nope")
        with pytest.raises(CacheError, match="nope"):
            r.prefetch(["r0/f32", "nope"])
    with pytest.raises(CacheError, match=str(store / "ranks" / "5")):
        TensorCacheReader(store, 5)


def test_unclosed_writer_leaves_nothing_readable(store: Path):
    write_rank(store, 0)
    w = TensorCacheWriter(store, 1)
    w.put("a", torch.ones(3))                                    # never closed
    with pytest.raises(CacheError, match=str(store / "ranks" / "1")):
        TensorCacheReader(store, 1)


def test_close_failing_midway_leaves_no_group(store: Path, monkeypatch):
    def boom(root):
        raise OSError("disk gone")

    monkeypatch.setattr(tensors_mod, "_ensure_parents", boom)
    w = TensorCacheWriter(store, 0)
    w.put("a", torch.ones(3))
    with pytest.raises(OSError, match="disk gone"):
        w.close()
    assert not (store / "ranks" / "0").exists()
    assert not list(store.parent.glob(".*.tmp"))


def test_group_without_completion_marker_is_refused(store: Path):
    write_rank(store, 0)
    g = zarr.open_group(str(store / "ranks" / "0"), mode="r+")
    attrs = dict(g.attrs)
    del attrs["complete"]
    g.attrs.clear()
    g.attrs.update(attrs)
    with pytest.raises(CacheError, match=r"ranks/0 of rank 0 is incomplete"):
        TensorCacheReader(store, 0)


def test_duplicate_key_and_put_after_close(store: Path):
    w = TensorCacheWriter(store, 0)
    w.put("a", torch.ones(1))
    with pytest.raises(CacheError, match="cache tensor a of rank 0 was put twice"):
        w.put("a", torch.ones(1))
    w.close()
    with pytest.raises(CacheError, match="already closed"):
        w.put("b", torch.ones(1))


def test_put_copies_the_tensor(store: Path):
    t = torch.zeros(4)
    with TensorCacheWriter(store, 0) as w:
        w.put("t", t)
        t += 1                                                   # later in-place change is not cached
    with TensorCacheReader(store, 0) as r:
        assert_same(r.get("t"), torch.zeros(4))


def test_empty_rank(store: Path):
    TensorCacheWriter(store, 3).close()
    with TensorCacheReader(store, 3) as r:
        assert r.keys() == []
