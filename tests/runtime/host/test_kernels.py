"""The host optimizer's C++ kernels and HostState's memory-speed path, against eager torch."""
from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import tomllib
import warnings

import pytest
import torch
from torch import nn

import models
import rpcompile
from forked import damaged_copy
from oracle import reference_train
from rpcompile.ir.cache import intact
from rpcompile.ir.hardware import Hardware
from rpcompile.ir.optim import DynamicLossScale
from rpcompile.passes import emit, trace
from rpcompile.runtime.executor import Runtime
from rpcompile.runtime.host import kernels as kmod
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.runtime.stage.batch import split_batch

K = kmod.load_kernels()
pytestmark = pytest.mark.skipif(K is None, reason="no C++ compiler: the kernels cannot be built")
SHAPES = {"a": (33, 7), "b": (7,), "c": (5, 9)}  # odd sizes: vector tails and alignment gaps


def specials(n: int, seed: int = 0) -> torch.Tensor:
    """Random floats over many magnitudes, with infinities, subnormals, signed zeros and bf16/fp16 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    x[:12] = torch.tensor([float("inf"), -float("inf"), 1e-40, -1e-45, 0.0, -0.0, 3.4e38, 65504.0, 65520.0,
                           1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0**-24 * 1.5])
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_is_bitwise_to_dtype(dtype):
    x = specials(100_003)
    x[20] = float("nan")
    out = torch.empty(x.numel(), dtype=dtype)
    K.cast(x, out)
    ref = x.to(dtype)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(out[~nan].view(bits), ref[~nan].view(bits))  # bitwise: signed zeros, ties, overflow


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_landing_writes_the_gradient_and_its_statistics_in_one_pass(src_dtype):
    g = torch.Generator().manual_seed(1)
    first, second = (torch.randn(200_003, generator=g).to(src_dtype) for _ in range(2))
    buf = torch.full((200_003,), 7.0)  # logically zero: the first write overwrites
    sq, bad = K.land(buf, first, add=False)
    assert torch.equal(buf, first.float()) and not bad
    sq, bad = K.land(buf, second, add=True)
    ref = first.float() + second.float()
    assert torch.equal(buf, ref) and not bad
    assert sq == pytest.approx(float((ref.double() ** 2).sum()), rel=1e-12)
    threads = torch.get_num_threads()
    try:  # fixed blocks: the same sum with any thread count
        torch.set_num_threads(1)
        assert K.land(buf.clone(), buf, add=False)[0] == K.land(buf.clone(), buf, add=False)[0]
        one = K.land(buf.clone(), buf, add=False)[0]
    finally:
        torch.set_num_threads(threads)
    assert K.land(buf.clone(), buf, add=False)[0] == one
    for special in (float("inf"), float("nan")):
        part = second.clone()
        part[123_456] = special
        assert K.land(buf, part, add=True)[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_landing_converts_every_16_bit_pattern_as_torch_does(dtype):
    """All 65536 bit patterns (subnormals, infinities, NaNs, signed zeros) land as Tensor.float() gives them."""
    src = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    buf = torch.empty(src.numel())
    _, bad = K.land(buf, src, add=False)
    ref = src.float()
    nan = ref.isnan()
    assert bad and torch.equal(buf.isnan(), nan)
    assert torch.equal(buf[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_kernels_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="contiguous CPU torch.float32 of 4 elements"):
        K.land(torch.zeros(4), torch.zeros(8)[::2], add=False)
    with pytest.raises(ValueError, match="torch.float64"):
        K.cast(torch.zeros(4), torch.zeros(4, dtype=torch.float64))


def state_and_eager(cfg, dtype=None, one_group=False, **kw):
    """A kernel HostState over three parameters in three layers (or all in one), and eager fp32 copies of them."""
    g = torch.Generator().manual_seed(3)
    params = {k: nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}
    owners = {k: (0 if one_group else i,) for i, k in enumerate(params)}
    state = HostState(params, owners, 1 if one_group else 3, optimizer=cfg, dtype=dtype, **kw)
    assert (state.kernels is not None) == (cfg.impl == "fused")
    return state, {k: nn.Parameter(v.detach().clone()) for k, v in params.items()}


def grads_of(t: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Iteration t's seeded gradients (times `scale`)."""
    return {k: torch.randn(s, generator=torch.Generator().manual_seed(10 * t + i)) * scale
            for i, (k, s) in enumerate(SHAPES.items())}


def run(state, t, grads, copy_in_step=False):
    """One iteration through the protocol: writes (bf16 as a device would send them), complete, step, copy."""
    for k, v in grads.items():
        state.accumulate_grad(k, v.to(state.read(k).dtype) if state.dtype else v)
    for l in reversed(range(len(state.groups))):
        state.grads_complete(l)
    for l in reversed(range(len(state.groups))):
        state.step(l, copy=copy_in_step)
        state.copy(l)


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6, scale: torch.Tensor | float = 0.0) -> bool:
    """|a - b| <= rel * (|b| + scale) elementwise (plus a float32 ulp at zero).

    `scale`: the size of the terms `b` was computed from. An update that cancels a parameter to near zero
    (p * (1 - lr * wd) - lr * m / sqrt(v)) keeps the rounding error of its terms, not of its result: eager
    PyTorch's vectorized kernels round differently on different CPUs (FMA or not), by an ulp of the terms.
    """
    return bool(((a - b).abs() <= rel * (b.abs() + scale) + 1e-12).all())


@pytest.mark.parametrize("copy_in_step", [False, True])
def test_adamw_with_clipping_and_decay_equals_eager(copy_in_step):
    cfg = rpcompile.AdamW(lr=0.05, weight_decay=0.1, max_grad_norm=1.0, decay={"a", "c"})
    state, eager = state_and_eager(cfg, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([{"params": [eager["a"], eager["c"]]}, {"params": [eager["b"]], "weight_decay": 0.0}],
                            lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
    for t in range(3):
        grads = grads_of(t)
        run(state, t, grads, copy_in_step)
        for k, p in eager.items():
            p.grad = grads[k].to(torch.bfloat16).float()  # what crossed PCIe
        norm = torch.nn.utils.clip_grad_norm_(eager.values(), 1.0)
        assert norm > 1.0 and float(state.norms[t]) == pytest.approx(float(norm), rel=1e-6)
        before = {k: p.detach().abs() + cfg.lr for k, p in eager.items()}  # the update's terms: p and lr * m / sqrt(v)
        opt.step()
        for k, p in eager.items():
            assert close(state.master[k], p.detach(), scale=before[k]), (t, k, (state.master[k] - p).abs().max())
            assert torch.equal(state.read(k), state.master[k].to(torch.bfloat16)), (t, k)
            assert close(state.flat.moment[k]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_a_step_that_writes_the_copy_leaves_the_others_of_its_group_to_copy():
    """step(copy=True) writes only the parameters it updates: `copy` then casts the rest of the group."""
    state, _ = state_and_eager(rpcompile.SGD(lr=0.1), dtype=torch.bfloat16, one_group=True)
    state.master["b"].add_(1.0)  # the masters changed behind the compute copy (a loaded state, say)
    state.accumulate_grad("a", torch.ones(SHAPES["a"]))  # b and c get no gradient this iteration
    state.step(0, copy=True)
    state.copy(0)
    for k in SHAPES:
        assert torch.equal(state.read(k), state.master[k].to(torch.bfloat16)), k


def _nanogpt_run(staleness: int, opt, dtype=None):
    """nanoGPT, 4 steps of 4 microbatches on 2 host workers: (losses, fp32 weights, the state, casts by COPY)."""
    model = models.nanogpt(0)
    batches = [models.token_batch(batch=4, seq=8, seed=s) for s in range(4)]
    graph = trace(model, batches[0], loss_fn=models.gpt_loss)
    state = HostState.from_graph(graph, optimizer=opt, dtype=dtype)
    casts, cast = [], state.kernels.cast
    state.kernels.cast = lambda src, out: casts.append(src.numel()) or cast(src, out)  # a separate copy pass
    prog = emit(rpcompile.StagePlan.from_str("3,2|1|2,3"), gpus=2, microbatches=4, staleness=staleness)
    with Runtime(graph, prog, state, backend="host", timeout=30) as rt:
        losses = [rt.step(b) for b in batches]
        rt.flush()
    return model, graph, batches, losses, state, casts


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_runtime_writes_the_copy_in_the_step_at_staleness_0(staleness):
    """Each STEP writes its compute copies in the update's pass, no COPY casts (staleness 1: into the other of
    the two buffers the copies alternate between, cast from the masters once when the runtime starts); both
    equal the oracle."""
    opt = rpcompile.AdamW(lr=1e-2, eps=1e-4, weight_decay=0.1, max_grad_norm=0.05)
    model, graph, batches, losses, state, casts = _nanogpt_run(staleness, opt)
    segments = sum(len(segs) for g, segs in enumerate(state.layout.segments) if state.groups[g])
    assert state.kernels is not None and len(casts) == (0 if staleness == 0 else segments)

    def loss_fn(mdl, batch):  # the runtime's loss: the mean over the microbatches
        return sum(mdl(*(p[n] for n in graph.inputs))[1] for p in split_batch(graph, batch, 4)) / 4
    ref, sd = reference_train(model, batches, optimizer=opt, staleness=staleness, loss_fn=loss_fn)
    assert losses == pytest.approx(ref, rel=1e-5)
    for n, v in state.parameters_fp32().items():
        assert torch.allclose(v, sd[n], rtol=1e-5, atol=1e-5 * sd[n].abs().max().item()), n
    _, _, _, _, half, casts = _nanogpt_run(staleness, opt, dtype=torch.bfloat16)
    assert len(casts) == (0 if staleness == 0 else segments)
    for n, m in half.master.items():  # the step's copies are bitwise master.to(dtype) (staleness 1: one behind)
        assert torch.equal(half.read(n), m.to(torch.bfloat16)) == (staleness == 0), n


def test_dynamic_loss_scale_skip_leaves_everything_bitwise_and_scaled_steps_equal_eager():
    cfg = rpcompile.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, max_grad_norm=5.0)
    state, eager = state_and_eager(cfg, dtype=torch.float16, loss_scale=DynamicLossScale(init_scale=1024.0))
    opt = torch.optim.SGD(eager.values(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True)
    for t in range(4):
        scale = state.begin_iteration()
        grads = grads_of(t)
        if t == 2:  # an overflow: skipped, the scale halves
            grads["b"][3] = float("inf")
        before = {k: (state.master[k].clone(), state.flat.moment[k]["momentum_buffer"].clone()) for k in SHAPES}
        copies = {k: state.read(k).clone() for k in SHAPES}
        run(state, t, {k: v * scale for k, v in grads.items()})
        if t == 2:
            assert state.skipped == [2] and state.loss_scale == 512.0
            for k, (m, buf) in before.items():
                assert torch.equal(state.master[k], m) and torch.equal(state.flat.moment[k]["momentum_buffer"], buf)
                assert torch.equal(state.read(k), copies[k])
            continue
        for k, p in eager.items():  # fp16 gradients as they arrive, unscaled exactly (power-of-two scale)
            p.grad = (grads[k] * scale).to(torch.float16).float() / scale
        torch.nn.utils.clip_grad_norm_(eager.values(), 5.0)
        opt.step()
        for k, p in eager.items():
            assert close(state.master[k], p.detach()), (t, k)
            assert torch.equal(state.read(k), state.master[k].to(torch.float16))


def test_static_scale_and_a_missing_gradient_split_the_update():
    """p "b" gets no gradient in iteration 1: its AdamW step count falls behind, as eager's with set_to_none;
    in one group, the update then runs as three kernel calls (a, b and c differ in step count)."""
    cfg = rpcompile.AdamW(lr=0.1)
    state, eager = state_and_eager(cfg, one_group=True, loss_scale=4.0)
    opt = torch.optim.AdamW(eager.values(), lr=0.1, foreach=True)
    for t in range(3):
        grads = {k: v for k, v in grads_of(t).items() if not (t == 1 and k == "b")}
        state.begin_iteration()
        run(state, t, {k: v * 4.0 for k, v in grads.items()})
        for k, p in eager.items():
            p.grad = grads.get(k)
        opt.step()
    assert state.counts == {"a": 3, "b": 2, "c": 3}
    for k, p in eager.items():
        assert close(state.master[k], p.detach()), k


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_data_parallel_averages_in_place_and_the_norm_sees_the_average(impl):
    """average_grads: the all-reduce gets the group's flat buffer itself; the average is Tensor.div_'s, and
    the clipping norm and the non-finite check are those of the average (taken in the dividing pass)."""
    state, _ = state_and_eager(rpcompile.AdamW(lr=0.1, max_grad_norm=1.0, impl=impl))
    reduced = []

    def all_reduce(flat):  # three processes holding the same gradient plus one bump: the sum
        reduced.append(flat.data_ptr())
        flat.mul_(3.0).add_(0.25)
    state.on_complete = lambda layer: state.average_grads(layer, 3, all_reduce)
    grads = grads_of(0)
    for k, v in grads.items():
        state.accumulate_grad(k, v)
    for l in (2, 1, 0):
        state.grads_complete(l)
    assert reduced == [state.flat.grads[l].data_ptr() for l in (2, 1, 0)]  # in place: no copy in or out
    avg = {k: (v * 3.0 + 0.25).div_(3) for k, v in grads.items()}
    for k in SHAPES:
        assert torch.equal(state.grad[k], avg[k]), k
    want = torch.linalg.vector_norm(torch.cat([v.flatten() for v in avg.values()]))
    assert float(state.global_norm()) == pytest.approx(float(want), rel=1e-6)


def test_mixed_compute_dtypes_in_one_group_and_the_layout():
    """dtype=None keeps each parameter's dtype: a group with an fp32 and a bf16 parameter has two segments."""
    params = {"w": nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)), "b": nn.Parameter(torch.randn(3)),
              "f": nn.Parameter(torch.randn(2), requires_grad=False)}
    state = HostState(params, {"w": (0,), "b": (0,), "f": (0,)}, 1, optimizer=rpcompile.SGD(lr=0.5))
    assert [s.dtype for s in state.layout.segments[0]] == [torch.bfloat16, torch.float32]
    assert state.where == state.layout.where
    state.accumulate_grad("w", torch.ones(5, 3, dtype=torch.bfloat16))
    state.accumulate_grad("b", torch.ones(3))
    state.step(0)
    state.copy(0)
    for k in ("w", "b"):
        assert torch.equal(state.master[k], params[k].detach().float() - 0.5)
        assert torch.equal(state.read(k), state.master[k].to(params[k].dtype))
    assert torch.equal(state.read("f"), params["f"].detach())  # frozen: untouched behind the trainables


def test_state_dict_moves_between_the_kernels_and_torch():
    cfg = rpcompile.AdamW(lr=0.05, max_grad_norm=2.0)
    fused, _ = state_and_eager(cfg)
    for t in range(2):
        run(fused, t, grads_of(t))
    torch_path, _ = state_and_eager(rpcompile.AdamW(lr=0.05, max_grad_norm=2.0, impl="foreach"))
    torch_path.load_state_dict(fused.state_dict())
    opt = torch_path._optims[0]
    assert opt.state[torch_path.master["a"]]["exp_avg"].data_ptr() == torch_path.flat.moment["a"]["exp_avg"].data_ptr()
    for s in (fused, torch_path):
        run(s, 2, grads_of(2))
    for k in SHAPES:
        assert close(torch_path.master[k], fused.master[k]), k
    assert float(opt.state[torch_path.master["a"]]["step"]) == 3.0 and fused.counts["a"] == 3


def test_without_a_compiler_it_falls_back_to_torch_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))
    monkeypatch.delitem(kmod.sys.modules, kmod.module_name(), raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = HostState({"w": nn.Parameter(torch.ones(3))}, {"w": (0,)}, 1, optimizer=rpcompile.AdamW(lr=0.1))
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "no C++ compiler" in msgs[0] and "torch's optimizer" in msgs[0]
    assert state.kernels is None and state._optims[0] is not None
    state.accumulate_grad("w", torch.ones(3))
    state.step(0)
    ref = nn.Parameter(torch.ones(3))
    ref.grad = torch.ones(3)
    torch.optim.AdamW([ref], lr=0.1, fused=True).step()
    assert torch.equal(state.master["w"], ref.detach())


def test_hardware_measure_times_the_optimizer_it_is_given():
    calls = []
    hw = Hardware.measure("cpu", budget_s=0.3, optimizer_rate=lambda budget: calls.append(budget) or 1.25e9)
    assert hw.optimizer_bytes_per_s == 1.25e9 and len(calls) == 1 and 0 < calls[0] <= 0.3
    assert kmod.optimizer_rate(0.05, elements=2 ** 16) > 1e6  # the kernels' AdamW: fp32 master bytes/s


def test_the_build_key_covers_every_header_the_source_includes_and_they_ship(monkeypatch, tmp_path):
    # an edited header must build anew (the name keys it), and an installed package must carry it
    included, todo = set(), [kmod.SOURCE]
    while todo:  # SOURCE's own includes, and theirs
        with open(todo.pop()) as f:
            found = set(re.findall(r'^#include "([^"]+)"', f.read(), flags=re.M)) - included
        included |= found
        todo += [os.path.join(os.path.dirname(kmod.SOURCE), h) for h in found]
    assert sorted(included) == sorted(os.path.basename(h) for h in kmod.HEADERS) and included
    root = os.path.dirname(os.path.dirname(os.path.dirname(kmod.SOURCE)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        shipped = tomllib.load(f)["tool"]["setuptools"]["package-data"]["rpcompile.runtime.host"]
    assert all(any(fnmatch.fnmatch(os.path.basename(h), pat) for pat in shipped) for h in kmod.HEADERS), shipped
    header = tmp_path / "kernels_avx512.h"
    header.write_text("// one")
    monkeypatch.setattr(kmod, "HEADERS", (str(header),))
    before = kmod.module_name()
    header.write_text("// two")
    assert kmod.module_name() != before


LOAD = ("import sys, torch; from rpcompile.runtime.host import kernels; k = kernels.load_kernels(); "
        "print(k.land(torch.zeros(3), torch.tensor([1.0, 2.0, 2.0]), add=False), "
        "'torch.utils.cpp_extension' in sys.modules)")


def load_in_a_fresh_interpreter() -> tuple[str, str]:
    """(stdout, stderr) of a new Python that loads the kernels (from $RPCOMPILE_CACHE) and lands [1, 2, 2]."""
    run = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True)
    assert run.returncode == 0, (run.returncode, run.stderr)  # -7: SIGBUS
    return run.stdout, run.stderr


@pytest.mark.parametrize("how", [None, "truncated", "garbage"])
def test_a_fresh_interpreter_builds_missing_or_damaged_kernels_quietly_and_uses_them(monkeypatch, tmp_path, how):
    """Nothing cached (a first run), half the file (a link stopped by a full disk: mapping it killed the process
    with SIGBUS) or as many garbage bytes (it fell back to torch's kernels, and the build tool, finding the file up
    to date, never built it again): the kernels are built, with nothing on stderr (not torch's extension module's
    CUDA_HOME line: the kernels are CPU code), and used. A later process imports the sealed build directly,
    without cpp_extension (setuptools and a ninja check: about 70 ms)."""
    monkeypatch.setenv("RPCOMPILE_CACHE", str(tmp_path))
    name = kmod.module_name()
    path = os.path.join(kmod.cache_dir(), name, name + ".so")
    if how is not None:
        damaged_copy(K.module.__file__, path, how)
    assert load_in_a_fresh_interpreter() == ("(9.0, False) True\n", "")  # built: cpp_extension was imported
    assert intact(path)
    if how == "garbage":
        assert load_in_a_fresh_interpreter() == ("(9.0, False) False\n", "")
