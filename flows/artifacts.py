"""Prefect artifacts mirroring each published version, under keys stable per job so that the UI's
artifact pages show the history: the markdown report, a table of the ranks of interest, a link
to the version's directory; and progress artifacts for long stages."""

from __future__ import annotations

import re
import sys

from prefect.artifacts import (
    create_link_artifact, create_markdown_artifact, create_progress_artifact, create_table_artifact,
    update_progress_artifact,
)

from prism_core.report.publish import Published


def key(job: str, what: str) -> str:
    """Prefect keys take lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"prism-{job}-{what}".lower()).strip("-")


def mirror(job: str, published: Published, emulated: dict) -> None:
    v = published.version
    create_markdown_artifact(key=key(job, "report"), markdown=published.report.read_text(),
                             description=f"{job} version {v.number}")
    rows = [{"rank": int(r), "iteration_time_ms": None if m.get("iteration_time_s") is None
             else round(m["iteration_time_s"] * 1e3, 3),
             "predicted_ms": None if m.get("predicted_iteration_time_s") is None
             else round(m["predicted_iteration_time_s"] * 1e3, 3),
             "peak_memory_bytes": m.get("peak_memory_bytes"), "oom": bool(m.get("oom"))}
            for r, m in emulated["ranks"].items()]
    create_table_artifact(key=key(job, "ranks"), table=rows, description=f"{job} version {v.number}")
    create_link_artifact(key=key(job, "version"), link=v.path.resolve().as_uri(),
                         link_text=f"{job} version {v.number}", description=f"{v.path}")


def echo(line: str) -> None:
    """A progress line on the terminal (stderr, beside Prefect's log lines)."""
    print(line, file=sys.stderr, flush=True)


def _in_a_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class Progress:
    """A Prefect progress artifact (when inside a flow run) and a line on the terminal."""

    def __init__(self, what: str, total: int, echo=None):
        self.what, self.total, self.done = what, max(total, 1), 0
        self.echo = echo
        self.id = None
        if _in_a_run():     # outside one, an artifact would start a temporary server for nothing
            try:
                self.id = create_progress_artifact(progress=0.0, description=what)
            except Exception:  # noqa: BLE001 - no API reachable: the terminal line only
                self.id = None
        self._show()

    def step(self, n: int = 1) -> None:
        if n <= 0:
            return
        self.done = min(self.total, self.done + n)
        if self.id is not None:
            update_progress_artifact(self.id, progress=100.0 * self.done / self.total)
        self._show()

    def _show(self) -> None:
        if self.echo is not None:
            filled = int(20 * self.done / self.total)
            self.echo(f"{self.what}: [{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total}")
