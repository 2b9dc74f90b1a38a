"""bench/turns.py: launches that take turns never run at once, their stopped time comes out, none is left."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from turns import TurnsError, graph_progress, stop_free, stopped_within, take_turns, unstop_run  # noqa: E402

# a launch with a child in a process group of its own, as the launcher starts ranks: both note
# when they were running, in short busy units
TICKER = """
import json, os, subprocess, sys, time
child = sys.argv[2] == "parent" and subprocess.Popen([sys.executable, __file__, sys.argv[1] + ".child", "child"],
                                                     process_group=0)
seen, end = [], time.monotonic() + 1.2
while time.monotonic() < end:
    t = time.monotonic()
    while time.monotonic() - t < 0.002:
        pass
    seen.append((t, time.monotonic()))
open(sys.argv[1], "w").write(json.dumps(seen))
if child:
    child.wait()
"""


def test_launches_take_turns_and_none_is_left(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    stops = take_turns([[sys.executable, str(script), str(o), "parent"] for o in outs], 0.1, 60,
                       [tmp_path / "a.log", tmp_path / "b.log"])
    units = [np.array(json.loads(Path(f).read_text())) for o in outs for f in (o, f"{o}.child")]
    a = np.concatenate(units[:2])
    b = np.concatenate(units[2:])
    assert len(stops[0]) >= 3 and len(stops[1]) >= 3
    # no busy unit of one launch ran while one of the other's did (units that straddle a stop of
    # their own launch are long, and left out)
    short_a, short_b = a[a[:, 1] - a[:, 0] < 0.02], b[b[:, 1] - b[:, 0] < 0.02]
    assert len(short_a) > 30 and len(short_b) > 30     # a loaded machine runs fewer of them
    for t0, t1 in short_b:
        assert not ((short_a[:, 0] < t1) & (short_a[:, 1] > t0)).any()
    a_free = stop_free(a, stops[0])
    # with the stops taken out, each launch's clock runs on without the other's turns
    assert np.all(np.diff(a_free[np.argsort(a[:, 0]), 0]) >= -1e-9)
    # a unit that ran across a stop of its launch loses just the stopped time (not a bound on the
    # units' length: on a loaded machine one was seen 0.29 s long without any stop in it)
    stopped = np.array([sum(max(0.0, min(u1, s1) - max(u0, s0)) for s0, s1 in stops[0]) for u0, u1 in a])
    assert (stopped > 0).sum() >= 3
    assert np.allclose(a_free[:, 1] - a_free[:, 0], (a[:, 1] - a[:, 0]) - stopped, atol=1e-6)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]
    # each launch's stopped time so far, for an emulation's assistant (prism_core/replay/stopped.py):
    # written before each continue, so at the end it is all of them
    for log, launch_stops in zip(["a.log", "b.log"], stops):
        total = np.fromfile(tmp_path / f"{log}.stopped", dtype=np.float64)
        assert total.tolist() == pytest.approx([sum(b - a for a, b in launch_stops)])


def test_a_failing_launch_stops_every_launch(tmp_path):
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    with pytest.raises(TurnsError, match="exited with status 3"):
        take_turns([[sys.executable, str(script), str(tmp_path / "a.json"), "parent"],
                    [sys.executable, "-c", "import sys; sys.exit(3)"]], 0.1, 60,
                   [tmp_path / "a.log", tmp_path / "b.log"])
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]


# a launch that starts a child in a process group of its own and fails at once: the child is
# orphaned before any turn can read the launch's groups
ORPHANING = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]], process_group=0)
time.sleep(0.05)
sys.exit(3)
"""


def test_a_launch_whose_rank_outlives_it_leaves_no_process(tmp_path):
    script = tmp_path / "orphaning.py"
    script.write_text(ORPHANING)
    marker = f"orphan-{tmp_path}"
    with pytest.raises(TurnsError, match="exited with status 3"):
        take_turns([[sys.executable, str(script), marker], [sys.executable, "-c", "import time; time.sleep(5)"]],
                   0.5, 60, [tmp_path / "a.log", tmp_path / "b.log"])
    assert not [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def test_stopped_time_comes_out_of_times_and_steps(tmp_path):
    stops = [(1.0, 3.0), (5.0, 6.0)]
    assert stop_free(np.array([0.5, 3.5, 7.0]), stops).tolist() == [0.5, 1.5, 4.0]
    assert stopped_within(np.array([0.0, 2.0]), np.array([10.0, 5.5]), stops).tolist() == [3.0, 1.5]
    # a run of three steps whose second step held the second stop
    run = tmp_path / "run"
    (run / "trace_parts").mkdir(parents=True)
    (run / "results").mkdir()
    t_start = np.array([0.0, 3.1, 4.0, 6.6])
    t_end = np.array([0.9, 3.9, 6.5, 7.4])
    # waits for a core: node 2 held the 1-s stop, which the kernel counted as waiting (or not, rank 1)
    np.savez(run / "trace_parts" / "0.npz", t_start=t_start, t_end=t_end, step=np.array([0, 1, 1, 2]),
             queued_node=np.array([1, 2]), queued_s=np.array([0.05, 1.2]),
             wire_node=np.array([1, 3]), wire_t=np.array([3.2, 6.7]))     # on the wire after the stops
    np.savez(run / "trace_parts" / "1.npz", t_start=t_start, t_end=t_end, step=np.array([0, 1, 1, 2]),
             queued_node=np.array([2]), queued_s=np.array([0.4]))
    (run / "results" / "0.json").write_text(json.dumps({"step_times_s": [0.9, 3.4, 0.9]}))
    unstop_run(run, stops)
    assert np.allclose(json.loads((run / "results" / "0.json").read_text())["step_times_s"], [0.9, 2.4, 0.9])
    with np.load(run / "trace_parts" / "0.npz") as part:
        assert np.allclose(part["t_start"], [0.0, 1.1, 2.0, 3.6])
        assert np.allclose(part["queued_s"], [0.05, 0.2])
        assert np.allclose(part["wire_t"], [1.2, 3.7])         # on the same stop-free clock as the nodes
    with np.load(run / "trace_parts" / "1.npz") as part:
        assert part["queued_s"].tolist() == [0.0]


def test_a_launch_that_ended_keeps_its_turns_idle(tmp_path):
    """The other launch is stopped and continued to its end as before: none of its steps run
    unstopped for want of a turn-mate (False: it then runs alone, never stopped again)."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    quick = [sys.executable, "-c", "pass"]
    for keep in (True, False):
        out = tmp_path / f"a-{keep}.json"
        stops = take_turns([[sys.executable, str(script), str(out), "parent"], quick], 0.1, 60,
                           [tmp_path / f"a-{keep}.log", tmp_path / f"q-{keep}.log"], keep_cadence=keep)
        units = np.concatenate([np.array(json.loads(Path(f).read_text())) for f in (out, f"{out}.child")])
        ran = units[:, 1].max() - units[:, 0].min()        # the ticker's 1.2 s of work, and its stops
        stopped = sum(b - a for a, b in stops[0])
        if keep:
            # about half the time stopped: the quick launch's turns went on, idle, after it ended
            assert len(stops[0]) >= 4 and stopped > 0.3 * ran, (len(stops[0]), stopped, ran)
        else:
            assert len(stops[0]) <= 3 and stopped < 0.35, (len(stops[0]), stopped, ran)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]


# a launch of fixed work in units of `per_unit` s of its own CPU time (so stops cost it nothing),
# noting when it finished each unit
WORKER = """
import sys, time
out, units, per_unit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(out, "a") as f:
    for k in range(units):
        t = time.process_time()
        while time.process_time() - t < per_unit:
            pass
        f.write(f"{time.monotonic()}\\n")
        f.flush()
"""


def _ends(path: Path) -> list[float]:
    try:
        return [float(x) for x in path.read_text().split()]
    except OSError:
        return []


def test_turns_to_the_launch_furthest_behind_keep_launches_level(tmp_path):
    """A launch twice as slow per unit as its turn-mate: in plain turns it has done about half
    its work when the other ends; with turns that catch up, all but what the other does in a
    turn (about 5 of 40 units)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    units, behind = 40, {}
    for level in (False, True):
        outs = [tmp_path / f"fast-{level}", tmp_path / f"slow-{level}"]
        progress = [lambda o=o: len(_ends(o)) / units for o in outs]
        cmds = [[sys.executable, str(script), str(outs[0]), str(units), "0.01"],
                [sys.executable, str(script), str(outs[1]), str(units), "0.02"]]
        take_turns(cmds, 0.05, 120, [tmp_path / f"f-{level}.log", tmp_path / f"s-{level}.log"],
                   progress=progress if level else None)
        fast, slow = _ends(outs[0]), _ends(outs[1])
        assert len(fast) == len(slow) == units
        behind[level] = sum(t <= fast[-1] for t in slow) / units   # the slow one's work done when the fast ended
    assert behind[False] <= 0.65 and behind[True] >= 0.8, behind


def test_graph_progress_is_the_least_fraction_over_a_launchs_ranks(tmp_path):
    from prism_core.trace.flight import Flight

    a, b = Flight(tmp_path / "a" / "flight", 0), Flight(tmp_path / "b" / "flight", 1)
    read = graph_progress([(tmp_path / "a", [0]), (tmp_path / "b", [1]), (tmp_path / "c", [2])],
                          {0: 100, 1: 50, 2: 10})
    assert read() == 0.0                       # rank 2 has no record yet
    read = graph_progress([(tmp_path / "a", [0]), (tmp_path / "b", [1])], {0: 100, 1: 50})
    a.issued(79)
    b.issued(29)
    assert read() == pytest.approx(0.6)        # rank 1: 30 of 50 nodes
    b.issued(49)
    assert read() == pytest.approx(0.8)
