"""Exact per-process peak bytes of live tensor storage on CPU, and an optional capacity.

A thin facade over `prism_core.memory.native` (the counting CPU allocator in
`native_nccl/cpu_alloc/`): `install()`, `installed()`, `current_bytes()`, `peak_bytes()`,
`reset_peak()`, `set_limit(nbytes | None)`, `limit()`, `build()`. The native module is imported
on first use, so importing this package stays cheap and `python -m prism_core.memory.native`
runs cleanly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_core.memory.native import (
        NativeBuildError,
        build,
        current_bytes,
        install,
        installed,
        limit,
        peak_bytes,
        reset_peak,
        set_limit,
    )

__all__ = [
    "NativeBuildError",
    "build",
    "current_bytes",
    "install",
    "installed",
    "limit",
    "peak_bytes",
    "reset_peak",
    "set_limit",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("prism_core.memory.native"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
