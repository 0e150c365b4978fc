"""Show that issue 15's planner tests can fail: run them with `partition` as of an older revision.

    python bench/partition_before_check.py [REV]    # default 8080906, the search before issue 15

The guarantee tests of tests/passes/partition/test_partition_guarantees.py (never slower than the reference heuristic
or an even plan, the issue's 29-layer case, brute force on tiny models) are run with the module's
`partition` replaced by the one `git show REV:passes/partition.py` gives. On 8080906 all three fail;
on the current search they pass. Exit status: pytest's (1 when a test failed).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_partition(rev: str):
    """`partition` from passes/partition.py at git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:passes/partition.py"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    path = os.path.join(tempfile.mkdtemp(), "partition_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("partition_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.partition


class _Swap:
    """pytest plugin: each collected test module's `partition` becomes the old one."""

    def __init__(self, fn):
        self.fn = fn

    def pytest_collection_modifyitems(self, items):
        for item in items:
            item.module.partition = self.fn


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "8080906"
    sys.path.insert(0, ROOT)  # the tests import `tests.strategies`
    return pytest.main(["-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_partition_guarantees.py"),
                        "-k", "never_slower or issue_case or brute_force"], plugins=[_Swap(old_partition(rev))])


if __name__ == "__main__":
    sys.exit(main())
