"""The package's layers (DESIGN.md section 2): imports only go down, at module level, without cycles.

Every project module's imports are read with `ast` (nothing is imported). Three rules:

- no project import inside a function (optional third-party packages may still be imported lazily);
- no import cycle among project modules, counting every import statement wherever it stands;
- no import from a layer above the module's own: ir (1) < passes (2) < runtime (3) < driver (4) <
  libraries (5: `rpcompile.models`, `rpcompile.finetune`) < the command line (6: `rpcompile.cli`); the
  package's front door (`rpcompile/__init__.py`, `__main__.py`) sits above all.

Two more checks keep the tree readable: no folder holds more than 12 modules besides its
`__init__.py`, and every package's `__init__.py` opens with a docstring saying what it holds.

Each failure names the module and the line. The checks are plain functions of a module table, so
the tests below also feed them a broken table and watch each rule fail.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> package name, as pyproject's package-dir maps them
FOLDERS = {"rpcompile": "rpcompile", "passes": "rpcompile.passes", "runtime": "rpcompile.runtime"}
LAYERS = ("ir", "passes", "runtime", "driver", "libraries", "cli", "front door")
MAX_MODULES = 12  # modules per folder, not counting __init__.py


@dataclass(frozen=True)
class Import:
    """One project import statement: who imports what, where, and whether inside a function."""

    source: str     # importing module, e.g. "rpcompile.passes.cost"
    target: str     # imported project module
    line: int       # line of the statement in the source file
    in_function: bool


def layer_of(module: str) -> int:
    """The layer index (0 = ir ... 6 = front door) of a project module, from the folder it lives in."""
    parts = module.split(".")
    if module in ("rpcompile", "rpcompile.__main__"):
        return 6
    sub = parts[1] if len(parts) > 1 else ""
    return {"ir": 0, "passes": 1, "runtime": 2, "models": 4, "finetune": 4, "cli": 5}.get(sub, 3)


def project_modules() -> dict[str, str]:
    """Module name -> file path for every project module."""
    mods: dict[str, str] = {}
    for folder, pkg in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and
                                 not (folder == "rpcompile" and dirpath == base and d in FOLDERS))
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                    rel = rel[:-1] if rel[-1] == "__init__" else rel
                    mods[".".join([pkg, *rel])] = os.path.join(dirpath, f)
    return mods


def imports_of(module: str, source: str, known: set[str], is_package: bool) -> list[Import]:
    """The project imports in `source` (the text of `module`)."""
    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [resolve(a.name) for a in child.names if a.name.split(".")[0] == "rpcompile"]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's package upwards
                    pkg = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                if base.split(".")[0] == "rpcompile":  # `from pkg import mod` imports the module itself
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else resolve(base)
                               for a in child.names]
            out.extend(Import(module, t, child.lineno, in_function) for t in dict.fromkeys(targets) if t)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def all_imports(mods: dict[str, str]) -> list[Import]:
    """Every project import of every module in `mods` (name -> path)."""
    out = []
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            out += imports_of(m, f.read(), set(mods), path.endswith("__init__.py"))
    return out


def function_level(imports: list[Import], paths: dict[str, str]) -> list[str]:
    """Rule 1: a project import inside a function, as 'path:line: source imports target'."""
    return [f"{paths[i.source]}:{i.line}: {i.source} imports {i.target} inside a function"
            for i in imports if i.in_function]


def cycles(imports: list[Import], paths: dict[str, str]) -> list[str]:
    """Rule 2: every import cycle (a strongly connected set of modules), with one edge's line per module."""
    graph: dict[str, dict[str, int]] = {}
    for i in imports:
        if i.source != i.target:
            graph.setdefault(i.source, {}).setdefault(i.target, i.line)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for comp in found:
        edges = [f"{paths[s]}:{graph[s][t]}: {s} imports {t}" for s in comp for t in graph.get(s, {}) if t in comp]
        out.append(f"import cycle among {', '.join(comp)}:\n    " + "\n    ".join(edges))
    return out


def upward(imports: list[Import], paths: dict[str, str]) -> list[str]:
    """Rule 3: an import from a lower layer to a higher one."""
    return [f"{paths[i.source]}:{i.line}: {i.source} ({LAYERS[layer_of(i.source)]}) imports {i.target} "
            f"({LAYERS[layer_of(i.target)]}), a layer above it"
            for i in imports if layer_of(i.target) > layer_of(i.source)]


def _check(rule, imports, paths) -> None:
    problems = rule(imports, paths)
    assert not problems, f"{len(problems)} violation(s):\n" + "\n".join(problems)


def test_no_project_import_inside_a_function():
    mods = project_modules()
    _check(function_level, all_imports(mods), mods)


def test_no_import_cycle():
    mods = project_modules()
    _check(cycles, all_imports(mods), mods)


def test_imports_only_go_down():
    mods = project_modules()
    _check(upward, all_imports(mods), mods)


def test_every_folder_is_a_layer():
    """The table covers the package: each layer has modules, and the IR's are where DESIGN.md puts them."""
    mods = project_modules()
    seen = {layer_of(m) for m in mods}
    assert seen == set(range(len(LAYERS))), sorted(seen)
    assert {"rpcompile.ir.graph", "rpcompile.ir.costs", "rpcompile.ir.plan", "rpcompile.ir.program",
            "rpcompile.passes.partition", "rpcompile.runtime.executor", "rpcompile.api",
            "rpcompile.models.zoo", "rpcompile.finetune.run", "rpcompile.cli.finetune"} <= set(mods)


def crowded_folders(mods: dict[str, str]) -> list[str]:
    """Folders holding more than MAX_MODULES modules besides __init__.py, with their count."""
    count: dict[str, int] = {}
    for path in mods.values():
        if not path.endswith("__init__.py"):
            folder = os.path.relpath(os.path.dirname(path), ROOT)
            count[folder] = count.get(folder, 0) + 1
    return [f"{folder}/ holds {n} modules (at most {MAX_MODULES})" for folder, n in sorted(count.items())
            if n > MAX_MODULES]


def undocumented_packages(mods: dict[str, str]) -> list[str]:
    """Packages whose __init__.py does not open with a docstring."""
    out = []
    for m, path in sorted(mods.items()):
        if path.endswith("__init__.py"):
            with open(path, encoding="utf-8") as f:
                if not ast.get_docstring(ast.parse(f.read())):
                    out.append(f"{path}: package {m} has no docstring")
    return out


def test_no_folder_holds_more_than_twelve_modules():
    problems = crowded_folders(project_modules())
    assert not problems, "\n".join(problems)


def test_every_package_says_what_it_holds():
    problems = undocumented_packages(project_modules())
    assert not problems, "\n".join(problems)


def test_a_crowded_folder_and_a_silent_package_are_named(tmp_path):
    mods = project_modules()
    ir = sum(1 for m, path in mods.items() if m.startswith("rpcompile.ir.") and not path.endswith("__init__.py"))
    extra = {f"rpcompile.ir.extra{i}": os.path.join(ROOT, "rpcompile", "ir", f"extra{i}.py")
             for i in range(MAX_MODULES + 1 - ir)}
    assert crowded_folders({**mods, **extra}) == [f"rpcompile/ir/ holds {MAX_MODULES + 1} modules (at most 12)"]
    assert not crowded_folders({**mods, **dict(list(extra.items())[1:])})
    silent = tmp_path / "__init__.py"
    silent.write_text("import os  # a package without a docstring\n")
    assert undocumented_packages({**mods, "rpcompile.fake": str(silent)}) == [
        f"{silent}: package rpcompile.fake has no docstring"]


# -- the checks can fail: each rule broken once, on a copy of the real table ---------------------------
def _new_problems(rule, module: str, extra: str) -> list[str]:
    """What `rule` reports once `extra` (source text) is appended to `module`, beyond what it reports now."""
    mods = project_modules()
    imports = all_imports(mods)
    with open(mods[module], encoding="utf-8") as f:
        text = f.read()
    lines = text.count("\n")
    added = [i for i in imports_of(module, text + extra, set(mods), mods[module].endswith("__init__.py"))
             if i.line > lines]
    before = set(rule(imports, mods))
    return [p for p in rule(imports + added, mods) if p not in before]


def test_a_function_level_import_is_named_with_its_line():
    problems = _new_problems(function_level, "rpcompile.ir.costs", "\ndef f():\n    from rpcompile.ir import plan\n")
    assert len(problems) == 1 and "ir/costs.py:" in problems[0], problems
    assert "rpcompile.ir.costs imports rpcompile.ir.plan inside a function" in problems[0]


def test_a_cycle_is_named_with_its_modules():
    # plan imports costs; costs importing plan closes a cycle (one layer: only the cycle rule fires)
    extra = "\nfrom rpcompile.ir.plan import StagePlan\n"
    problems = _new_problems(cycles, "rpcompile.ir.costs", extra)
    assert len(problems) == 1 and "import cycle among rpcompile.ir.costs, rpcompile.ir.plan" in problems[0], problems
    assert "ir/costs.py:" in problems[0] and "ir/plan.py:" in problems[0]
    assert not _new_problems(upward, "rpcompile.ir.costs", extra)


def test_a_cycle_through_a_function_level_import_counts():
    problems = _new_problems(cycles, "rpcompile.ir.costs", "\ndef f():\n    from rpcompile.ir.plan import StagePlan\n")
    assert len(problems) == 1 and "rpcompile.ir.costs, rpcompile.ir.plan" in problems[0], problems


def test_an_upward_import_is_named_with_both_layers():
    problems = _new_problems(upward, "rpcompile.passes.partition.timing", "\nfrom rpcompile.runtime import simulate\n")
    assert len(problems) == 1 and "passes/partition/timing.py:" in problems[0], problems
    assert "rpcompile.passes.partition.timing (passes) imports rpcompile.runtime (runtime), a layer above it" in problems[0]


def test_the_fine_tuning_library_importing_the_command_line_is_named():
    problems = _new_problems(upward, "rpcompile.finetune.run", "\nfrom rpcompile.cli import main\n")
    assert len(problems) == 1 and "finetune/run.py:" in problems[0], problems
    assert "rpcompile.finetune.run (libraries) imports rpcompile.cli.main (cli), a layer above it" in problems[0]


def packages_missing_from(pyproject: str) -> list[str]:
    """Project packages (folders with an `__init__.py`) that `pyproject`'s package list leaves out:
    a wheel built from it would lack them, although an editable install still finds them."""
    import tomllib
    with open(pyproject, "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {name for name, path in project_modules().items() if path.endswith("__init__.py")}
    return sorted(packages - listed)


def test_pyproject_lists_every_package():
    assert packages_missing_from(os.path.join(ROOT, "pyproject.toml")) == []


def test_a_package_left_out_of_pyproject_is_named(tmp_path):
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text.replace('"rpcompile.runtime.sim",', ""))
    assert packages_missing_from(str(pyproject)) == ["rpcompile.runtime.sim"]
