"""PrismLLM library: every pipeline stage as a plain, typed function (DESIGN.md §3, §7)."""

__version__ = "0.1.0"

from prism_core.annotations import annotate  # noqa: E402  (cheap: no torch import)

__all__ = ["annotate"]
