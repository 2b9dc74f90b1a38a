"""Stage 1: collect the bare execution graph of a W-rank job on K slots (context switching or tensor rules)."""

from prism_core.collect.context_switch import CollectResult, collect_context_switch, collect_rules
from prism_core.collect.coordinator import CollectError

__all__ = ["CollectError", "CollectResult", "collect_context_switch", "collect_rules"]
