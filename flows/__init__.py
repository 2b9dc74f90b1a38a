"""Prefect flows and deployments: thin wrappers that wire `prism_core` stage functions together.

Nothing here computes; each task calls one plain function of `prism_core`. The pipeline flow
(collect -> timing -> calibrate -> emulate -> report) arrives with the stages it wires.
"""

import os
from pathlib import Path

# Prefect's defaults, chosen for these machines (see the README): runs are kept in the project's
# own home, the temporary server gets time to start, and nothing is sent out.
os.environ.setdefault("PREFECT_HOME", str(Path(__file__).resolve().parents[1] / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
