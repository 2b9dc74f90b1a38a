"""The prism c10d backend: a recording, gloo-backed ProcessGroup installed under any program."""

from prism_core.backend.install import install
from prism_core.backend.process_group import PrismProcessGroup, UnsupportedOpError

__all__ = ["PrismProcessGroup", "UnsupportedOpError", "install"]
