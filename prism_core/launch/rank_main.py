"""Entry point of one launched rank process (`python -m prism_core.launch.rank_main`).

It pins the process to one intra-op thread, makes sure it dies with its launcher, starts the
per-rank runtime (iteration boundaries) and, in record mode, the prism backend with its trace
recorder and memory counter; runs the program — a built-in workload or a user script via
runpy, unedited — and leaves `results/<rank>.json` and `trace_parts/<rank>.npz`, plus on
failure `errors/<rank>.json` with the traceback, the time it happened and, for an
out-of-memory error, the step.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import faulthandler
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
from prism_core.launch.cores import bind_from_env

BUILTIN_MODULES = {"builtin:moe_gpt": "prism_core.workloads.moe_gpt.train"}
ENV_INSTRUMENT = "PRISM_INSTRUMENT"  # "1": prism backend + trace + flight record (record mode)
ENV_MEMORY = "PRISM_MEMORY"          # "1": count live tensor bytes with the native allocator
ENV_CAPACITY = "PRISM_DEVICE_MEMORY_BYTES"
PR_SET_PDEATHSIG = 1
# a rank still running this long after its result is on disk has its threads' stacks written to
# its log: the launch waits for every rank's exit code, so a hang in the exit holds all of it
EXIT_STALL_S = 30.0


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
    run_rank(ns.program, args, ns.result_dir)


def run_rank(program: str, args: list[str], result_dir: Path, transport=None) -> None:
    """Run one rank to the end and leave the process (never returns).

    `transport`: the backend's inner transport factory; None is gloo (record mode), collection
    passes its coordinator transport.
    """
    bind_from_env()          # before torch or gloo start a thread: they all inherit the cores
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    rt = runtime.install(rank)
    instrument = os.environ.get(ENV_INSTRUMENT) == "1" or transport is not None
    rec = _instrument(rank, result_dir, rt, transport) if instrument else None
    if transport is not None:
        transport.start_process()   # collection: wait for a slot before running any of the program
    failure = None
    try:
        _run_program(program, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure = {"traceback": f"the program called sys.exit({exc.code!r})\n"}
    except BaseException as exc:
        failure = {"traceback": _program_traceback(exc)}
        if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
            failure["oom"] = {"step": len(rt.step_ends), "peak_bytes": rec.memory.peak_bytes() if rec and rec.memory
                              else None}
    result = rt.as_dict()
    if rec is not None:
        result["step_peaks"] = rec.step_peaks
        if failure is not None and rec.memory is not None:
            result["peak_at_exit"] = rec.memory.peak_bytes()  # within the step that did not finish
        rec.write_part(result_dir / "trace_parts")
    if failure is not None:
        result["oom"] = failure.get("oom")
    runtime.write_json_atomic(result_dir / "results" / f"{rank}.json", result)
    if transport is None:      # a launched rank (collection's forks flush the tensor cache after this)
        _stacks_if_exit_stalls()
    if failure is not None:
        _fail(result_dir, rank, failure)
    # Run the program's atexit handlers, then leave without interpreter finalisation: with gloo, a
    # worker thread still releasing the last backward's work at that moment aborts the process
    # ("terminate called without an active exception") after the job has succeeded.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if transport is not None:
        transport.finish_process()   # results are on disk: the coordinator may count this rank done
    os._exit(0)


def _instrument(rank: int, result_dir: Path, rt, transport=None):
    """The prism backend with a trace recorder and flight record, and (record mode) the memory counter."""
    from prism_core import backend
    from prism_core.replay.pacing import Nudger
    from prism_core.replay.stopped import StoppedTime
    from prism_core.trace import recorder
    from prism_core.trace.flight import Flight

    rec = recorder.start(rank)
    rec.flight = Flight(result_dir / "flight", rank, Nudger.from_env())
    rec.stopped = StoppedTime.from_env()      # a launch held stopped from outside (bench/turns.py)
    if os.environ.get(ENV_MEMORY) == "1":
        from prism_core import memory

        memory.install()
        limit = os.environ.get(ENV_CAPACITY)
        memory.set_limit(int(limit) if limit else None)
        memory.reset_peak()
        rec.memory = memory
    backend.install(rec, transport)
    rt.on_step = rec.iteration_end
    return rec


def _program_traceback(exc: BaseException) -> str:
    """The traceback from the program's own frames on (the launch machinery's frames dropped)."""
    te = traceback.TracebackException.from_exception(exc)
    frames = [f for f in te.stack if f.filename != __file__ and not f.filename.startswith("<frozen runpy")]
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def _stacks_if_exit_stalls(after_s: float = EXIT_STALL_S) -> None:
    """Arm Python's fault handler to write every thread's stack to stderr (the rank's log) if the
    process has not left `after_s` from now; nothing happens if it leaves first."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            faulthandler.dump_traceback_later(after_s, exit=False, file=stream)
    except (OSError, ValueError, AttributeError):     # no file descriptor behind stderr
        pass


def _fail(result_dir: Path, rank: int, failure: dict) -> None:
    sys.stderr.write(failure["traceback"])
    sys.stderr.flush()
    runtime.write_json_atomic(result_dir / "errors" / f"{rank}.json", {"rank": rank, "time": time.time(), **failure})
    # Skip interpreter teardown: a failed collective can leave threads that block a clean exit.
    os._exit(1)


if __name__ == "__main__":
    main()
