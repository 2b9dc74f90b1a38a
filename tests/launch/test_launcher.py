"""Tests of prism_core.launch with real rank processes: failures, hangs, signals, the torchrun
environment, iteration boundaries, script arguments, and that nothing is ever left running.

Every test writes a small torchrun-style user script to tmp_path (it calls
`init_process_group("gloo")` with no arguments) and launches it at world size 2 through
`prism record` (the installed CLI, `prism_core.cli.main` or `record()`), or `launch()`. Each rank
of a script first writes its pid to `pids/<rank>`; after the launch returns, none of those
processes, nor any other process running the script, may exist.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prism_core import cli
from prism_core.launch.cores import machine_cores
from prism_core.config import load_config
from prism_core.launch import LaunchError
from prism_core.launch.cores import Placement
from prism_core.launch.launcher import LaunchSpec, LaunchStopped, helper_may_share, launch
from prism_core.record import record

from tests.jobs import WORLD, assert_nothing_left
from tests.jobs import make_job as _job

PRISM = Path(sys.executable).with_name("prism")


# ----------------------------------------------------------------------------------------------
# Failures


@pytest.mark.timeout(120)
def test_raising_rank_fails_the_cli_fast_with_its_traceback(tmp_path):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("boom on purpose")
        dist.barrier()  # rank 0 blocks here until rank 1's death breaks the collective
    """)
    start = time.monotonic()
    proc = subprocess.run([str(PRISM), "record", str(config), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    elapsed = time.monotonic() - start

    assert proc.returncode != 0
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to surface"
    assert "rank 1" in proc.stderr
    assert "ValueError: boom on purpose" in proc.stderr
    assert 'raise ValueError("boom on purpose")' in proc.stderr  # the script's own traceback line
    assert "rank 0 failed" not in proc.stderr  # rank 0 only died of rank 1's death
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


@pytest.mark.timeout(120)
def test_hang_times_out_and_kills_every_rank(tmp_path):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(1000)
        dist.barrier()
    """, timeout_s=5)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out") as info:
        record(load_config(config), tmp_path / "out", echo=False)
    elapsed = time.monotonic() - start

    assert elapsed < 20, f"a 5 s timeout took {elapsed:.1f} s"
    assert "job.timeout_s" in str(info.value)
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(120)
def test_rank_killed_by_a_signal_is_blamed(tmp_path):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # rank 1 fails here, and records an error, after rank 0 is gone
    """)
    with pytest.raises(LaunchError) as info:
        record(load_config(config), tmp_path / "out", echo=False)

    message = str(info.value)
    assert info.value.rank == 0, message
    assert message.startswith("rank 0 ") and "signal" in message
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


@pytest.mark.timeout(120)
def test_stop_event_kills_the_job_and_says_so(tmp_path):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        time.sleep(1000)
    """)
    cfg = load_config(config)
    stop = threading.Event()
    spec = LaunchSpec(program=cfg.job.program, world_size=WORLD, run_dir=tmp_path / "out", timeout_s=100, stop=stop)

    def stop_once_started() -> None:
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "pids").glob("*"))) < WORLD and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    setter = threading.Thread(target=stop_once_started)
    setter.start()
    began = time.monotonic()
    with pytest.raises(LaunchStopped, match="stopped from outside"):
        launch(spec)
    setter.join()
    assert time.monotonic() - began < 60, "the job ran on past its stop"
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


@pytest.mark.timeout(120)
def test_interrupt_stops_every_rank(tmp_path):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        time.sleep(1000)
    """)
    # A shell's background job may inherit SIGINT ignored; give the CLI the default disposition.
    proc = subprocess.Popen([str(PRISM), "record", str(config), "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "pids").glob("*"))) < WORLD:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        time.sleep(0.5)  # the pid files are written while the launcher polls; let it settle in its loop
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


# ----------------------------------------------------------------------------------------------
# What a script sees: torchrun's environment and its own arguments


ARGS = ["--lr", "0.5", "two words", "--flag=x", ""]


@pytest.fixture(scope="module")
def env_run(tmp_path_factory):
    """One `prism record` of a script that dumps its environment and argv, then takes 2 steps."""
    tmp_path = tmp_path_factory.mktemp("env_run")
    config, script = _job(tmp_path, f"""
        seen = {{k: os.environ.get(k) for k in
                 ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                  "PRISM_HELPER_PID")}}
        seen["threads"] = torch.get_num_threads()
        seen["cores"] = sorted(os.sched_getaffinity(0))
        dist.init_process_group("gloo")
        seen["dist_rank"], seen["dist_world_size"] = dist.get_rank(), dist.get_world_size()
        seen["backend"] = dist.get_backend()
        out = Path({str(tmp_path)!r})
        (out / f"env_{{seen['RANK']}}.json").write_text(json.dumps(seen))
        (out / f"argv_{{seen['RANK']}}.json").write_text(json.dumps(sys.argv))
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        dist.destroy_process_group()
    """, args=ARGS)
    status = cli.main(["record", str(config), "--out", str(tmp_path / "out")])
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)
    return status, tmp_path, script


@pytest.mark.timeout(120)
def test_script_gets_torchrun_environment(env_run):
    status, tmp_path, _ = env_run
    assert status == 0
    seen = [json.loads((tmp_path / f"env_{r}.json").read_text()) for r in range(WORLD)]
    for rank, env in enumerate(seen):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == str(WORLD)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["PRISM_HELPER_PID"] is None     # no assistant in a record run
        assert env["threads"] == 1
        assert (env["dist_rank"], env["dist_world_size"]) == (rank, WORLD)
        assert env["backend"] == "prism"  # `prism record` routes "gloo" to the prism backend
    ports = {env["MASTER_PORT"] for env in seen}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536


@pytest.mark.timeout(120)
def test_each_rank_runs_on_a_core_of_its_own(env_run):
    status, tmp_path, _ = env_run
    assert status == 0
    placement = json.loads((tmp_path / "out" / "placement.json").read_text())
    cores = [json.loads((tmp_path / f"env_{r}.json").read_text())["cores"] for r in range(WORLD)]
    if len(machine_cores()) < WORLD:
        assert not placement["bound"] and "cores" in placement["reason"]
        return
    assert placement["bound"]
    assert cores == [[placement["ranks"][str(r)]] for r in range(WORLD)]
    assert len({c[0] for c in cores}) == WORLD


def test_a_rank_is_told_of_the_assistant_only_where_it_may_share_its_core():
    assert helper_may_share(None, 0)                                     # unbound
    assert helper_may_share(Placement({0: 0}, [0]), 0)                   # a co-run's: on the rank's core
    assert not helper_may_share(Placement({0: 0}, [1]), 0)               # a slice's: a core of its own
    assert helper_may_share(Placement({0: 0}, []), 0)                    # bound ranks, assistant unbound


@pytest.mark.timeout(120)
def test_job_args_reach_the_script_argv(env_run):
    status, tmp_path, script = env_run
    assert status == 0
    for rank in range(WORLD):
        argv = json.loads((tmp_path / f"argv_{rank}.json").read_text())
        assert argv == [str(script), *ARGS]  # argv[0] is the script, as under torchrun


@pytest.mark.timeout(120)
def test_ranks_run_the_launchers_prism_core_from_inside_another_checkout(tmp_path):
    # run from a directory holding another `prism_core` (a second clone, an older version): the
    # ranks must still import the launcher's own, not the one `python -m` would find first there
    other = tmp_path / "other_checkout"
    (other / "prism_core").mkdir(parents=True)
    (other / "prism_core" / "__init__.py").write_text('raise ImportError("the other checkout\'s prism_core")\n')
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            dist.all_reduce(model.weight.grad)
            opt.step()
        dist.destroy_process_group()
    """)
    proc = subprocess.run([str(PRISM), "record", str(config), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=90, cwd=other)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the other checkout" not in proc.stderr
    assert_nothing_left(tmp_path, script)


def test_no_child_module_is_started_with_a_bare_python_m():
    # every child prism starts goes through module_command (-P), the test above for all of them
    root = Path(__file__).resolve().parents[2] / "prism_core"
    bare = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if '"-m", "prism_core' in line]
    assert not bare, bare


# ----------------------------------------------------------------------------------------------
# Iteration boundaries


@pytest.mark.timeout(120)
def test_optimizer_steps_mark_iterations(tmp_path):
    steps = 4
    config, script = _job(tmp_path, f"""
        dist.init_process_group("gloo")
        torch.manual_seed(dist.get_rank())
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range({steps}):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            time.sleep(0.05)
            opt.step()
        dist.destroy_process_group()
    """, iterations=steps, warmup=1)
    out = tmp_path / "out"
    assert cli.main(["record", str(config), "--out", str(out)]) == 0

    document = json.loads((out / "metrics.json").read_text())
    assert document["mode"] == "real"
    assert document["world_size"] == WORLD
    assert set(document["ranks"]) == {str(r) for r in range(WORLD)}
    for rank, metrics in document["ranks"].items():
        times = metrics["step_times_s"]
        assert len(times) == steps - 1, f"rank {rank}: {times}"
        assert all(t >= 0.05 for t in times), f"rank {rank}: {times}"
        assert metrics["iteration_time_s"] == statistics.median(times)
        assert isinstance(metrics["peak_memory_bytes"], int) and metrics["peak_memory_bytes"] > 0
        assert metrics["oom"] is False
        # The per-rank result keeps the warm-up step too.
        result = json.loads((out / "results" / f"{rank}.json").read_text())
        assert len(result["step_times_s"]) == steps and result["step_times_s"][1:] == times
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


@pytest.mark.timeout(120)
def test_script_without_optimizer_step_fails_record(tmp_path, capsys):
    config, script = _job(tmp_path, """
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    """)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text('{"mode": "real"}')  # from an earlier, successful run
    assert cli.main(["record", str(config), "--out", str(out)]) != 0
    assert "optimizer.step" in capsys.readouterr().err
    assert not (out / "metrics.json").exists(), "a failed record left an old metrics.json behind"
    assert_nothing_left(tmp_path, script, expect_pids=WORLD)


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def _failed_job(tmp_path: Path, rank_codes: dict[int, int | None]):
    from types import SimpleNamespace

    from prism_core.launch.launcher import HELPER

    (tmp_path / "errors").mkdir()
    return SimpleNamespace(spec=SimpleNamespace(run_dir=tmp_path, world_size=2),
                           ranks={r: _Proc(c) for r, c in rank_codes.items()}, helper=_Proc(1),
                           log_path=lambda r: tmp_path / "logs" / f"{'assistant' if r == HELPER else r}.log")


def test_an_assistant_failed_by_a_ranks_own_error_blames_the_rank(tmp_path):
    # the rank recorded its error and closed its sockets, failing the assistant's collective; the
    # assistant was seen stopped while the rank still tore down (CI saw the assistant blamed)
    from prism_core.launch.launcher import HELPER, _helper_failure

    job = _failed_job(tmp_path, {0: None, 1: None})
    (tmp_path / "errors" / "1.json").write_text(json.dumps({"rank": 1, "time": 100.0, "traceback": "ValueError: mine"}))
    (tmp_path / "errors" / f"{HELPER}.json").write_text(
        json.dumps({"rank": HELPER, "time": 100.2, "traceback": "RuntimeError: Connection reset by peer"}))
    err = _helper_failure(job)
    assert err.rank == 1 and "ValueError: mine" in str(err)


def test_an_assistant_failing_alone_is_blamed(tmp_path):
    from prism_core.launch.launcher import HELPER, _helper_failure

    job = _failed_job(tmp_path, {0: None, 1: None})
    (tmp_path / "errors" / f"{HELPER}.json").write_text(
        json.dumps({"rank": HELPER, "time": 100.0, "traceback": "KeyError: its own bug"}))
    err = _helper_failure(job)
    assert err.rank is None and "the replay assistant failed" in str(err) and "its own bug" in str(err)
