"""Suite-wide collection order: the files whose jobs take longest run first.

`make test` spreads whole files over two pytest-xdist workers (`--dist loadfile`, so a module's
shared job runs once); a long file handed out last keeps one worker busy while the other idles.
Only the order changes; without xdist it is just as valid.
"""

from __future__ import annotations

import pytest

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
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(HEAVY_FIRST))

    items.sort(key=key)    # stable: within a file, and among the rest, collection order is kept
