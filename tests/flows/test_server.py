"""The Prefect server a command owns: called in process (not final), the settings come back; after
the final command's server stopped, a late Prefect call (a slice task reporting while prism exits)
fails instead of starting another server that would outlive prism."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The late calls are what a Dask thread finishing a slice during prism's exit made: a log through
# the log worker (whose client comes from get_client()) and an event (EventsWorker.instance()).
SCRIPT = """
import threading, psutil
import flows
from prefect import flow, get_run_logger
from prefect.settings import PREFECT_API_URL
from flows.server import command_server

@flow
def tiny():
    get_run_logger().info("in the flow")
    return 1

def servers():
    return [p for p in psutil.Process().children(recursive=True) if "uvicorn" in " ".join(p.cmdline())]

with command_server() as url:
    assert PREFECT_API_URL.value() == url and tiny() == 1
print("in process, after:", PREFECT_API_URL.value(), len(servers()))
with command_server(final=True) as url:
    assert PREFECT_API_URL.value() == url and tiny() == 1
print("final, after:", PREFECT_API_URL.value() == url)

def late():
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    emit_event(event="prism.late", resource={"prefect.resource.id": "prism.late"})
    try:
        with get_client(sync_client=True) as client:
            client.hello()
        print("late call reached a server")
    except Exception as err:
        print("late call failed:", type(err).__name__)

thread = threading.Thread(target=late)
thread.start()
thread.join(120)
left = servers()
print("servers:", len(left))
for p in left:
    p.kill()
"""


@pytest.mark.timeout(300)
def test_no_server_starts_after_the_commands_own():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "in process, after: None 0" in proc.stdout, out   # settings restored, server stopped
    assert "final, after: True" in proc.stdout, out          # still the stopped server's URL
    assert "late call failed" in proc.stdout, out
    assert "servers: 0" in proc.stdout, out
