"""The zygote: imports torch and the program's modules once, then forks every logical rank.

Forked ranks share the zygote's memory pages (torch, the workload's modules) copy-on-write,
so a rank that is paused in a wait costs little more than its own tensors. Each child gets its
torchrun environment (RANK, LOCAL_RANK, ...), sends its output to `logs/rank_<r>.log`, runs the
program with the coordinator transport, and dies with the zygote, which dies with the collector.
The zygote exits 0 when every rank did.

    python -m prism_core.collect.zygote --world W --result-dir DIR --program P [-- args]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prism_core.launch.rank_main import BUILTIN_MODULES, _die_with_launcher, run_rank


def _preload(program: str) -> None:
    import importlib

    import torch  # noqa: F401  (the point: imported once, shared by every fork)
    import torch.distributed  # noqa: F401

    from prism_core import backend, trace  # noqa: F401
    from prism_core.collect import client  # noqa: F401

    if program in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[program])


def _child(rank: int, program: str, args: list[str], result_dir: Path, mode: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
                       "PRISM_LAUNCHER_PID": str(os.getppid())})
    log = os.open(result_dir / "logs" / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    _die_with_launcher()
    if mode == "rules":
        from prism_core.collect.local import RulesTransport as transport
    else:
        from prism_core.collect.client import CoordinatorTransport as transport
    run_rank(program, args, result_dir, transport=transport)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prism_core.collect.zygote")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--mode", choices=("context_switch", "rules"), default="context_switch")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks to run (default: all)")
    parser.add_argument("--concurrency", type=int, default=None, help="ranks alive at once (default: all)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    _die_with_launcher()
    _preload(ns.program)
    (ns.result_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.environ["PRISM_LAUNCHER_PID"] = str(os.getpid())
    todo = [int(r) for r in ns.ranks.split(",")] if ns.ranks else list(range(ns.world))
    limit = ns.concurrency or len(todo)
    children = {}
    while todo or children:
        while todo and len(children) < limit:
            rank = todo.pop(0)
            pid = os.fork()
            if pid == 0:
                try:
                    _child(rank, ns.program, args, ns.result_dir, ns.mode)
                finally:
                    os._exit(1)   # run_rank leaves with os._exit itself; this only catches a broken start
            children[pid] = rank
        pid, code = os.wait()
        rank = children.pop(pid, None)
        if rank is not None and code != 0:
            # one rank failed: the others may wait forever for it; stop them all and report
            for other in children:
                try:
                    os.kill(other, 9)
                except ProcessLookupError:
                    pass
            sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
