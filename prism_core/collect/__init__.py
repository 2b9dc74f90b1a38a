"""Stage 1: collect the bare execution graph of a W-rank job on K slots (context switching)."""

from prism_core.collect.context_switch import CollectResult, collect_context_switch
from prism_core.collect.coordinator import CollectError

__all__ = ["CollectError", "CollectResult", "collect_context_switch"]
