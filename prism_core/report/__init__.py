"""Reports of a pipeline run: the key figures as markdown (plots and versioned artifacts build on it)."""
