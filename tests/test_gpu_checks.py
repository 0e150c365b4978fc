"""The GPU checks, checked on the CPU: what tests/runtime/test_runtime_cuda.py, bench/gpu.sh and
bench/gpu_compare.py rely on, and the CPU suite's part in them.

- the CUDA peak-memory test's prediction adds the cuBLAS workspace (`Hardware.blas_workspace`,
  tested in tests/ir/test_hardware.py);
- the bf16 dropout reproducibility test runs one plan twice, however the costs are measured;
- `bench/gpu_compare.py` times k steps back to back with one flush;
- `bench/gpu.sh` fails loudly when nvidia-smi lists a GPU that torch cannot use;
- every compile()/Runtime() in the CPU suite names its backend, so a GPU machine runs the host
  backend where the tolerances were set for it.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

import rpcompile  # noqa: E402
import rpcompile.api  # noqa: E402
import rpcompile.pipeline  # noqa: E402
from rpcompile import CostTable, StagePlan  # noqa: E402

from paths import ROOT, TESTS  # noqa: E402

KIB, MIB = 2**10, 2**20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


# cuBLAS workspaces in the CUDA peak-memory test's prediction ------------------------------------------


def test_the_cuda_peak_memory_test_predicts_the_workspace_too():
    from tests.runtime.test_runtime_cuda import predicted_peak
    costs = CostTable.from_lists([1, 1, 1], [2, 2, 2], param_bytes=[MIB] * 3, grad_bytes=[MIB] * 3,
                                 peak_bytes=[3 * MIB] * 3)
    plan = StagePlan.from_str("1,1|1|2")
    stages = max(plan.stage_memory(costs, gpus=1))
    assert predicted_peak(plan, costs, (9, 0)) == stages + 33 * MIB  # H100 / H200
    assert predicted_peak(plan, costs, (8, 9)) == stages + 8 * MIB + 128 * KIB + MIB


# the dropout reproducibility test pins its plan ------------------------------------------------

def test_the_bf16_reproducibility_check_runs_one_plan_however_the_costs_are_measured(tmp_path, monkeypatch):
    """Every other measuring compile sees every other layer's forward 6x slower (measurement noise).

    Two compiles (what the CUDA test did) then choose different plans; `bf16_runs` compiles once and
    restarts from the step-0 checkpoint, which measures nothing, so both runs use one plan, bit for bit.
    """
    from tests.runtime.test_runtime_cuda import bf16_runs
    import models
    measured: list[int] = []  # one entry per compile that measured its costs
    real_passes, real_costs = rpcompile.api.compile_passes, rpcompile.passes.estimate_costs

    def counting(model, example, opts, *, mode="measure", frozen=None):
        if frozen is None:
            measured.append(1)
        return real_passes(model, example, opts, mode=mode, frozen=frozen)

    first: dict[tuple, dict] = {}  # per graph, its first measurement, which every later one repeats (real
    # timings vary with the machine's load, and the test compares plans across compiles: only the injected
    # noise may differ)

    def noisy(graph, example, **kw):
        costs = real_costs(graph, example, **kw)
        base = first.setdefault(tuple(costs.names), costs.to_lists())
        lists = {k: (None if v is None else list(v)) for k, v in base.items()}
        if len(measured) % 2:
            return CostTable.from_lists(**lists)
        lists["fwd"] = [t * (6 if i % 2 else 1) for i, t in enumerate(lists["fwd"])]
        return CostTable.from_lists(**lists)
    monkeypatch.setattr(rpcompile.api, "compile_passes", counting)
    # rank by time alone: the host tie (20%) would hide the noise that the second compile saw, and the point
    # is that bf16_runs measures once, whatever the tie
    monkeypatch.setattr(rpcompile.pipeline, "HOST_MEASURED_TIE", 0.0)
    monkeypatch.setattr(rpcompile.passes, "estimate_costs", noisy)
    kw = dict(gpus=2, example=models.lm_batch(batch=8, seq=16), microbatches=4, dtype=torch.bfloat16,
              memory_budget=2**19, backend="host")
    plans = []
    for _ in range(2):
        with rpcompile.compile(models.llama(attention_dropout=0.2), **kw) as c:
            plans.append(c.plan.to_str())
    assert plans[0] != plans[1], plans  # the old pattern: two measured compiles, two plans
    (l1, ev1, _, p1), (l2, ev2, _, p2) = bf16_runs(tmp_path, "host", steps=2, memory_budget=2**19)
    assert len(measured) == 3 and p1 == p2 == plans[0]
    assert l1 == l2 and ev1 == ev2


# gpu_compare times k steps back to back -------------------------------------------------------

def test_gpu_compare_flushes_once_after_the_timed_steps():
    spec = importlib.util.spec_from_file_location("gpu_compare", os.path.join(ROOT, "bench", "gpu_compare.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls: list = []
    seconds, out = bench.timed(lambda b: calls.append(b) or -b, lambda: calls.append("flush"), [0, 1, 2, 3], 1)
    assert calls == [0, "flush", 1, 2, 3, "flush"] and out == [0, -1, -2, -3] and seconds >= 0


# gpu.sh fails loudly --------------------------------------------------------------------------

def _gpu_sh(tmp_path, nvidia_smi: str | None) -> subprocess.CompletedProcess:
    """bench/gpu.sh with this interpreter and, if given, a fake nvidia-smi (a shell script body) on PATH."""
    path = os.environ.get("PATH", "")
    if nvidia_smi is not None:
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "nvidia-smi").write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        (fake / "nvidia-smi").chmod(0o755)
        path = f"{fake}{os.pathsep}{path}"
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable}
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


@no_cuda
def test_gpu_sh_fails_when_nvidia_smi_lists_a_gpu_torch_cannot_use(tmp_path):
    r = _gpu_sh(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"')
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nvidia-smi lists 1 GPU(s) but torch cannot use CUDA; nothing was run" in r.stderr
    assert "torch.cuda.init()" in r.stderr and "no CUDA GPU" not in r.stdout


@no_cuda
def test_gpu_sh_without_a_gpu_says_so_and_passes(tmp_path):
    r = _gpu_sh(tmp_path, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9')
    assert r.returncode == 0 and "no CUDA GPU" in r.stdout, r.stdout + r.stderr
    if shutil.which("nvidia-smi") is None:  # and with no nvidia-smi at all
        r = _gpu_sh(tmp_path, None)
        assert r.returncode == 0 and "no CUDA GPU" in r.stdout, r.stdout + r.stderr


def test_gpu_sh_runs_the_cuda_tests_by_path():
    script = open(os.path.join(ROOT, "bench", "gpu.sh")).read()
    assert "tests/runtime/test_runtime_cuda.py" in script and "-m cuda" not in script


# every compile()/Runtime() in the CPU suite names its backend ---------------------------------

def _targets(tree: ast.Module) -> set[str]:
    """Call names that reach rpcompile's compile or the Runtime in this module."""
    names = {"Runtime"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rpcompile"):
            names |= {a.asname or a.name for a in node.names if a.name == "compile"}
    return names


def _is_target(func: ast.expr, names: set[str]) -> bool:
    """rpcompile.compile(...), compile(...) imported from rpcompile, Runtime(...) or x.Runtime(...)."""
    if isinstance(func, ast.Name):
        return func.id in names
    if isinstance(func, ast.Attribute):
        return func.attr == "Runtime" or (func.attr == "compile" and isinstance(func.value, ast.Name)
                                          and func.value.id == "rpcompile")
    return False


def _carries_backend(expr: ast.expr, assigned: dict[str, list[ast.expr]], seen: frozenset = frozenset()) -> bool:
    """Whether a `**expr` surely holds "backend": dict(backend=...), {"backend": ...}, or a name bound only to those."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        return any(k.arg == "backend" or (k.arg is None and _carries_backend(k.value, assigned, seen))
                   for k in expr.keywords)
    if isinstance(expr, ast.Dict):
        return any((isinstance(k, ast.Constant) and k.value == "backend")
                   or (k is None and _carries_backend(v, assigned, seen)) for k, v in zip(expr.keys, expr.values))
    if isinstance(expr, ast.Name) and expr.id not in seen and assigned.get(expr.id):
        return all(_carries_backend(v, assigned, seen | {expr.id}) for v in assigned[expr.id])
    return False


def backendless_calls(source: str, filename: str = "<test>") -> list[str]:
    """"file:line: call" for every compile()/Runtime() call in `source` that does not pass backend= surely."""
    tree = ast.parse(source, filename)
    names, out = _targets(tree), []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    owner = {}  # call -> innermost scope (later scopes in walk order are nested deeper or siblings)
    for scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Call):
                owner[node] = scope
    for call, scope in owner.items():
        if not _is_target(call.func, names):
            continue
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned.setdefault(node.targets[0].id, []).append(node.value)
        if not any(k.arg == "backend" or (k.arg is None and _carries_backend(k.value, assigned))
                   for k in call.keywords):
            out.append(f"{filename}:{call.lineno}: {ast.unparse(call)[:100]}")
    return out


def test_the_backend_check_finds_a_call_without_one():
    src = ("import rpcompile\nfrom rpcompile import compile as cc\n"
           "def f(kw):\n    opts = dict(gpus=2, backend='host')\n    rpcompile.compile(m, **opts)\n"
           "    rpcompile.compile(m, **{**opts, **kw})\n    rpcompile.compile(m, **kw)\n"
           "    cc(m, gpus=2)\n    Runtime(g, p, s, backend='host')\n    re.compile('x')\n")
    assert [s.split(":")[1] for s in backendless_calls(src)] == ["7", "8"]


def test_every_compile_and_runtime_call_in_the_cpu_suite_names_its_backend():
    """backend="auto" picks CUDA on a GPU machine, where the host-set tolerances of these tests do not hold."""
    missing = []
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py") and name != "test_runtime_cuda.py":  # that one is for CUDA
                path = os.path.join(folder, name)
                with open(path) as f:
                    missing += backendless_calls(f.read(), os.path.relpath(path, TESTS))
    assert not missing, "pass backend= (\"host\" where a tolerance is host-specific):\n" + "\n".join(missing)
