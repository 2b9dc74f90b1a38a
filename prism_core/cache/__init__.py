"""Zarr tensor cache for the communication tensors that later stages send on behalf of virtual ranks.

One store (`tensors.zarr`) holds a group per rank under `ranks/<rank>`; each rank's group is
written by that rank's own `TensorCacheWriter` and read back with `TensorCacheReader`.
"""

from prism_core.cache.tensors import CacheError, TensorCacheReader, TensorCacheWriter

__all__ = ["CacheError", "TensorCacheReader", "TensorCacheWriter"]
