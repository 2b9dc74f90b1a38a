"""Stage 3: the ranks of interest run for real while the assistant replays the rest in calibrated time.

The emulated rank measures its own step times and exactly the real run's peak memory; with a
device capacity the real run cannot meet it runs out at the same step as the real run; a late
sandbox rank delays the virtual ranks that wait for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prism_core.calibrate.stage import time_and_calibrate
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.emulate.stage import emulate
from prism_core.launch.cores import machine_cores
from prism_core.record import RecordOptions, record
from prism_core.replay.slices import run_slice

from prism_core.trace.schema import COMM

from tests.jobs import assert_no_rank_processes, assert_nothing_left, make_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# slices without their loaded second run, which only moves compute spans (tests/replay/test_slices.py)
NO_LOAD = "emulation.loaded_compute=false"


def _calibrated(cfg, tmp_path):
    graph = collect(cfg, tmp_path / "collect")
    predicted = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate")
    return graph, predicted


def _with_roi(cfg, ranks, **job):
    return cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"ranks_of_interest": ranks}),
                                  "job": cfg.job.model_copy(update=job)})


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """tiny pp2, collected, timed and calibrated once, and its real run unbounded: shared by the
    tests below (the ranks of interest and the device capacity change neither the bare graph nor
    the slices)."""
    root = tmp_path_factory.mktemp("pp2")
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.iterations=4", "emulation.sandbox=1", NO_LOAD])
    graph, predicted = _calibrated(cfg, root)
    free = record(cfg, root / "record", options=RecordOptions(echo=False))
    return cfg, graph, predicted, root, free


@pytest.mark.timeout(300)
def test_rank_of_interest_is_emulated_with_the_real_runs_memory(pp2, tmp_path):
    base, graph, predicted, root, real = pp2
    cfg = _with_roi(base, [1])
    steps: list[int] = []
    doc = emulate(cfg, graph.directory, root / "calibrate" / "timeline.npz", tmp_path / "emulate", predicted,
                  progress=steps.append)
    assert doc["mode"] == "emulated" and doc["world_size"] == 2 and set(doc["ranks"]) == {"1"}
    assert steps == sorted(set(steps)) and steps[-1] == cfg.job.iterations   # progress, step by step
    assert json.loads((tmp_path / "emulate" / "metrics.json").read_text()) == doc
    entry = doc["ranks"]["1"]
    assert len(entry["step_times_s"]) == cfg.job.iterations - cfg.job.warmup
    assert all(t > 0 for t in entry["step_times_s"]) and entry["oom"] is False
    assert entry["predicted_iteration_time_s"] == predicted["ranks"]["1"]["iteration_time_s"]
    assert doc["emulation"]["virtual_ranks"] == 1
    assert doc["emulation"]["groups_instantiated"] == doc["emulation"]["groups_in_job"] == 1
    assert doc["emulation"]["inputs_streamed"] is False    # its cached inputs all held before it began
    replay = json.loads((tmp_path / "emulate" / "replay" / "stats.json").read_text())
    assert replay["timed"] and replay["timed_gloo_ops"] > 0    # the virtual stage's sends and receives
    assert replay["max_ahead_of_clock_s"] <= 0.0, "a virtual op went on the wire before its calibrated time"
    # ... plus the issue cost its rank had in its slice: every comm node has one, nothing else does
    cost, kind = np.load(root / "calibrate" / "timeline.npz")["issue_cost"], graph.trace.columns["kind"]
    assert np.all(cost[kind != COMM] == 0) and np.all(cost[kind == COMM] > 0)
    assert replay["timed_issue_cost_s"] > 0
    late = replay["late_on_wire_s"]      # after their clock: each op's lateness, in quantiles and mean
    assert 0.0 <= late["median"] <= late["p90"] <= late["max"] and 0.0 <= late["mean"] <= late["max"]
    # the virtual stage's sends and receives were prepared while it computed up to them (the loop idle)
    assert 0 < replay["prepped_ahead"] <= replay["timed_gloo_ops"]
    behind, resumed = replay["issue_behind_clock_s"], replay["resume_delay_s"]
    assert behind["median"] <= behind["p90"] <= behind["max"]
    assert 0.0 <= resumed["median"] <= resumed["max"]
    rss = replay["rss_bytes"]          # the assistant's resident memory after each phase (bench/scale.py)
    assert list(rss) == ["started", "graph", "assistant", "connected", "replayed"]
    assert all(0 < v <= replay["max_rss_bytes"] for v in rss.values())
    placement = doc["emulation"]["placement"]     # one rank of interest and the assistant: 2 cores
    # the virtual stage follows rank 1's pace (emulation.follow_pace, on by default) once a step is
    # seen, where rank 1 has a core apart from the assistant's
    if placement["bound"]:
        assert replay["follow_pace"]["updates"] >= 1 and 0.5 <= replay["follow_pace"]["median"] <= 2.0
    else:
        assert replay["follow_pace"]["off"] and replay["follow_pace"]["updates"] == 0
    assert placement["bound"] == (len(machine_cores()) >= 2)
    if placement["bound"]:                        # the assistant on cores apart from the rank's
        assert placement["assistant"] and not set(placement["assistant"]) & set(placement["ranks"].values())
        # rank 1 on the core it holds in `prism record` (the job fits the machine), not the first free one
        assert placement["ranks"] == {"1": machine_cores()[1]}
    if placement["bound"] and len(machine_cores()) == 2:   # placed alone: the assistant's core spun while it computes
        assert placement["awake"] == placement["assistant"] and placement["awake_by_helper"]
        assert replay["spun_cores"] == 1 and replay["spin_switches"] >= 2
    assert entry["peak_memory_bytes"] == real["ranks"]["1"]["peak_memory_bytes"]
    assert_no_rank_processes()


@pytest.mark.timeout(300)
def test_out_of_memory_at_the_real_runs_rank_and_step(pp2, tmp_path):
    cfg, graph, _, root, free = pp2
    peaks = {int(r): m["peak_memory_bytes"] for r, m in free["ranks"].items()}
    assert peaks[0] != peaks[1]
    big, small = max(peaks, key=peaks.get), min(peaks, key=peaks.get)
    capacity = (peaks[big] + peaks[small]) // 2          # only the rank with the larger peak runs out
    bounded = _with_roi(cfg, [big], device_memory_bytes=capacity)
    real = record(bounded, tmp_path / "record", options=RecordOptions(echo=False))
    assert real["oom"]["ranks"] == [big]
    # slices run unbounded (the capacity is not in their key: the unbounded job's are reused);
    # the prediction flags the rank
    reused = []
    predicted = time_and_calibrate(bounded, graph.trace, graph.directory, root / "timing", tmp_path / "calibrate",
                                   on_slice=lambda n, job, out: reused.append(out.reused))
    # both passes' (emulation.timing_passes: 2): the same slices calibrate to the same first-pass
    # timeline, whose digest names the second pass's directory
    assert reused == [True] * 4
    # and a slice started afresh for the bounded job runs unbounded too: past the capacity, no OOM
    fresh = run_slice(bounded, graph.directory, [big], tmp_path / "slice")
    assert not fresh.reused
    result = json.loads((tmp_path / "slice" / "results" / f"{big}.json").read_text())
    assert max(p for p in result["step_peaks"] if p is not None) > capacity
    assert predicted["oom"]["ranks"] == [big] and predicted["oom"]["step"] == real["oom"]["step"]
    doc = emulate(bounded, graph.directory, tmp_path / "calibrate" / "timeline.npz", tmp_path / "emulate", predicted)
    assert doc["oom"]["ranks"] == [big] and doc["oom"]["step"] == real["oom"]["step"]
    assert doc["ranks"][str(big)]["oom_step"] == real["ranks"][str(big)]["oom_step"]
    assert "OutOfMemoryError" in doc["oom"]["message"] or "out of memory" in doc["oom"]["message"].lower()
    assert_no_rank_processes()


# rank 0 sends to rank 1 every step, sleeping first for the seconds written in the file named by
# $SLOW_FLAG while it exists
LATE_SENDER_SCRIPT = """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x = torch.ones(64)
        if rank == 0:
            if Path(os.environ["SLOW_FLAG"]).exists():
                time.sleep(float(Path(os.environ["SLOW_FLAG"]).read_text()))
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        model(x).sum().backward()
        opt.step()
"""


@pytest.mark.timeout(300)
def test_a_late_sandbox_rank_delays_the_virtual_ranks(tmp_path, monkeypatch):
    flag = tmp_path / "slow"
    monkeypatch.setenv("SLOW_FLAG", str(flag))
    config, script = make_job(tmp_path, LATE_SENDER_SCRIPT, name="late", iterations=6)
    cfg = load_config(config, ["emulation.sandbox=1", "emulation.ranks_of_interest=0"])
    graph, _ = _calibrated(cfg, tmp_path)                  # timed without the sleep
    timeline = tmp_path / "calibrate" / "timeline.npz"
    recvs = graph.trace.rank_slice(1).start + np.nonzero(
        graph.trace.columns["kind"][graph.trace.rank_slice(1)] == COMM)[0]
    assert len(recvs) == 6
    gap = {}
    for name in ("on_time", "late"):
        if name == "late":
            # the sleep is sized from the on-time run, whose gaps are as long as a loaded machine makes them
            sleep = max(0.25, gap["on_time"] * 1.5)
            flag.write_text(str(sleep))
        doc = emulate(cfg, graph.directory, timeline, tmp_path / name)
        issued = np.load(tmp_path / name / "replay" / "arrivals.npy")[recvs[1:]]   # the first waits for start-up
        gap[name] = float(np.diff(issued).mean())
        assert doc["ranks"]["0"]["iteration_time_s"] > 0
    assert_nothing_left(tmp_path, script)
    # virtual rank 1 issues each next recv only after the late send arrived: gaps of >= sleep, longer
    # by a third than the on-time gaps. The mean of the 4 gaps (their span over 4): a completion the
    # assistant saw late (55 ms once in a full make test) lengthens one gap and shortens the next by
    # as much, which moved the median below the bound (0.236 s against 0.2375 s, a fresh clone)
    assert gap["late"] > sleep * 0.95 and gap["late"] > gap["on_time"] * 1.3, (gap, sleep)


def _rules_dp_ep2(world: int):
    """tiny ep2 at `world` ranks, all DP with EP 2, collected in rules mode (one replica, DP
    expanded), rank 3 of interest, 3 steps."""
    return load_config(CONFIGS / "tiny_moe_w2_ep2.yaml", [
        f"job.world_size={world}", f"parallel.dp={world}", "parallel.ep=2", "model.moe_router=balanced",
        "job.iterations=3", "job.warmup=1", "emulation.collect_mode=rules", "emulation.sandbox=1",
        "emulation.ranks_of_interest=3", NO_LOAD])


@pytest.mark.timeout(400)
def test_rank_of_another_dp_replica_is_emulated_from_a_rules_mode_graph(tmp_path):
    # rules mode + DP dedup collects replica 0 only; rank 3 sits in replica 1 (EP peers 2 and 3),
    # whose groups the graph names only by expansion: the sandbox rank publishes c10d's names, the
    # virtual ranks send what their replica-0 twins sent, and uneven all-to-alls use the graph's splits
    cfg = _rules_dp_ep2(4)
    graph, predicted = _calibrated(cfg, tmp_path)
    assert (graph.directory / "tensors.zarr").is_dir() and (graph.directory / "replica_source.npy").is_file()
    a2a = graph.trace.columns["splits"] > 0
    assert a2a.any()
    doc = emulate(cfg, graph.directory, tmp_path / "calibrate" / "timeline.npz", tmp_path / "emulate", predicted)
    assert set(doc["ranks"]) == {"3"} and doc["ranks"]["3"]["iteration_time_s"] > 0
    assert doc["emulation"]["virtual_ranks"] == 3
    # the DP all-reduces' ring parts (rank 3's neighbours, ranks 0 and 2, folding every member's
    # cached gradients) were built while those ranks computed up to them (emulation.build_ahead)
    replay = json.loads((tmp_path / "emulate" / "replay" / "stats.json").read_text())
    assert replay["built_ahead"] > 0
    # every virtual rank is one of rank 3's neighbours (emulation.virtual_ranks, the default): the
    # whole graph was replayed
    assert replay["hosted"] == "all" and (tmp_path / "emulate" / "replay" / "arrivals.npy").is_file()
    real = record(cfg, tmp_path / "record", options=RecordOptions(echo=False))
    assert doc["ranks"]["3"]["peak_memory_bytes"] == real["ranks"]["3"]["peak_memory_bytes"]
    assert_no_rank_processes()


@pytest.mark.timeout(600)
def test_hosting_only_the_neighbours_trains_the_rank_of_interest_exactly_as_hosting_all(tmp_path):
    # W=8, DP 8 (the world group) with EP 2, rank 3 of interest: its neighbours are ranks 2 and 4 (its
    # DP ring's), 1 and 5 (its expert-DP ring's, ranks 1, 3, 5, 7), 2 (its EP group's), 1 and 7 (its
    # parent and child in the world group's trees); ranks 0 and 6 do not exist with
    # emulation.virtual_ranks=neighbours. Their gradients reach rank 3 through the compensated ring
    # chunks, read from the cache by group and seq (rank 6's from its replica-0 twin's entries,
    # group_source.npy), and rank 0's broadcast through its tree child: rank 3 trains bit for bit as it
    # does beside every virtual rank, with the same memory
    near = _rules_dp_ep2(8)           # the default: emulation.virtual_ranks=neighbours
    graph, predicted = _calibrated(near, tmp_path)
    assert (graph.directory / "group_source.npy").is_file()
    timeline = tmp_path / "calibrate" / "timeline.npz"
    every = near.model_copy(update={"emulation": near.emulation.model_copy(update={"virtual_ranks": "all"})})
    docs = {name: emulate(c, graph.directory, timeline, tmp_path / name, predicted)
            for name, c in (("all", every), ("near", near))}
    assert docs["all"]["emulation"]["virtual_ranks"] == 7
    assert docs["near"]["emulation"]["virtual_ranks"] == 5 and docs["near"]["emulation"]["virtual_ranks_in_job"] == 7
    replay = json.loads((tmp_path / "near" / "replay" / "stats.json").read_text())
    assert replay["hosted"] == "neighbours" and not (tmp_path / "near" / "replay" / "arrivals.npy").exists()
    assert replay["inputs_read_on_demand"] == 0       # the absent ranks' inputs were read ahead too
    assert docs["near"]["ranks"]["3"]["peak_memory_bytes"] == docs["all"]["ranks"]["3"]["peak_memory_bytes"]
    losses = [json.loads((tmp_path / d / "results" / "3.json").read_text())["scalars"]["loss"] for d in ("all", "near")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert_no_rank_processes()
