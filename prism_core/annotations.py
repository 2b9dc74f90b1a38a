"""`prism_core.annotate(label, mb=..., chunk=...)`: name the compute a program is doing.

Under `prism record` the label (for example "fwd", "bwd", "optim"), microbatch and virtual stage
go onto the trace's compute nodes; anywhere else the context manager does nothing and costs a
global lookup. It imports neither torch nor anything heavy.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

# Set by the trace recorder of a launched rank; None everywhere else.
_sink = None
_NOOP = nullcontext()


def annotate(label: str, mb: int | None = None, chunk: int | None = None):
    sink = _sink
    if sink is None:
        return _NOOP
    return _annotated(sink, label, -1 if mb is None else mb, -1 if chunk is None else chunk)


@contextmanager
def _annotated(sink, label: str, mb: int, chunk: int):
    sink.push(label, mb, chunk)
    try:
        yield
    finally:
        sink.pop()


def set_sink(sink) -> None:
    global _sink
    _sink = sink
