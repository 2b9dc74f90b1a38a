"""Build PrismTrace parts the way ranks do: one Recorder per simulated rank, driven by backend calls."""

from __future__ import annotations

from pathlib import Path

from prism_core.trace import merge_parts
from prism_core.trace.recorder import Recorder

WORLD = "world"


def blocking(rec: Recorder, op: str, group: str, ranks: tuple[int, ...], nbytes: int, dtype: str = "float32",
             peer: int = -1, tag: int = -1, key: tuple | None = None, callback: bool = False) -> int:
    """A c10d blocking call: issue, issued, wait right away (one comm node, no wait node)."""
    idx = rec.issue(op, group, ranks, peer, nbytes, dtype, tag, key)
    rec.issued(idx)
    if callback:
        rec.complete(idx)
    inline, began = rec.wait_begin(idx, blocking=True)
    rec.wait_end(idx, inline, began)
    return idx


def start(rec: Recorder, op: str, group: str, ranks: tuple[int, ...], nbytes: int, dtype: str = "float32",
          peer: int = -1, tag: int = -1, key: tuple | None = None) -> int:
    """An async_op=True call: issued now, waited later through `finish`."""
    idx = rec.issue(op, group, ranks, peer, nbytes, dtype, tag, key)
    rec.issued(idx)
    return idx


def finish(rec: Recorder, idx: int, blocking: bool = False) -> None:
    inline, began = rec.wait_begin(idx, blocking=blocking)
    rec.wait_end(idx, inline, began)


def send(rec: Recorder, dst: int, nbytes: int, tag: int = 0, group: str = WORLD,
         ranks: tuple[int, ...] | None = None, dtype: str = "float32") -> int:
    ranks = ranks if ranks is not None else tuple(range(max(rec.rank, dst) + 1))
    return blocking(rec, "send", group, ranks, nbytes, dtype, peer=dst, tag=tag, key=(rec.rank, dst, tag))


def recv(rec: Recorder, src: int, nbytes: int, tag: int = 0, group: str = WORLD,
         ranks: tuple[int, ...] | None = None, dtype: str = "float32") -> int:
    ranks = ranks if ranks is not None else tuple(range(max(rec.rank, src) + 1))
    return blocking(rec, "recv", group, ranks, nbytes, dtype, peer=src, tag=tag, key=(src, rec.rank, tag))


def merged(tmp_path: Path, recs: list[Recorder], name: str = "parts"):
    parts = tmp_path / name
    for rec in recs:
        rec.write_part(parts)
    return merge_parts(parts, len(recs))


class FakeMemory:
    """Stands in for the native memory counter: a peak per step, reset after each read."""

    def __init__(self, peaks: list[int]):
        self.peaks, self.resets = list(peaks), 0

    def peak_bytes(self) -> int:
        return self.peaks[self.resets]

    def reset_peak(self) -> None:
        self.resets += 1

    def current_bytes(self) -> int:
        """What the memory plot samples: here the step's peak, a known value per step."""
        return self.peaks[min(self.resets, len(self.peaks) - 1)]


def reference_job(world_size: int = 4, pair_first: frozenset[int] = frozenset({2, 3}), nbytes: int = 4096,
                  preregister: dict[int, list[str]] | None = None, memory: bool = False) -> list[Recorder]:
    """A valid job of two iterations: a broadcast on world and an allgather on a pair subgroup (ranks in
    `pair_first` issue the allgather first, so ranks register their groups in different orders), an
    async allreduce on world waited after a send/recv pair between ranks 0 and 1, and annotations.
    `preregister`: rank -> group names it registers (`Recorder.group_id`) before any op."""
    assert world_size >= 2
    world = tuple(range(world_size))
    recs = [Recorder(r) for r in range(world_size)]

    def pair_of(r: int) -> tuple[str, tuple[int, ...]] | None:
        base = r - r % 2
        return (f"pair{base}", (base, base + 1)) if base + 1 < world_size else None

    for rec in recs:
        if memory:
            rec.memory = FakeMemory([1000 * (rec.rank + 1) + s for s in range(2)])
        for name in (preregister or {}).get(rec.rank, []):
            rec.group_id(name, world if name == WORLD else pair_of(rec.rank)[1])
    for step in range(2):
        for rec in recs:
            r, pair = rec.rank, pair_of(rec.rank)

            def bcast() -> None:
                blocking(rec, "broadcast", WORLD, world, 256, "int64", peer=0)

            def gather() -> None:
                rec.push("fwd", step, 0)
                if pair is not None:
                    blocking(rec, "allgather", pair[0], pair[1], nbytes, "bfloat16")
                rec.pop()

            for part in ((gather, bcast) if r in pair_first else (bcast, gather)):
                part()
            rec.push("bwd", step, 1)
            work = start(rec, "allreduce", WORLD, world, nbytes, "float32")
            if r == 0:
                send(rec, 1, 512, tag=7, ranks=world)
            elif r == 1:
                recv(rec, 0, 512, tag=7, ranks=world)
            rec.pop()
            finish(rec, work)
            rec.iteration_end()
    return recs
