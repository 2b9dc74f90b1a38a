"""The command line that starts one of prism's own modules in a child process.

`python -m pkg.mod` puts the working directory first on the child's `sys.path`, so a child
started from inside another checkout of the project (a second clone, an older version kept for
comparison) would import that checkout's `prism_core` instead of the one its parent runs: the
parent and its ranks, assistant and loads would run different code without a word. `-P`
(Python 3.11's safe path) leaves the working directory out; the child then finds `prism_core`
where its interpreter's environment installed it (`make install`: an editable install of this
checkout), as its parent did. A rank's own program is found by its path (`launch/rank_main.py`
puts the program's directory first, as `python program.py` does).
"""

from __future__ import annotations

import sys


def module_command(module: str) -> list[str]:
    """`python -P -m module` with this process's interpreter."""
    return [sys.executable, "-P", "-m", module]
