"""The docstrings' examples run: every module of `rpcompile` (the `passes/` and `runtime/` folders
included, as `rpcompile.passes` and `rpcompile.runtime`) has its doctests run by the stdlib `doctest`,
one test per module, with torch's random state put back after each (examples seed their own).

A module's test is skipped where an optional package (transformers,
peft, ...) is missing that the module imports (at the top, or lazily in a function) or that one of
its examples that run imports.
Examples marked `# doctest: +SKIP` (slow, random, or needing files) are not run; `...` in an expected
output matches anything (ELLIPSIS, as pytest's --doctest-modules has it by default). A failure shows
doctest's own report: the module, the line, the example, what was expected and what came.
"""
from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import io
import pkgutil

import pytest
import torch

OPTIONAL = ("transformers", "peft", "tokenizers", "tqdm", "tensorboard", "yaml", "matplotlib")


def _imports(source: str) -> set[str]:
    """The top-level packages that `source` imports, wherever the import stands."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def _modules(package: str) -> list[str]:
    """`package` and every module below it, by name (packages are imported to find their folders)."""
    names = [package]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        names += _modules(info.name) if info.ispkg else [info.name]
    return names


# pyproject maps folders passes/ and runtime/ to rpcompile.passes and rpcompile.runtime: they are no
# folders of rpcompile/'s, so they are walked too
MODULES = sorted(set(_modules("rpcompile") + _modules("rpcompile.passes") + _modules("rpcompile.runtime")))


def test_modules_found():
    """The walk sees the three folders (rpcompile/, passes/ and runtime/)."""
    assert {"rpcompile.ir.graph", "rpcompile.passes.trace", "rpcompile.passes.cost.symbolic",
            "rpcompile.runtime.host.optimizer", "rpcompile.runtime.sim.events"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {exc.name}")
        raise
    tests = doctest.DocTestFinder().find(module, name)
    # what the module imports, lazily inside a function too, and what the examples that run import
    imported = _imports(inspect.getsource(module)).union(
        *(_imports(e.source) for t in tests for e in t.examples if not e.options.get(doctest.SKIP)))
    for needed in sorted(imported & set(OPTIONAL)):
        pytest.importorskip(needed)
    runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS)  # as pytest --doctest-modules
    report = io.StringIO()
    with torch.random.fork_rng():  # an example's manual_seed does not reach the tests after it
        for t in sorted(tests, key=lambda t: t.lineno or 0):
            runner.run(t, out=report.write)
    if runner.failures:
        pytest.fail(f"{runner.failures} of {runner.tries} doctest examples of {name} failed:\n{report.getvalue()}",
                    pytrace=False)
