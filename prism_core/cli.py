"""The `prism` command line (DESIGN.md §9). Exit status 0 on success, non-zero with one paragraph on error."""

from __future__ import annotations

import argparse
import atexit
import signal
import statistics
import sys
from pathlib import Path

from prism_core.config import ConfigError, PrismConfig, load_config


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="YAML job config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.pp=2 (lists: comma-separated)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: artifacts/<name>/<command>)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="PrismLLM: see how a large training job behaves.")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the job for real at full world size (Stage 0) and measure every rank")
    _add_common(rec)
    rec.add_argument("--force", action="store_true", help="launch even if the world looks too large for this machine")
    col = sub.add_parser("collect", help="Stage 1: the bare execution graph of all W ranks on K slots")
    _add_common(col)
    col.add_argument("--slots", type=int, default=None, help="K, rank processes running at once "
                     "(default: emulation.slots)")
    cal = sub.add_parser("calibrate", help="Stage 2: time every rank in slices and predict its iteration time "
                         "(collects the bare graph first, or reuses it)")
    _add_common(cal)
    cal.add_argument("--dask-address", default=None, metavar="tcp://HOST:PORT",
                     help="run the slices on an existing Dask scheduler (default: a local cluster)")
    emu = sub.add_parser("emulate", help="Stage 3: the ranks of interest real, every other rank replayed in "
                         "calibrated time (runs or reuses the earlier stages)")
    _add_common(emu)
    run = sub.add_parser("run", help="the whole pipeline (collect, timing, calibrate, emulate), its report and a "
                         "new version under artifacts/<name>/<n>/")
    _add_common(run)
    rec = sub.add_parser("recalibrate", help="after a kernel change: check one rank's structure against the "
                         "existing bare graph, then timing, calibration, emulation and report on it")
    _add_common(rec)
    for p in (run, rec):
        p.add_argument("--check", action="store_true", help="fail when a rank of interest's iteration time or peak "
                       "memory moved beyond report.max_*_change since the previous version")
    for p in (emu, run, rec):
        p.add_argument("--dask-address", default=None, metavar="tcp://HOST:PORT",
                       help="run the slices on an existing Dask scheduler (default: a local cluster)")
    serve = sub.add_parser("serve", help="register the nightly run with Prefect (cron from report.schedule) and "
                           "run its schedule until interrupted")
    serve.add_argument("config", type=Path, help="YAML job config (see configs/)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (as for run)")
    serve.add_argument("--cron", default=None, help="cron expression (default: the config's report.schedule)")
    serve.add_argument("--name", default=None, help="deployment name (default: <name>-nightly)")
    return parser


def _emulate(cfg: PrismConfig, args) -> str:
    from flows.pipeline import REPORT, run_pipeline

    report = args.command in ("run", "recalibrate")
    out = args.out or Path("artifacts") / cfg.name / ("run" if report else args.command)
    document = run_pipeline(str(args.config), args.overrides, str(out), args.dask_address, report=report,
                            check=getattr(args, "check", False), recalibrate=args.command == "recalibrate")
    text = _summary(cfg, document, out)
    ranks = document["ranks"]
    text += "\npredicted by calibration: " + ", ".join(
        f"rank {r} {m['predicted_iteration_time_s']:.4f} s" for r, m in ranks.items())
    if "emulation" in document:
        text += _emulation_notes(document["emulation"])
    if report:
        text += f"\nreport: {out / REPORT}"
    if "version" in document:
        text += f"\nversion {document['version']['number']}: {document['version']['path']}"
    return text


def _calibrate(cfg: PrismConfig, args) -> str:
    from flows.calibrate import run_calibrate

    out = args.out or Path("artifacts") / cfg.name / "calibrate"
    document = run_calibrate(str(args.config), args.overrides, str(out), args.dask_address)
    text = _summary(cfg, document, out)
    ranks = document["ranks"]
    if len(ranks) <= 16:
        text += "\nwithout inter-slice calibration (each rank as timed in its slice): " + ", ".join(
            f"rank {r} {m['uncalibrated_iteration_time_s']:.4f} s" for r, m in ranks.items())
    return text


def _emulation_notes(e: dict) -> str:
    """The lines `prism emulate` / `prism run` print about the replay: its size, where the ranks of
    interest ran, the pace its virtual ranks followed."""
    hosted = (f" of the job's {e['virtual_ranks_in_job']} (the ranks of interest's neighbours)"
              if e.get("hosted") == "neighbours" else "")
    text = (f"\n{e['virtual_ranks']} virtual ranks replayed{hosted}; {e['groups_instantiated']} of the job's "
            f"{e['groups_in_job']} process groups instantiated")
    placement = e.get("placement") or {}
    if placement and not placement.get("bound"):
        text += (f"\nnote: the ranks of interest and the replay assistant did not get cores of their own "
                 f"({placement.get('reason')}): the emulated times include their contention")
    pace = e.get("follow_pace") or {}
    if pace.get("median") is not None:
        text += (f"\nthe virtual ranks followed the pace of ranks {pace['ranks']} "
                 f"(median {pace['median']:.2f}, emulation.follow_pace)")
    elif pace.get("off"):     # beside an unbound placement the note above says why
        why = "beside the assistant" if placement and not placement.get("bound") else pace["off"]
        text += f"\nthe virtual ranks kept their calibrated compute (no pace read: {why})"
    if e.get("inputs_streamed"):
        text += ("\nnote: the replay assistant streamed its cached inputs (more than its share of memory, "
                 "PRISM_PRELOAD_BYTES): the reads share its cores, and its virtual ranks can lag their "
                 "calibrated time")
    return text


def _summary(cfg: PrismConfig, document: dict, out: Path) -> str:
    ranks = document["ranks"]
    times = [r["iteration_time_s"] for r in ranks.values() if r["iteration_time_s"] is not None]
    lines = [f"{cfg.name}: {document['mode']} run of {document['world_size']} ranks, "
             f"{cfg.job.iterations - cfg.job.warmup} measured steps per rank"]
    if len(ranks) <= 16:
        lines.append("rank  iteration_time_s  peak_memory_bytes  oom")
        for r, m in ranks.items():
            t = "-" if m["iteration_time_s"] is None else f"{m['iteration_time_s']:.4f}"
            peak = "-" if m["peak_memory_bytes"] is None else str(m["peak_memory_bytes"])
            lines.append(f"{r:>4}  {t:>16}  {peak:>17}  {'yes' if m['oom'] else 'no'}")
    if times:
        lines.append(f"iteration time median over ranks {statistics.median(times):.4f} s "
                     f"(min {min(times):.4f}, max {max(times):.4f})")
    if "oom" in document:
        o = document["oom"]
        lines.append(f"OUT OF MEMORY: rank(s) {o['ranks']} at step {o['step']} ({o['message']})")
    lines.append(f"metrics: {out / 'metrics.json'}")
    return "\n".join(lines)


def _collect(cfg: PrismConfig, root: Path, slots: int | None) -> str:
    from prism_core.collect.stage import collect

    out = collect(cfg, root, slots)
    nodes = int(out.trace.offsets[-1])
    how = ("reused (inputs unchanged)" if out.reused else
           f"collected in {out.wall_s:.1f} s with {slots or cfg.emulation.slots} slots, {out.switches} swaps")
    return (f"{cfg.name}: bare graph of {cfg.job.world_size} ranks, {nodes} nodes, valid; {how}\n"
            f"graph: {out.directory / 'trace.zarr'}")


class _Terminated(Exception):
    pass


_stopping = False


def _on_sigterm(signum, frame):
    global _stopping
    if _stopping:      # a second signal (a process manager often sends two) must not cut the stop short
        return
    _stopping = True
    from prism_core.launch.launcher import stop_all

    stop_all()   # ranks launched from worker threads (Dask slices) are stopped here, not by their thread
    raise _Terminated()


def _reap_children() -> None:
    """At exit, stop any child process still running: a backstop, as `stop_all` stops the ranks
    and `command_server` the command's Prefect server (and keeps any other from starting)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _failures() -> tuple[type[Exception], ...]:
    """The errors a command reports in one paragraph with status 1. Imported once the arguments
    parsed (some of their modules import torch), so that `prism --help` answers at once."""
    from prism_core.cache import CacheError
    from prism_core.calibrate.timeline import CalibrationError
    from prism_core.collect.coordinator import CollectError
    from prism_core.collect.probe import StructureChanged
    from prism_core.launch import LaunchError
    from prism_core.metrics import MetricsError
    from prism_core.report.regression import RegressionError
    from prism_core.trace import TraceError

    return (LaunchError, MetricsError, TraceError, OSError, CollectError, CacheError, CalibrationError,
            RegressionError, StructureChanged)


def main(argv: list[str] | None = None, *, final: bool = False) -> int:
    """Run one command; `final`: the process exits right after (the installed `prism`)."""
    global _stopping
    args = _parser().parse_args(argv)
    failures = _failures()
    _stopping = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # so `finally` blocks stop the ranks
    try:
        cfg = load_config(args.config, args.overrides)
        out = getattr(args, "out", None) or Path("artifacts") / cfg.name / args.command
        if args.command == "collect":
            print(_collect(cfg, out, args.slots))
            return 0
        if args.command in ("calibrate", "emulate", "run", "recalibrate"):
            from flows.server import command_server

            with command_server(final=final):   # one Prefect server for the command, none after it
                text = _calibrate(cfg, args) if args.command == "calibrate" else _emulate(cfg, args)
            print(text)
            return 0
        if args.command == "serve":
            from flows.nightly import serve_nightly

            print(f"prism: serving {cfg.name}'s nightly run ({args.cron or cfg.report.schedule}); Ctrl-C stops",
                  file=sys.stderr)
            serve_nightly(str(args.config), args.overrides, args.cron, args.name)
            return 0
        from prism_core.record import RecordOptions, record

        document = record(cfg, out, options=RecordOptions(force=args.force))
        print(_summary(cfg, document, out))
        return 0
    except ConfigError as err:
        print(f"prism: config error: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"prism {args.command} failed: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        from prism_core.launch.launcher import stop_all

        stop_all()
        print("prism: interrupted; all rank processes were stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def main_exit() -> None:
    atexit.register(_reap_children)
    sys.exit(main(final=True))


if __name__ == "__main__":
    main_exit()
