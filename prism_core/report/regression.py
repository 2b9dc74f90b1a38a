"""Regression detection between two versions of a job's metrics (the nightly run's verdict).

For each rank of interest present in both, the relative change of its iteration time and of its
peak memory; a change whose size exceeds the configured fraction is a regression (either
direction: a step that got much faster overnight is as suspicious as one that got slower).
An out-of-memory that appears or disappears is always reported.
"""

from __future__ import annotations

from dataclasses import dataclass


class RegressionError(RuntimeError):
    pass


@dataclass
class Change:
    rank: str
    figure: str          # "iteration time" | "peak memory" | "oom"
    before: float | None
    after: float | None
    limit: float

    @property
    def relative(self) -> float | None:
        if self.before in (None, 0) or self.after is None:
            return None
        return (self.after - self.before) / self.before

    @property
    def exceeded(self) -> bool:
        if self.figure == "oom":
            return self.before != self.after
        rel = self.relative
        return rel is not None and abs(rel) > self.limit

    def sentence(self) -> str:
        if self.figure == "oom":
            return f"rank {self.rank}: out of memory {'now' if self.after else 'no longer'}"
        unit = (lambda v: f"{v * 1e3:.2f} ms") if self.figure == "iteration time" else (lambda v: f"{int(v):,} B")
        return (f"rank {self.rank}: {self.figure} {unit(self.before)} -> {unit(self.after)} "
                f"({self.relative:+.2%}, limit ±{self.limit:.2%})")


def compare(previous: dict, current: dict, max_time_change: float, max_memory_change: float) -> list[Change]:
    """Every compared figure of the ranks both metrics documents hold."""
    out = []
    for rank, now in current["ranks"].items():
        before = previous.get("ranks", {}).get(rank)
        if before is None:
            continue
        out.append(Change(rank, "iteration time", before.get("iteration_time_s"), now.get("iteration_time_s"),
                          max_time_change))
        out.append(Change(rank, "peak memory", before.get("peak_memory_bytes"), now.get("peak_memory_bytes"),
                          max_memory_change))
        out.append(Change(rank, "oom", bool(before.get("oom")), bool(now.get("oom")), 0.0))
    return out


def check(previous: dict, current: dict, max_time_change: float, max_memory_change: float,
          previous_label: str = "the previous version") -> list[Change]:
    """The changes; raises RegressionError naming every figure that moved beyond its limit."""
    changes = compare(previous, current, max_time_change, max_memory_change)
    bad = [c for c in changes if c.exceeded]
    if bad:
        raise RegressionError(f"compared with {previous_label}: " + "; ".join(c.sentence() for c in bad))
    return changes
