"""Shared by tests that launch real rank processes from small torchrun-style scripts.

Each rank of a script first writes its pid to `pids/<rank>`; `assert_nothing_left` then checks
that none of those processes, nor any process running the script, still exists.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import psutil
import yaml

WORLD = 2

# Prepended to every script: record this rank's pid before anything slow happens.
PREAMBLE = """\
import os, sys, time, json, signal
from pathlib import Path
PIDS = Path({pids!r})
PIDS.mkdir(parents=True, exist_ok=True)
(PIDS / os.environ["RANK"]).write_text(str(os.getpid()))
import torch
import torch.distributed as dist
"""


def make_job(tmp_path: Path, body: str, *, name: str = "job", iterations: int = 2, warmup: int = 1,
             loaded_compute: bool = False, **job: object) -> tuple[Path, Path]:
    """Write script `<name>.py` and config `<name>.yaml` under tmp_path; return (config, script).

    The slices of these jobs run without their loaded second run (`emulation.loaded_compute`),
    which would double every slice's time in `make test`, unless a test asks for it; the loaded
    runs are checked in tests/replay/test_slices.py and tests/flows/test_calibrate_flow.py.
    """
    script = tmp_path / f"{name}.py"
    script.write_text(PREAMBLE.format(pids=str(tmp_path / "pids")) + textwrap.dedent(body))
    raw = {"name": name, "job": {"program": str(script), "world_size": WORLD, "iterations": iterations,
                                 "warmup": warmup, **job},
           "emulation": {"loaded_compute": loaded_compute}}
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config, script


def _leftovers(tmp_path: Path, script: Path) -> list[str]:
    """Processes of this launch still present: the pids the ranks wrote, and anything running the script."""
    left = []
    for pid_file in sorted((tmp_path / "pids").glob("*")):
        pid = int(pid_file.read_text())
        try:
            proc = psutil.Process(pid)
            status, cmdline = proc.status(), proc.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            status, cmdline = "?", []
        # A zombie has an empty command line; a recycled pid runs something else entirely.
        if status == psutil.STATUS_ZOMBIE or not cmdline or str(script) in cmdline:
            left.append(f"rank {pid_file.name}: pid {pid} ({status})")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if (str(script) in cmdline and proc.pid != os.getpid()) or our_load(cmdline):
            left.append(f"pid {proc.pid}: {' '.join(cmdline)}")
    return left


def our_load(cmdline: list[str]) -> bool:
    """A neighbour load a launch of this test process started (launch/neighbour_load.py)."""
    return ("prism_core.launch.neighbour_load" in cmdline and "--parent" in cmdline
            and cmdline[cmdline.index("--parent") + 1:][:1] == [str(os.getpid())])


def assert_nothing_left(tmp_path: Path, script: Path, expect_pids: int | None = None) -> None:
    """No rank process of this launch exists any more (waiting up to 2 s for the kernel to finish)."""
    if expect_pids is not None:
        assert len(list((tmp_path / "pids").glob("*"))) == expect_pids, "a rank did not write its pid file"
    deadline = time.monotonic() + 2.0
    while (left := _leftovers(tmp_path, script)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left running: {left}"


# A two-rank script for slice tests: rank 1 raises at step 1 while the file named by $CRASH_FLAG
# exists, so collection (flag absent) succeeds and a slice (flag present) fails.
CRASH_IN_SLICE_SCRIPT = """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.ones(4) * (rank + 1)
        dist.all_reduce(x)
        if rank == 1 and step == 1 and Path(os.environ["CRASH_FLAG"]).exists():
            raise RuntimeError("rank 1 fails in its slice on purpose")
        model(x).sum().backward()
        opt.step()
"""


def assert_no_rank_processes() -> None:
    """No rank process or replay assistant started by this test process is still running."""
    deadline = time.monotonic() + 2.0
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "prism_core." in cmd:     # rank_main, the assistant, the collection's zygote
                left.append((p.pid, cmd[:120]))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left running: {left}"


def rank_result(run_dir: Path, rank: int) -> dict:
    """What a rank printed on its `RESULT <json>` line (the scripts' way to report values)."""
    lines = (Path(run_dir) / "logs" / f"rank_{rank}.log").read_text().splitlines()
    return json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])


class DoneWork:
    """A finished work, for gloo-group stand-ins in unit tests."""
    def wait(self):
        return True
