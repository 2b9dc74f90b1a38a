"""Slices: sandbox ranks run the real program while the assistant replays every other rank.

Each rank is real in exactly one slice; the slice's trace has the bare graph's structure; the
virtual ranks' issue times are recorded; finished slices are reused; a crashing sandbox rank is
reported with its traceback and leaves nothing running.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prism_core.calibrate.durations import alone_factor, slice_timings
from prism_core.calibrate.resume import MAX_SHARE
from prism_core.calibrate.stage import replica_runs, slice_jobs, time_and_calibrate
from prism_core.collect import collect_rules
from prism_core.collect.stage import collect
from prism_core.config import config_from_dict, load_config
from prism_core.launch import LaunchError
from prism_core.launch.cores import machine_cores
from prism_core.record import RecordOptions, record
from prism_core.replay.slices import CO_RUN, SLICE_DONE, plan_slices, run_slice
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMM, COMPUTE, OP_CODE, P2P_OPS, WAIT
from prism_core.trace.store import read_queued

from tests.jobs import CRASH_IN_SLICE_SCRIPT, assert_no_rank_processes, assert_nothing_left, make_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _virtual_issues_recorded(trace, job) -> None:
    arrivals = np.load(job.directory / "replay" / "arrivals.npy")
    for r in range(trace.world_size):
        s = trace.rank_slice(r)
        comm = trace.columns["kind"][s] == COMM
        issued = np.isfinite(arrivals[s][comm])
        assert issued.all() if r not in job.sandbox else not issued.any(), f"rank {r} in slice {job.sandbox}"


@pytest.mark.timeout(300)
def test_moe_pp2_slices_predict_every_rank_with_the_real_runs_memory(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.iterations=4", "emulation.sandbox=1"])
    graph = collect(cfg, tmp_path / "collect")
    # one pass, whose slices and loaded runs the checks below read (the second pass's, the default,
    # tests/flows/test_calibrate_flow.py)
    document = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate",
                                  passes=1)
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, tmp_path / "timing")
    assert [j.sandbox for j in jobs] == [[0], [1]]
    for job in jobs:
        _virtual_issues_recorded(graph.trace, job)
        stats = json.loads((job.directory / "replay" / "stats.json").read_text())
        assert stats["virtual_ranks"] == 1 and stats["groups_instantiated"] >= 1
    assert document["mode"] == "predicted" and set(document["ranks"]) == {"0", "1"}
    real = record(cfg, tmp_path / "record", options=RecordOptions(echo=False))
    for r, entry in document["ranks"].items():
        assert len(entry["step_times_s"]) == cfg.job.iterations - cfg.job.warmup and all(t > 0 for t in entry["step_times_s"])
        # the program really ran in its slice: its peak memory is the real run's, to the byte
        assert entry["peak_memory_bytes"] == real["ranks"][r]["peak_memory_bytes"]
    assert (tmp_path / "calibrate" / "metrics.json").is_file()
    with np.load(tmp_path / "calibrate" / "timeline.npz") as timeline:
        assert not bool(timeline["timed_pass"])       # one pass: its slices replayed as fast as they could
    _compute_spans_come_from_the_loaded_runs(graph.trace, jobs, document, tmp_path / "calibrate" / "timeline.npz",
                                             cfg.job.warmup)


def _compute_spans_come_from_the_loaded_runs(trace, jobs, document, timeline, warmup: int) -> None:
    """Compute nodes take their spans from the slices' co-run (the two slices at once, each rank
    on a core of its own with its assistant); waits and point-to-point ops theirs from the
    plain runs (collectives are pooled across slices). The timeline's `alone_span` is each
    compute span times its rank's plain compute over its co-run compute at equal waits."""
    if len(machine_cores()) < 2:     # no core for a second slice: no loaded runs
        assert "loaded_compute" not in document and all(j.loaded is None for j in jobs)
        return
    assert document["loaded_compute"]["slices"] == document["loaded_compute"]["of"] == len(jobs)
    assert document["loaded_compute"]["neighbours"] == "co_run"
    match = match_ops(trace)
    model = np.load(timeline)
    cores = []
    for job in jobs:
        members = json.loads((job.loaded / CO_RUN).read_text())["members"]
        assert sorted(members) == sorted(str(j.loaded) for j in jobs)
        placement = json.loads((job.loaded / "placement.json").read_text())
        assert placement["bound"] and placement["assistant"] == sorted(placement["ranks"].values())
        assert placement["awake"] == []                   # the co-run's cores compute: nothing kept awake
        cores += placement["ranks"].values()
        plain_placement = json.loads((job.directory / "placement.json").read_text())
        assert not plain_placement.get("neighbour_load")
        if plain_placement["bound"] and len(machine_cores()) == 2:    # alone (a rank core and the assistant's)
            assert plain_placement["awake"] == plain_placement["assistant"]
            assert not plain_placement["awake_by_helper"]     # structure only: spun all along
        plain = slice_timings(trace, match, job.directory, job.sandbox)
        loaded = slice_timings(trace, match, job.loaded, job.sandbox)
        for r in job.sandbox:
            # the co-run's assistant shares the rank's core and is named to it; the plain slice's
            # runs on a core of its own, and what it ran is never counted against the rank
            _, _, _, beside = read_queued(job.loaded / "trace_parts" / f"{r}.npz")
            assert np.all(np.isfinite(beside)) and np.all(beside >= 0)
            if plain_placement["bound"] and plain_placement["ranks"][str(r)] not in plain_placement["assistant"]:
                _, _, _, apart = read_queued(job.directory / "trace_parts" / f"{r}.npz")
                assert np.all(apart == 0)
            s = trace.rank_slice(r)
            kind, op = trace.columns["kind"][s], trace.columns["op"][s]
            compute = kind == COMPUTE
            own = (kind == WAIT) | np.isin(op, list(P2P_OPS))
            # as measured in the co-run, then moved to the waits the timeline has before each node
            # by at most half itself (calibrate/resume.py; not at all where no cost was fitted)
            assert np.array_equal(model["measured_span"][s][compute], loaded[r].span[compute])
            # and when: the co-run's clock, which replay/steady.py `shared_noise` reads against the timeline's
            with np.load(job.loaded / "trace_parts" / f"{r}.npz") as part:
                assert np.array_equal(model["measured_start"][s][compute], part["t_start"][compute])
                assert np.array_equal(model["measured_end"][s][compute], part["t_end"][compute])
            moved = model["span"][s][compute] - loaded[r].span[compute]
            if document["loaded_compute"]["resume"] is None:
                assert np.all(moved == 0)
            assert np.all(np.abs(moved) <= MAX_SHARE * loaded[r].span[compute] + 1e-12)
            f = alone_factor(plain[r], loaded[r], compute & (trace.columns["step"][s] >= warmup))
            assert np.allclose(model["alone_span"][s][compute], model["span"][s][compute] * (1.0 if f is None else f))
            assert np.array_equal(model["alone_span"][s][~compute], model["span"][s][~compute])
            assert np.array_equal(model["span"][s][own], plain[r].span[own])
            assert np.array_equal(model["transfer"][s][own], plain[r].transfer[own])
    assert sorted(cores) == machine_cores()[:len(jobs)]         # the two slices' ranks on cores apart
    _co_run_members_keep_to_each_other(trace, jobs)


def _co_run_members_keep_to_each_other(trace, jobs) -> None:
    """In each member of the co-run, the virtual rank that the other member runs for real put
    every op on the wire only after its real counterpart had issued it (replay/pacing.py); each
    member's assistant ran in the idle class, a plain slice's not."""
    for job in jobs:
        stats = json.loads((job.loaded / "replay" / "stats.json").read_text())
        others = sorted(r for j in jobs if j is not job for r in j.sandbox)
        assert stats["paced_ranks"] == others and stats["pace_nudges"] > 0
        assert stats["idle_class"]       # emulation.co_run_assistant: idle, the default
        assert not json.loads((job.directory / "replay" / "stats.json").read_text())["idle_class"]
        arrivals = np.load(job.loaded / "replay" / "arrivals.npy")
        for other in (j for j in jobs if j is not job):
            for r in other.sandbox:
                with np.load(other.loaded / "trace_parts" / f"{r}.npz") as part:
                    issued = part["t_start"]
                s = trace.rank_slice(r)
                comm = trace.columns["kind"][s] == COMM
                assert comm.sum() > 0 and np.all(arrivals[s][comm] >= issued[comm]), (job.sandbox, r)


@pytest.mark.timeout(300)
def test_a_dp_replica_runs_for_real_beside_its_slice_and_gives_its_compute(tmp_path):
    """dp2 times rank 0 alone; the co-run's spare place runs replica rank 1 for real, in step
    with it, and the calibration gives rank 1 the compute it measured there."""
    cfg = load_config(CONFIGS / "tiny_moe_w2_dp2.yaml", ["job.iterations=4", "emulation.sandbox=1"])
    graph = collect(cfg, tmp_path / "collect")
    document = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate")
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, tmp_path / "timing")
    assert plan.source.tolist() == [0, 0] and [(j.sandbox, j.replicas) for j in jobs] == [([0], [[1]])]
    assert set(document["ranks"]) == {"0", "1"}
    if len(machine_cores()) < 2:
        assert "loaded_compute" not in document
        return
    (job,) = jobs
    (replica_dir, ranks), = replica_runs(jobs)
    assert ranks == [1] and replica_dir.name == f"{job.loaded.name}_replica1"
    members = json.loads((job.loaded / CO_RUN).read_text())["members"]
    assert members == [str(job.loaded), str(replica_dir)]
    for d, real, paced in ((job.loaded, 0, 1), (replica_dir, 1, 0)):
        stats = json.loads((d / "replay" / "stats.json").read_text())
        assert stats["paced_ranks"] == [paced] and stats["pace_nudges"] > 0, d
        assert (d / "results" / f"{real}.json").is_file()
    assert document["loaded_compute"]["replicas_measured"] == [1]
    match = match_ops(graph.trace)
    measured = slice_timings(graph.trace, match, replica_dir, [1])[1]
    model = np.load(tmp_path / "calibrate" / "timeline_pass1.npz")     # the pass of these slices
    s = graph.trace.rank_slice(1)
    compute = graph.trace.columns["kind"][s] == COMPUTE
    assert np.array_equal(model["span"][s][compute], measured.span[compute])
    assert not np.array_equal(model["span"][s][compute], model["span"][graph.trace.rank_slice(0)][compute])


# slow: `prism run` of the same script with the same sandbox rank (tests/flows/test_pipeline_flow.py,
# test_run_emulates_a_pipelining_script_and_reports) times these slices on the fast path
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelining_script_gets_its_shape_metadata_from_a_virtual_peer(tmp_path):
    # rank 1 alone learns its input shapes through recv_object_list from virtual rank 0: the
    # assistant sends what the collection cached
    cfg = config_from_dict({"name": "pp", "job": {"program": str(SCRIPTS / "pipeline_1f1b.py"), "world_size": 2,
                                                  "iterations": 3, "warmup": 1, "args": ["--steps", "3"]},
                            "emulation": {"sandbox": 1}})
    graph = collect(cfg, tmp_path / "collect")
    document = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate")
    assert set(document["ranks"]) == {"0", "1"}


@pytest.mark.timeout(300)
def test_dp_replicas_are_timed_once_and_renamed(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml",
                      ["job.world_size=4", "parallel.dp=2", "parallel.microbatches=2", "job.iterations=3",
                       "emulation.collect_mode=rules", "emulation.sandbox=2"])
    trace = collect_rules(cfg, tmp_path / "rules", slots=2).trace
    plan = plan_slices(cfg, trace)
    assert plan.timed == [0, 2]                  # one DP replica: one rank per pipeline stage
    assert plan.source.tolist() == [0, 0, 2, 2]  # replica 1 takes replica 0's durations
    assert plan.slices == [plan.timed]


@pytest.mark.timeout(300)
def test_virtual_members_joining_late_go_on_the_wire_after_the_sandbox_rank(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_tp2.yaml", ["job.iterations=3", "emulation.sandbox=1"])
    graph = collect(cfg, tmp_path / "collect")
    out = run_slice(cfg, graph.directory, [0], tmp_path / "late", join_late=True)
    trace = graph.trace
    stats = json.loads((out.directory / "replay" / "stats.json").read_text())
    assert stats["late_join"] and stats["late_join_waits"] > 0
    arrivals = np.load(out.directory / "replay" / "arrivals.npy")
    with np.load(out.directory / "trace_parts" / "0.npz") as part:
        issued = part["t_start"]
    # tp2's collectives are all between rank 0 and rank 1: rank 1's part of each went on the wire
    # after rank 0 had issued the op (barriers join as before)
    s0, s1 = trace.rank_slice(0), trace.rank_slice(1)
    op = trace.columns["op"][s1]
    collective = (trace.columns["kind"][s1] == COMM) & ~np.isin(op, [*P2P_OPS, OP_CODE["barrier"]])
    assert collective.sum() > 0
    assert np.array_equal(trace.columns["kind"][s0], trace.columns["kind"][s1])   # the same nodes, in order
    assert np.all(arrivals[s1][collective] >= issued[collective])
    timings = slice_timings(trace, match_ops(trace), out.directory, [0])
    assert np.all(timings[0].transfer[trace.columns["kind"][s0] == COMM] >= 0)
    assert_no_rank_processes()      # the rank and the assistant are gone


# slow: the fast path is the flow's (tests/flows/test_calibrate_flow.py,
# test_failed_slice_fails_the_flow_and_the_rerun_reuses_the_rest: the rank's error, the finished
# slice and its loaded run kept and reused)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashing_slice_is_reported_and_finished_slices_are_reused(tmp_path, monkeypatch):
    flag = tmp_path / "crash"
    monkeypatch.setenv("CRASH_FLAG", str(flag))
    config, script = make_job(tmp_path, CRASH_IN_SLICE_SCRIPT, name="crash", iterations=3)
    cfg = load_config(config, ["emulation.sandbox=1"])
    graph = collect(cfg, tmp_path / "collect")
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, tmp_path / "timing")
    flag.write_text("")
    run_slice(cfg, graph.directory, jobs[0].sandbox, jobs[0].directory)
    with pytest.raises(LaunchError, match="rank 1 failed(.|\n)*fails in its slice on purpose"):
        run_slice(cfg, graph.directory, jobs[1].sandbox, jobs[1].directory)
    assert_nothing_left(tmp_path, script)
    assert not (jobs[1].directory / SLICE_DONE).exists()
    stamp = (jobs[0].directory / SLICE_DONE).stat().st_mtime_ns
    flag.unlink()
    assert run_slice(cfg, graph.directory, jobs[0].sandbox, jobs[0].directory).reused
    assert not run_slice(cfg, graph.directory, jobs[1].sandbox, jobs[1].directory).reused
    assert (jobs[0].directory / SLICE_DONE).stat().st_mtime_ns == stamp
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(300)
def test_a_failing_assistant_stops_the_slice_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CRASH_FLAG", str(tmp_path / "never"))
    config, script = make_job(tmp_path, CRASH_IN_SLICE_SCRIPT, name="bad_timing", iterations=3)
    cfg = load_config(config, ["emulation.sandbox=1", "job.timeout_s=60"])
    graph = collect(cfg, tmp_path / "collect")
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, span=np.zeros(3), transfer=np.zeros(3))      # not this graph's timeline
    with pytest.raises(LaunchError, match="replay assistant failed(.|\n)*does not belong to the graph"):
        run_slice(cfg, graph.directory, [0], tmp_path / "slice", timing=wrong)
    assert_nothing_left(tmp_path, script)
    assert not (tmp_path / "slice" / SLICE_DONE).exists()
