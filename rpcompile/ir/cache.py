"""Where rpcompile keeps what it builds on the user's machine: the planner's and the host optimizer's kernels.

In the lowest layer because both the passes (the planner) and the runtime (the host optimizer) build there.

    >>> import os
    >>> os.path.basename(cache_dir())
    'kernels'
"""
from __future__ import annotations

import os


def cache_dir() -> str:
    """Where built kernels are kept: $RPCOMPILE_CACHE, else $XDG_CACHE_HOME/rpcompile, else ~/.cache/rpcompile."""
    base = os.environ.get("RPCOMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rpcompile")
    return os.path.join(base, "kernels")
