"""Suite-wide settings for `make test`, which spreads whole test files over two pytest-xdist workers.

- Order: the files whose jobs take longest come first (`--no-loadscope-reorder` keeps it), so no
  long file is handed out last to keep one worker busy while the other idles.
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
    os.environ["PREFECT_HOME"] = str(REPO / ".prefect" / f"pytest-{worker}")

# The slowest files of the fast suite on the 2-core machine (pytest --durations), slowest first.
HEAVY_FIRST = (
    "tests/emulate/test_stage.py",
    "tests/collect/test_rules.py",
    "tests/workloads/moe_gpt/test_equivalence.py",
    "tests/collect/test_context_switch.py",
    "tests/flows/test_calibrate_flow.py",
    "tests/flows/test_versions_flow.py",
    "tests/flows/test_pipeline_flow.py",
    "tests/replay/test_slices.py",
    "tests/workloads/moe_gpt/test_trace.py",
    "tests/test_cli.py",
    "tests/replay/test_ring.py",
    "tests/flows/test_multinode.py",
    "tests/flows/test_server.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    # stable: within a file, and among the rest, collection order is kept
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST)))
