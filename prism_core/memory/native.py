"""The native counting CPU allocator: build, load, and a typed API over it.

The C++ source is `native_nccl/cpu_alloc/counting_allocator.cpp`. It is compiled on first use
(or ahead of time with `python -m prism_core.memory.native --build`) into
`native_nccl/build/cpu_alloc-torch<version>-py<XY>-<hash>/`, keyed by the torch version, the
Python version and a hash of the source and flags, so a torch upgrade or a source edit builds
afresh and never loads a stale library. The build runs under an exclusive `fcntl.flock` on a
lock file in that directory: rank processes that start together build once, the others wait and
then load. A finished build is marked by a `BUILT` stamp (written after the library), and a
process that finds it imports the library directly without running the build tool.

With ninja available the build goes through `torch.utils.cpp_extension.load`; without it (that
function requires ninja) the same flags are passed to the C++ compiler directly. If neither can
build, `NativeBuildError` says why; there is no fallback that would report made-up numbers.

Installing is process-wide and cannot be undone: every CPU tensor storage allocated after
`install()` is counted until it is freed. Storage allocated before stays uncounted (also when
it is freed later), as does memory torch does not allocate through its CPU allocator
(`torch.from_numpy`, mmap-loaded checkpoints). oneDNN buffers taken through the allocator's
raw interface are counted, as cuDNN workspaces are on GPU.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

_REPO = Path(__file__).resolve().parents[2]
SOURCE = _REPO / "native_nccl" / "cpu_alloc" / "counting_allocator.cpp"
ENV_BUILD_ROOT = "PRISM_NATIVE_BUILD_DIR"  # overrides <repo>/native_nccl/build (read-only checkouts)
MODULE_NAME = "prism_cpu_alloc"
CFLAGS = ["-O2"]
_STAMP = "BUILT"
_BUILD_TIMEOUT_S = 600

_module: ModuleType | None = None
built_here = False  # whether this process compiled the library (the others found it built)


class NativeBuildError(RuntimeError):
    """The counting allocator could not be built or loaded; the message names the cause."""


def build_root() -> Path:
    return Path(os.environ.get(ENV_BUILD_ROOT) or _REPO / "native_nccl" / "build")


def build_dir() -> Path:
    """Where this torch version and this source build to."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(repr((CFLAGS, torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI)).encode())
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return build_root() / f"cpu_alloc-{tag}-{digest.hexdigest()[:12]}".replace("+", "_")


def library_path() -> Path:
    return build_dir() / f"{MODULE_NAME}.so"


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise NativeBuildError(f"PrismLLM: could not load the counting CPU allocator {path}: {exc}") from exc
    return module


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension uses
    found = shutil.which(cxx)
    if found is None:
        raise NativeBuildError(
            f"PrismLLM: cannot build the counting CPU allocator: no C++ compiler ({cxx!r} is not on PATH; "
            "install g++ or set CXX). It is needed for exact per-rank peak memory on CPU."
        )
    return found


def _build_with_ninja(directory: Path) -> None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=MODULE_NAME,
            sources=[str(SOURCE)],
            build_directory=str(directory),
            extra_cflags=CFLAGS,
            verbose=False,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError with the compiler output
        raise NativeBuildError(f"PrismLLM: building the counting CPU allocator failed: {exc}") from exc


def _build_with_compiler(directory: Path, cxx: str) -> None:
    """Same flags as cpp_extension.load, without ninja."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths()
    tmp = directory / f"{MODULE_NAME}.so.tmp{os.getpid()}"
    cmd = [
        cxx, "-shared", "-fPIC", "-std=c++17", *CFLAGS,
        f"-DTORCH_EXTENSION_NAME={MODULE_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *[f"-isystem{p}" for p in includes],
        str(SOURCE), "-o", str(tmp),
        *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu", "-ltorch_python",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise NativeBuildError(f"PrismLLM: building the counting CPU allocator timed out after {exc.timeout}s") from exc
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(
            f"PrismLLM: building the counting CPU allocator failed ({' '.join(cmd[:2])} ... exit {done.returncode}):\n"
            + (done.stderr or done.stdout)[-4000:]
        )
    os.replace(tmp, library_path())


def _load_or_build() -> ModuleType:
    global built_here
    directory = build_dir()
    lib, stamp = library_path(), directory / _STAMP
    if stamp.exists() and lib.exists():
        return _import(lib)
    if not SOURCE.exists():
        raise NativeBuildError(f"PrismLLM: the counting CPU allocator's source is missing: {SOURCE}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(
            f"PrismLLM: cannot create the native build directory {directory}: {exc} (set {ENV_BUILD_ROOT})"
        ) from exc
    with open(directory / "build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if stamp.exists() and lib.exists():  # another process built it while we waited
            return _import(lib)
        cxx = _compiler()
        # cpp_extension's own baton ("lock") is left behind by a build that was killed and would
        # make load() wait forever; holding the flock, we know nobody is building.
        (directory / "lock").unlink(missing_ok=True)
        from torch.utils import cpp_extension

        built_here = True
        if cpp_extension.is_ninja_available():
            _build_with_ninja(directory)
        else:
            _build_with_compiler(directory, cxx)
        if not lib.exists():
            raise NativeBuildError(f"PrismLLM: the build of the counting CPU allocator produced no {lib}")
        tmp = directory / f"{_STAMP}.tmp{os.getpid()}"
        tmp.write_text(f"{torch.__version__}\n")
        os.replace(tmp, stamp)
    return _import(lib)


def _native() -> ModuleType:
    global _module
    if _module is None:
        _module = _load_or_build()
    return _module


def build() -> Path:
    """Build (or find) the library without installing it; returns its path."""
    _native()
    return library_path()


def install() -> None:
    """Put the counting allocator in force for this process (idempotent, cannot be undone)."""
    _native().install()


def installed() -> bool:
    """Whether the counting allocator is this process's CPU allocator. Never builds."""
    return _module is not None and bool(_module.installed())


def current_bytes() -> int:
    """Bytes of counted tensor storage live now."""
    return int(_native().current_bytes())


def peak_bytes() -> int:
    """Highest `current_bytes()` since install or the last `reset_peak()`."""
    return int(_native().peak_bytes())


def reset_peak() -> None:
    """Start a new peak window: peak := current."""
    _native().reset_peak()


def set_limit(nbytes: int | None) -> None:
    """Capacity in bytes (None or 0: none). Past it, allocations raise torch.OutOfMemoryError."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"PrismLLM: capacity must be a non-negative int of bytes or None, got {nbytes!r}")
    _native().set_limit(nbytes or 0)


def limit() -> int | None:
    """The capacity in bytes, or None."""
    value = int(_native().limit())
    return value or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prism_core.memory.native", description="The native counting CPU allocator."
    )
    parser.add_argument("--build", action="store_true", help="build it now (if not built) and print where it is")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    start = time.perf_counter()
    try:
        path = build()
    except NativeBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{path}  ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
