"""The native counting CPU allocator. Installing it is process-wide and final, so every check
runs in a fresh interpreter; the library is built once up front (later processes load it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
MIB = 1 << 20

PRELUDE = """
import json, torch
from prism_core import memory
memory.install()
assert memory.installed()
def emit(**kw):
    print("RESULT " + json.dumps(kw))
"""


@pytest.fixture(scope="module", autouse=True)
def built():
    done = subprocess.run(
        [sys.executable, "-m", "prism_core.memory.native", "--build"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def run(code: str, env: dict[str, str] | None = None, prelude: str = PRELUDE) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0][len("RESULT ") :])


def test_a_one_mib_tensor_counts_exactly_one_mib():
    r = run("""
        base = memory.current_bytes()
        x = torch.ones(MIB // 4, dtype=torch.float32)
        during = memory.current_bytes() - base
        del x
        emit(during=during, after=memory.current_bytes() - base)
    """.replace("MIB", str(MIB)))
    assert r == {"during": MIB, "after": 0}


def test_b_peak_tracks_the_maximum_and_resets_to_current():
    r = run("""
        memory.reset_peak()
        base = memory.current_bytes()
        assert memory.peak_bytes() == base
        a = torch.empty(3 * 1024, dtype=torch.uint8)
        b = torch.empty(5 * 1024, dtype=torch.uint8)
        del b
        c = torch.empty(2 * 1024, dtype=torch.uint8)
        peak1 = memory.peak_bytes() - base
        memory.reset_peak()
        reset = memory.peak_bytes() - base
        d = torch.empty(1024, dtype=torch.uint8)
        peak2 = memory.peak_bytes() - base
        emit(peak1=peak1, reset=reset, peak2=peak2, zero=(lambda z: memory.current_bytes() - base)(torch.empty(0)))
    """)
    assert r == {"peak1": 8 * 1024, "reset": 5 * 1024, "peak2": 6 * 1024, "zero": 6 * 1024}


WORKLOAD = """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(3):
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    emit(peak=memory.peak_bytes(), current=memory.current_bytes())
"""


def test_c_same_workload_in_two_fresh_processes_gives_identical_peaks():
    first, second = run(WORKLOAD), run(WORKLOAD)
    assert first == second
    params = (64 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)
    # at least parameters + gradients + momentum buffers, all float32
    assert first["peak"] >= 3 * 4 * params


def test_d_capacity_raises_out_of_memory_and_the_process_stays_usable():
    r = run("""
        base = memory.current_bytes()
        cap = base + 4 * MIB
        memory.set_limit(cap)
        assert memory.limit() == cap
        keep = torch.empty(3 * MIB, dtype=torch.uint8)
        try:
            torch.empty(2 * MIB, dtype=torch.uint8)
            raise SystemExit("no OOM")
        except torch.OutOfMemoryError as exc:
            message = str(exc)
        after_oom = memory.current_bytes() - base
        small = torch.full((MIB // 8,), 2.0)    # half a MiB still fits
        ok = float(small.sum())
        with_small = memory.current_bytes() - base
        del small
        memory.set_limit(None)
        big = torch.empty(8 * MIB, dtype=torch.uint8)  # no capacity any more
        emit(message=message, after_oom=after_oom, ok=ok, with_small=with_small, cap=cap,
             live=memory.current_bytes() - base, limit=memory.limit())
    """.replace("MIB", str(MIB)))
    expected = (
        f"PrismLLM: device out of memory: tried to allocate {2 * MIB} bytes with "
        f"{r['cap'] - 4 * MIB + 3 * MIB} bytes live of capacity {r['cap']} (job.device_memory_bytes)"
    )
    assert r["message"].startswith(expected), r["message"]
    assert r["after_oom"] == 3 * MIB
    assert r["ok"] == 2.0 * (MIB // 8)
    assert r["with_small"] == 3 * MIB + MIB // 2
    assert r["live"] == 11 * MIB
    assert r["limit"] is None


def test_d_negative_capacity_is_rejected():
    r = run("""
        try:
            memory.set_limit(-1)
            emit(error=None)
        except ValueError as exc:
            emit(error=str(exc))
    """)
    assert "non-negative" in r["error"]


def test_e_storage_from_before_install_stays_uncounted():
    r = run(
        """
        import json, torch
        old = [torch.empty(MIB, dtype=torch.uint8) for _ in range(4)]
        grown = torch.empty(16, dtype=torch.uint8)
        from prism_core import memory
        memory.install()
        base = memory.current_bytes()
        grown.resize_(2 * MIB)          # the storage keeps the allocator it was made with
        del old[:2]
        view = old[0][:10]
        del old
        mid = memory.current_bytes()
        new = torch.empty(MIB, dtype=torch.uint8)
        with_new = memory.current_bytes()
        del view, grown, new
        print("RESULT " + json.dumps(dict(base=base, mid=mid, with_new=with_new,
                                          end=memory.current_bytes(), peak=memory.peak_bytes())))
        """.replace("MIB", str(MIB)),
        prelude="",
    )
    assert r["base"] >= 0 and r["mid"] == r["base"] and r["end"] == r["base"]
    assert r["with_new"] == r["base"] + MIB
    assert r["peak"] == r["base"] + MIB


def test_raw_interface_and_lazy_clone_work_through_the_allocator():
    # oneDNN (gelu, linear) allocates through Allocator::raw_allocate/raw_deallocate, which
    # needs context == data; a wrapper without it aborts the process on the first free.
    r = run("""
        torch.set_num_threads(1)
        base = memory.current_bytes()
        a = torch.randn(64, 512, requires_grad=True)
        w = torch.randn(512, 512, requires_grad=True)
        torch.nn.functional.gelu(torch.nn.functional.linear(a, w)).sum().backward()
        del a, w
        after_gelu = memory.current_bytes() - base
        x = torch.randn(1000)
        y = x._lazy_clone()
        shared = memory.current_bytes() - base
        y.add_(1)                            # materializes: a copy of 4000 bytes
        copied = memory.current_bytes() - base
        del x, y
        emit(after_gelu=after_gelu, shared=shared, copied=copied, end=memory.current_bytes() - base)
    """)
    assert r == {"after_gelu": 0, "shared": 4000, "copied": 8000, "end": 0}


def test_without_a_compiler_the_error_names_the_cause(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "prism_core.memory.native", "--build"],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "PRISM_NATIVE_BUILD_DIR": str(tmp_path), "CXX": "no-such-c++-compiler"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "no C++ compiler ('no-such-c++-compiler' is not on PATH" in done.stderr


@pytest.mark.slow
def test_concurrent_first_use_builds_once(tmp_path):
    code = """
        import json, torch
        from prism_core.memory import native
        native.install()
        x = torch.empty(1000, dtype=torch.uint8)
        print("RESULT " + json.dumps(dict(built=native.built_here, live=native.current_bytes())))
    """
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    env = {**os.environ, "PRISM_NATIVE_BUILD_DIR": str(tmp_path)}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    assert sum(r["built"] for r in results) == 1
    assert all(r["live"] >= 1000 for r in results)
    assert len(list(tmp_path.glob("*/prism_cpu_alloc.so"))) == 1
