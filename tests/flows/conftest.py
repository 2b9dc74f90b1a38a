"""One temporary Prefect server for every flow test of the session (starting one costs ~12 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
