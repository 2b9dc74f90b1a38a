"""A launch stopped from outside: an emulation's assistant moves its schedule by the stopped time.

The stopped time is read from the file named by PRISM_STOPPED_FILE (prism_core/replay/stopped.py),
which whoever stops the launch writes before continuing it (bench/turns.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from prism_core.calibrate.stage import time_and_calibrate
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.emulate.stage import emulate
from prism_core.replay.stopped import ENV_STOPPED_FILE, StoppedTime, StoppedWriter, write_stopped
from prism_core.trace.flight import read_steps
from prism_core.trace.schema import COMM, OP_CODE

from tests.jobs import assert_nothing_left, make_job

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from turns import unstop_run  # noqa: E402

# rank 1 computes for 0.3 s (busy, as a real kernel would) and sends to rank 0, which only waits:
# rank 0's step is rank 1's compute
BUSY_SENDER_SCRIPT = """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(7):
        x = torch.ones(8)
        if rank == 1:
            began = time.perf_counter()
            while time.perf_counter() - began < 0.3:
                pass
            dist.send(x, 0)
        else:
            dist.recv(x, 1)
        model(x).sum().backward()
        opt.step()
"""


def test_written_and_read_back(tmp_path):
    path = tmp_path / "stopped"
    write_stopped(path, 0.0)
    reader = StoppedTime(path)
    assert reader.total() == 0.0
    write_stopped(path, 1.25)
    assert reader.total() == 1.25           # the reader's map sees the store without reopening
    writer = StoppedWriter(path)            # the stopper's side, kept open across its turns
    assert reader.total() == 1.25           # opening it keeps what was there
    for total in (1.5, 2.75):
        writer.set(total)
        assert reader.total() == total


def test_missing_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_STOPPED_FILE, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=ENV_STOPPED_FILE):
        StoppedTime.from_env()


@pytest.mark.timeout(300)
def test_a_stop_does_not_shorten_what_the_virtual_rank_computes(tmp_path, monkeypatch):
    config, script = make_job(tmp_path, BUSY_SENDER_SCRIPT, name="busy", iterations=7)
    cfg = load_config(config, ["emulation.sandbox=1", "emulation.ranks_of_interest=0"])
    graph = collect(cfg, tmp_path / "collect")
    # one timing pass: the stop is this test's subject (with two, the default, one of rank 0's compute
    # nodes stalled 0.63 s in the second pass's slice in a loaded `make test`, which put rank 0's
    # calibrated compute above follow.MIN_SHARE of rank 1's, and its pace was read)
    doc = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate",
                             passes=1)
    # rank 1's calibrated compute: 0.3 s less the waits for a core a loaded machine gave it
    predicted = doc["ranks"]["0"]["iteration_time_s"]
    stopped = tmp_path / "stopped"
    write_stopped(stopped, 0.0)
    monkeypatch.setenv(ENV_STOPPED_FILE, str(stopped))
    out = tmp_path / "emulate"
    stops: list[tuple[float, float]] = []

    def stop_once() -> None:
        """Stop the launch (rank 0 and the assistant, one process group) for 1 s after step 2."""
        deadline = time.monotonic() + 120
        while read_steps(out / "flight", [0]).get(0, 0) < 2:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        group = os.getpgid(int((tmp_path / "pids" / "0").read_text()))
        os.killpg(group, signal.SIGSTOP)
        began = time.monotonic()
        time.sleep(1.0)
        stops.append((began, time.monotonic()))
        write_stopped(stopped, stops[0][1] - stops[0][0])
        os.killpg(group, signal.SIGCONT)

    stopper = threading.Thread(target=stop_once)
    stopper.start()
    emulate(cfg, graph.directory, tmp_path / "calibrate" / "timeline.npz", out)
    stopper.join()
    assert_nothing_left(tmp_path, script)
    assert stops, "the emulation never reached step 2"
    stats = json.loads((out / "replay" / "stats.json").read_text())
    assert stats["stopped_s"] == pytest.approx(stops[0][1] - stops[0][0])
    # rank 0 computes a few ms a step against rank 1's 0.3 s: its pace is not read (follow.MIN_SHARE;
    # it read 0.5 in a make test, and rank 1's compute came in half its time)
    assert stats["follow_pace"]["ranks"] == []
    unstop_run(out, stops)
    steps = np.array(json.loads((out / "results" / "0.json").read_text())["step_times_s"])
    # rank 1's compute still takes its time once the stop is out: its sends come a calibrated
    # compute apart, the one across the stop too (unmoved, its timer would fire at once on the
    # continue, 0.01 s after the send before). Rank 0's steps show it only on an idle machine:
    # on a loaded one rank 0 came late to one step (0.47 s) and so early to the next (0.11 s),
    # rank 1 keeping its own pace (seen in a full `make test`).
    assert predicted > 0.1
    assert np.isfinite(steps).all() and len(steps) == 7
    kind, op = graph.trace.rank(1)["kind"], graph.trace.rank(1)["op"]
    sends = graph.trace.rank_slice(1).start + np.nonzero((kind == COMM) & (op == OP_CODE["send"]))[0]
    sent = np.load(out / "replay" / "arrivals.npy")[sends]
    assert len(sent) == 7 and np.isfinite(sent).all()
    assert np.diff(sent).min() > 0.5 * predicted, (np.diff(sent), predicted)


def test_a_completion_after_a_stop_is_not_moved_by_it(tmp_path):
    """A virtual rank's op completes after its launch continued: the completion's time reaches the
    rank's clock as it is, and the stop moves only what was set before it (moved too, a tp2
    emulation taking turns lost the whole stop again at such ops)."""
    import queue
    from collections import deque

    from prism_core.replay.assistant import Assistant, _Handle, _Holds

    path = tmp_path / "stopped"
    write_stopped(path, 0.0)
    a = object.__new__(Assistant)       # only the loop's times: no graph, no gloo
    a.events, a.timers, a._targets, a._due, a._woken = queue.SimpleQueue(), [], {}, {}, {}
    a.stopped, a._slipped, a.holds = StoppedTime(path), 0.0, _Holds()
    a.clock = [0.0, 10.0]               # rank 1 issued its op at 10.0; the launch then stopped 0.3 s
    write_stopped(path, 0.3)            # the stopper writes before it continues the launch
    done = _Handle()
    done.waiters, done.when = [1], 10.35     # the op completed after the continue
    ready: deque = deque()
    a._take_events(done, ready)
    assert done.done and list(ready) == [1]
    assert a.clock[1] == pytest.approx(10.35)
    a._slip()                           # the loop's next look at the stopped time
    assert a.clock[1] == pytest.approx(10.35)
