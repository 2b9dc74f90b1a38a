"""Suite-wide settings for `make test`, which spreads whole test files over two pytest-xdist workers.

- Order: the files whose jobs take longest come first (`--no-loadscope-reorder` keeps it), so no
  long file is handed out last to keep one worker busy while the other idles.
- The flow tests (`tests/flows/`) all go to one worker, which then starts the one Prefect test
  harness they share: one start (12-30 s) instead of one a worker, and never two harnesses at
  once (which the project's notes on Prefect advise against).
- Prefect's home: each worker has its own. A `prism` command, or a test script, that starts
  Prefect's temporary server keeps its database there, so two commands on two workers never
  migrate or write one SQLite file at once. (The flow tests' harness has a database of its own.)

Without xdist only the order changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    home = REPO / ".prefect" / f"pytest-{worker}"
    home.mkdir(parents=True, exist_ok=True)     # Prefect creates the last level only
    os.environ["PREFECT_HOME"] = str(home)

FLOWS = "tests/flows/"

# The slowest files of the fast suite on the 2-core machine (pytest --durations), slowest first;
# the flow tests, one unit of work together, are the longest.
HEAVY_FIRST = (
    "tests/flows/test_calibrate_flow.py",
    "tests/flows/test_versions_flow.py",
    "tests/flows/test_pipeline_flow.py",
    "tests/flows/test_multinode.py",
    "tests/flows/test_server.py",
    "tests/emulate/test_stage.py",
    "tests/collect/test_rules.py",
    "tests/workloads/moe_gpt/test_equivalence.py",
    "tests/collect/test_context_switch.py",
    "tests/replay/test_slices.py",
    "tests/workloads/moe_gpt/test_trace.py",
    "tests/test_cli.py",
    "tests/replay/test_ring.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    # stable: within a file, and among the rest, collection order is kept
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)     # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, except that every file under tests/flows/ is one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FlowsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return FLOWS if nodeid.startswith(FLOWS) else super()._split_scope(nodeid)

    return FlowsTogether(config, log)
