"""Starting and supervising rank processes on this machine (torchrun's job, with hard timeouts)."""

from prism_core.launch.launcher import LaunchError, LaunchSpec, launch

__all__ = ["LaunchError", "LaunchSpec", "launch"]
