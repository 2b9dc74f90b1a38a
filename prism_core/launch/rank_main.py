"""Entry point of one launched rank process (`python -m prism_core.launch.rank_main`).

It pins the process to one intra-op thread, makes sure it dies with its launcher, starts the
per-rank runtime (iteration boundaries), runs the program — a built-in workload or a user
script via runpy, unedited — and leaves `results/<rank>.json`, or on failure
`errors/<rank>.json` with the traceback and the time it happened, for the launcher to read.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from prism_core import runtime

BUILTIN_MODULES = {"builtin:moe_gpt": "prism_core.workloads.moe_gpt.train"}
PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """Ask the kernel to kill this rank if the launcher dies (no orphaned ranks)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    expected = os.environ.get("PRISM_LAUNCHER_PID")
    if expected and os.getppid() != int(expected):
        os._exit(1)


def _run_program(program: str, args: list[str]) -> None:
    if program in BUILTIN_MODULES:
        module = importlib.import_module(BUILTIN_MODULES[program])
        from prism_core.config import config_from_dict

        cfg = config_from_dict(json.loads(Path(os.environ["PRISM_CONFIG"]).read_text()))
        module.main(cfg)
        return
    sys.argv = [program, *args]
    sys.path.insert(0, str(Path(program).parent))
    runpy.run_path(program, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prism_core.launch.rank_main")
    parser.add_argument("--program", required=True)
    parser.add_argument("--result-dir", required=True, type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args

    _die_with_launcher()
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rt = runtime.install(rank)
    try:
        _run_program(ns.program, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _fail(ns.result_dir, rank, f"the program called sys.exit({exc.code!r})\n")
    except BaseException as exc:
        _fail(ns.result_dir, rank, _program_traceback(exc))
    runtime.write_json_atomic(ns.result_dir / "results" / f"{rank}.json", rt.as_dict())
    sys.stdout.flush()
    sys.stderr.flush()


def _program_traceback(exc: BaseException) -> str:
    """The traceback from the program's own frames on (the launch machinery's frames dropped)."""
    te = traceback.TracebackException.from_exception(exc)
    frames = [f for f in te.stack if f.filename != __file__ and not f.filename.startswith("<frozen runpy")]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _fail(result_dir: Path, rank: int, tb: str) -> None:
    sys.stderr.write(tb)
    sys.stderr.flush()
    runtime.write_json_atomic(result_dir / "errors" / f"{rank}.json",
                              {"rank": rank, "time": time.time(), "traceback": tb})
    # Skip interpreter teardown: a failed collective can leave threads that block a clean exit.
    os._exit(1)


if __name__ == "__main__":
    main()
