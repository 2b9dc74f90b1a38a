"""What a busy neighbouring core costs a rank's compute, and what a spin there costs a process woken on it.

The measurement behind the fidelity gap of slices and emulations on this machine (README, Known
limits): in a real W=2 run both cores are busy, in a slice the assistant's core mostly idles.
Two tables, on the first two cores this process may use, rounds interleaved (the machine is
shared and noisy: read the medians and the quartiles, not one round):

1. compute: a single-threaded torch MLP forward and backward on core A while core B is idle,
   runs an idle-class spin (yielding every 50 us), a Python spin in the normal class, a copy of
   the same MLP (a twin: what a neighbouring rank does), or a memory stream; time per 5 passes
   and its ratio to the idle core.
2. wake-up: a pipe round trip from core A to a process on core B in the batch class at nice 19,
   with core B idle or running the idle-class spin yielding every 50 us or every 1 ms; the round
   trip's median and p90.
3. after a wait: the MLP's forward and backward on core A right after a blocking pipe round
   trip to a process on core B that holds the reply for 0.2 to 10 ms (a rank waiting in a
   collective for its peer): the pass's median per wait and its ratio to the shortest wait.
   Compute after a longer wait runs slower here (likely its caches went cold meanwhile): a rank
   whose waits are longer in one run than in another computes slower in it.

    .venv/bin/python bench/neighbour.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

LOAD_S = 60.0      # each load process ends by itself after this, whatever happens here

_MLP = ("torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), "
        "torch.nn.GELU(), torch.nn.Linear(1024, 256)) for _ in range(4)])")

def _spin(unit_s: float) -> str:
    """An idle-class spin that enters the kernel (a yield) every `unit_s`."""
    return ("import os, time\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
            f"end = time.monotonic() + {LOAD_S}\nwhile time.monotonic() < end:\n"
            f"    t = time.perf_counter()\n    while time.perf_counter() - t < {unit_s}:\n        pass\n"
            "    os.sched_yield()\n")


NEIGHBOURS = {
    "idle": None,
    "idle-class spin": _spin(50e-6),
    "python spin": f"import time\nend = time.monotonic() + {LOAD_S}\nwhile time.monotonic() < end:\n    pass\n",
    "twin MLP": ("import time, torch\ntorch.set_num_threads(1)\ntorch.manual_seed(0)\n"
                 f"m = {_MLP}\nx = torch.randn(64, 256)\nend = time.monotonic() + {LOAD_S}\n"
                 "while time.monotonic() < end:\n    m.zero_grad(set_to_none=True)\n"
                 "    m(x).square().mean().backward()\n"),
    "memory stream": ("import time, numpy as np\na = np.ones(8 << 20, dtype=np.float32)\nb = np.empty_like(a)\n"
                      f"end = time.monotonic() + {LOAD_S}\nwhile time.monotonic() < end:\n"
                      "    np.multiply(a, 1.0001, out=b)\n"),
}

ECHO = """
import os, sys
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
os.setpriority(os.PRIO_PROCESS, 0, 19)
while True:
    b = os.read(0, 1)
    if not b or b == b"q":
        break
    os.write(1, b)
"""


def _start(code: str, core: int, pipes: bool = False) -> subprocess.Popen:
    """`code` in a new Python process, in a process group of its own (killed as one) but in this
    session: a new session would put it in a scheduler autogroup of its own, and the idle class
    then no longer yields to the woken process at once (a wake-up waits for the spin's next yield)."""
    pin = f"import os\nos.sched_setaffinity(0, {{{core}}})\n"
    pipe = subprocess.PIPE if pipes else None
    return subprocess.Popen([sys.executable, "-c", pin + code], process_group=0, stdin=pipe, stdout=pipe,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[-1]


def _mlp_pass(core: int):
    """One forward and backward pass of the MLP (single-threaded, this process bound to `core`), as a function."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = eval(_MLP, {"torch": torch})
    x = torch.randn(64, 256)

    def one() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return one


def _ratio_table(title: str, first: str, base: str, got: dict[str, list[float]]) -> None:
    """Per row, the median of its rounds (ms), its ratio to row `base`'s median, and its quartiles."""
    ref = statistics.median(got[base])
    print(f"\n{title}")
    print(f"{first:<20} {'median (ms)':>11} {'vs ' + base:>10} {'quartiles (ms)':>17}")
    for name, values in got.items():
        q1, med, q3 = _quartiles(values)
        print(f"{name:<20} {1e3 * med:11.3f} {100 * (med / ref - 1):+9.1f}% {1e3 * q1:8.3f}-{1e3 * q3:<8.3f}")


def compute_table(core_a: int, core_b: int, rounds: int) -> None:
    one = _mlp_pass(core_a)

    def passes(n: int = 20) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            for _ in range(5):
                one()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    passes(10)   # warm
    got: dict[str, list[float]] = {name: [] for name in NEIGHBOURS}
    for i in range(rounds):
        for name, code in NEIGHBOURS.items():
            proc = _start(code, core_b) if code else None
            try:
                time.sleep(1.0 if code else 0.2)     # the load imports and settles
                got[name].append(passes())
            finally:
                _stop(proc)
        print(f"compute round {i + 1}/{rounds}", file=sys.stderr, flush=True)
    _ratio_table(f"compute on core {core_a}, torch MLP forward + backward x5 (single thread), {rounds} rounds; "
                 f"core {core_b} as named", f"core {core_b}", "idle", got)


def wake_table(core_a: int, core_b: int, rounds: int) -> None:
    os.sched_setaffinity(0, {core_a})
    loads = {"idle": None, "spin, 50 us yields": _spin(50e-6), "spin, 1 ms yields": _spin(1e-3)}
    got: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(rounds):
        for name, code in loads.items():
            load = _start(code, core_b) if code else None
            echo = _start(ECHO, core_b, pipes=True)
            try:
                time.sleep(1.0)
                for _ in range(200):
                    _round_trip(echo)
                for _ in range(500):
                    got[name].append(_round_trip(echo))
                    spin = time.perf_counter()
                    while time.perf_counter() - spin < 300e-6:   # the peer blocks between messages
                        pass
                echo.stdin.write(b"q")
                echo.stdin.flush()
                echo.wait(timeout=10)
            finally:
                _stop(echo)
                _stop(load)
    print(f"\npipe round trip from core {core_a} to a batch-class process on core {core_b}, "
          f"{rounds} x 500 trips")
    print(f"{'core ' + str(core_b):<20} {'median (us)':>11} {'p90 (us)':>9}")
    for name, values in got.items():
        values.sort()
        print(f"{name:<20} {1e6 * statistics.median(values):11.1f} {1e6 * values[int(0.9 * len(values))]:9.1f}")


HOLD = """
import os, struct, time
while True:
    b = os.read(0, 4)
    if len(b) < 4:
        break
    time.sleep(struct.unpack("<i", b)[0] / 1e6)
    os.write(1, b"x")
"""
WAITS_US = (200, 1000, 3000, 10000)


def wait_table(core_a: int, core_b: int, rounds: int) -> None:
    import struct

    one = _mlp_pass(core_a)
    hold = _start(HOLD, core_b, pipes=True)
    got: dict[int, list[float]] = {w: [] for w in WAITS_US}
    try:
        for _ in range(rounds):
            for w in WAITS_US:
                times = []
                for _ in range(20):
                    hold.stdin.write(struct.pack("<i", w))
                    hold.stdin.flush()
                    hold.stdout.read(1)
                    t = time.perf_counter()
                    one()
                    times.append(time.perf_counter() - t)
                got[w].append(statistics.median(times[2:]))
        hold.stdin.close()
        hold.wait(timeout=10)
    finally:
        _stop(hold)
    _ratio_table(f"compute on core {core_a} right after a blocking wait on core {core_b}, torch MLP forward + "
                 f"backward, {rounds} rounds x 18 passes per wait", "wait (ms)", f"{WAITS_US[0] / 1e3:g}",
                 {f"{w / 1e3:g}": values for w, values in got.items()})


def _round_trip(echo: subprocess.Popen) -> float:
    t = time.perf_counter()
    echo.stdin.write(b"x")
    echo.stdin.flush()
    echo.stdout.read(1)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("bench/neighbour.py needs two cores")
    compute_table(cores[0], cores[1], args.rounds)
    wake_table(cores[0], cores[1], max(1, args.rounds // 3))
    wait_table(cores[0], cores[1], args.rounds)


if __name__ == "__main__":
    main()
