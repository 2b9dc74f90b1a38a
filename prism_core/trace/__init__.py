"""PrismTrace: schema, in-process recorder, columnar store, validator, structural hash and diff."""

from prism_core.trace.store import STORE_NAME, Trace, TraceError, load_trace, merge_parts, write_trace
from prism_core.trace.structure import rank_hashes, structural_diff
from prism_core.trace.validate import problems, validate

__all__ = ["STORE_NAME", "Trace", "TraceError", "load_trace", "merge_parts", "problems", "rank_hashes",
           "structural_diff", "validate", "write_trace"]
