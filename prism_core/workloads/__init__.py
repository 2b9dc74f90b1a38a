"""Built-in reference workloads, run by the launcher as `builtin:<name>`."""
