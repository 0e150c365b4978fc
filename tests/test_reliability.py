"""Reliability (issue 14): nothing hangs, bad input is refused up front, buffers and non-finite values are right.

Each test here failed on the code before the issue-14 changes (see the closing note for how).
"""
from __future__ import annotations

import copy
import os
import sys
import threading

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models, also when imported as tests.test_reliability
import models  # noqa: E402
import rpcompile
from rpcompile.models.zoo import LlamaConfig, TinyLlama

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)


def _batch(seed: int, b: int = 4, t: int = 16) -> dict:
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _compile(model=None, example=None, **kw):
    opts = dict(gpus=2, example=example or _batch(0), microbatches=2, optimizer=rpcompile.AdamW(lr=1e-2),
                memory_budget=2**20, backend="host")
    opts.update(kw)
    return rpcompile.compile(model or TinyLlama(CFG), **opts)


def _within(seconds: float, fn):
    """Run fn in a thread; fail if it neither returns nor raises within `seconds`. Returns its exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out["error"] = exc
    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"call did not return within {seconds} s (a hang)"
    return out.get("error")


# -- 1. no hangs --------------------------------------------------------------------------------------------
def test_calls_on_a_closed_handle_raise_at_once():
    c = _compile()
    c.step(_batch(0))
    c.close()
    for call in (lambda: c.step(_batch(1)), lambda: c.evaluate(_batch(1)), c.state_dict, c.model, c.stats,
                 lambda: c.step(_batch(1, t=8))):
        err = _within(10, call)
        assert isinstance(err, RuntimeError) and "closed" in str(err)
    with _compile() as d:
        d.step(_batch(0))
    assert isinstance(_within(10, lambda: d.step(_batch(0))), RuntimeError)


def test_a_failed_replan_leaves_the_handle_working():
    with _compile() as c:
        c.step(_batch(0))
        bad = _batch(1, t=8)
        bad["labels"] = bad["labels"][:, :5]  # labels shorter than the inputs: planning the new shape fails
        assert _within(30, lambda: c.step(bad)) is not None
        assert _within(30, lambda: c.step(_batch(2))) is None  # works as before


def test_a_failed_load_state_dict_changes_nothing_and_the_handle_works():
    with _compile() as c, _compile(TinyLlama(LlamaConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2,
                                                         ffn=64, max_seq=32))) as other:
        c.step(_batch(0))
        before = c.state_dict()["host"]["master"]  # flushes the pending update first
        err = _within(30, lambda: c.load_state_dict(other.state_dict()))
        assert isinstance(err, ValueError)
        assert all(torch.equal(before[n], v) for n, v in c.state.parameters_fp32().items())
        assert _within(30, lambda: c.step(_batch(1))) is None


# -- 3. buffers updated in the forward change once per microbatch, as in eager ---------------------------------
class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
                                    nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()),
                                    nn.Linear(16, 3))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.blocks(x), y)


@pytest.mark.parametrize("gpus", [1, 2])
def test_batchnorm_running_statistics_match_eager(gpus):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    model = _BNNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:  # eager: 2 microbatches per step, the loss their mean, one update per step
        opt.zero_grad()
        sum(ref(xm, ym) for xm, ym in zip(x.chunk(2), y.chunk(2))).div(2).backward()
        opt.step()
    with rpcompile.compile(model, gpus=gpus, example=data[0], microbatches=2, staleness=0, backend="host",
                           optimizer=rpcompile.SGD(lr=0.1, impl="foreach")) as c:
        for b in data:
            c.step(b)
        got = c.model()
    want = dict(ref.named_buffers())
    for n, b in got.named_buffers():
        assert torch.allclose(b.float(), want[n].float(), rtol=1e-5, atol=1e-6), n
    assert int(got.blocks[0][1].num_batches_tracked) == 4 == int(ref.blocks[0][1].num_batches_tracked)
    for n, p in got.named_parameters():
        assert torch.allclose(p, dict(ref.named_parameters())[n], rtol=1e-5, atol=1e-6), n


# -- 5. non-finite values never reach the weights ----------------------------------------------------------------
_MLP = models.LossMLP


def _xy(seed: int, nan: bool = False):
    x, y = models.xy(seed)
    if nan:
        x[1, 3] = float("nan")
    return x, y


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_nan_input_raises_and_keeps_the_last_good_weights(staleness):
    with rpcompile.compile(_MLP(), gpus=2, example=_xy(0), microbatches=2, staleness=staleness, backend="host",
                           optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy(0)), c.step(_xy(1))
        good = c.state_dict()["host"]  # flushed: the last good step applied
        with pytest.raises(FloatingPointError, match=r"step 2 .*layer group \d") as err:
            c.step(_xy(2, nan=True))
            c.model()  # staleness 1: the check runs after step() returned; the next call raises it
        assert "last good step" in str(err.value)
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        assert c.steps == 2
        c.step(_xy(2))  # the next good batch trains on
        assert all(torch.isfinite(p).all() for p in c.model().parameters())


def test_on_nonfinite_skip_skips_and_counts():
    with rpcompile.compile(_MLP(), gpus=2, example=_xy(0), microbatches=2, staleness=1, backend="host",
                           on_nonfinite="skip", optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy(0))
        c.step(_xy(1, nan=True))
        c.step(_xy(2))
        m = c.model()
        assert c.skipped_steps == [1] and c.steps == 3
        assert all(torch.isfinite(p).all() for p in m.parameters())



def test_fp16_dynamic_loss_scaling_keeps_its_skip_and_lower():
    """With a DynamicLossScale the overflow is the scaler's to handle: it skips and halves, nothing raises."""
    from rpcompile.ir.optim import DynamicLossScale
    from rpcompile.passes import emit, trace
    from rpcompile.runtime.executor import Runtime
    from rpcompile.runtime.host.optimizer import HostState
    graph = trace(_MLP(), _xy(0))
    state = HostState.from_graph(graph, optimizer=rpcompile.SGD(lr=1e-2),
                                 loss_scale=DynamicLossScale(init_scale=1024.0, growth_interval=100))
    prog = emit(rpcompile.StagePlan.from_sizes([1] * (len(graph.layers) - 1), 1, [1] * (len(graph.layers) - 1)),
                gpus=2, microbatches=2, staleness=1)
    with Runtime(graph, prog, state, backend="host", timeout=20) as rt:
        rt.step(_xy(0))
        rt.step(_xy(1, nan=True))
        rt.step(_xy(2))
        rt.flush()
    assert state.skipped == [1] and state.loss_scale == 512.0
    assert all(torch.isfinite(state.read(n)).all() for n in graph.params)

# -- 7. bad arguments are ValueErrors that name them, before tracing ----------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(gpus=0), "gpus"), (dict(gpus=-1), "gpus"), (dict(gpus=True), "gpus"), (dict(gpus=2.0), "gpus"),
    (dict(staleness=True), "staleness"), (dict(staleness=2), "staleness"),
    (dict(microbatches=0), "microbatches"), (dict(microbatches=True), "microbatches"),
    (dict(dtype=torch.int64), "dtype"), (dict(dtype="int8"), "dtype"), (dict(backend="tpu"), "backend"),
    (dict(lm_head_shards=0), "lm_head_shards"), (dict(on_nonfinite="ignore"), "on_nonfinite"),
])
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        _compile(**kw)


def test_torch_optimizers_and_meta_models_are_refused_with_what_to_do():
    model = TinyLlama(CFG)
    with pytest.raises(ValueError, match=r"rpcompile\.AdamW"):
        _compile(model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"rpcompile\.SGD"):
        _compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.device("meta"):
        meta = TinyLlama(CFG)
    with pytest.raises(ValueError, match="meta device"):
        _compile(meta)


def test_dtype_names_are_accepted():
    with _compile(dtype="bfloat16") as c:
        assert c.options.dtype is torch.bfloat16
        assert next(iter(c.state.compute.values())).dtype is torch.bfloat16


# -- 2. exact resume: a checkpoint rebuilds its own plan, nothing is re-measured ---------------------------------
@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_with_perturbed_measurements_is_bit_identical(tmp_path, staleness):
    """Save at step 3; load in a fresh process whose every measured time is multiplied by U(0.5, 2) noise
    (and whose plans would differ): steps 4-6 are bit-identical to the uninterrupted run."""
    import os
    import subprocess
    import sys
    import textwrap
    ref = _compile(staleness=staleness)
    for i in range(3):
        ref.step(_batch(i))
    path = str(tmp_path / "ckpt.rp")
    ref.save(path)
    for i in range(3, 6):
        ref.step(_batch(i))
    want = {n: p.detach().clone() for n, p in ref.model().named_parameters()}
    ref.close()
    out = str(tmp_path / "resumed.pt")
    script = textwrap.dedent(f"""
        import random, dataclasses, torch, rpcompile
        import rpcompile.passes as P, rpcompile.passes.cost as C
        from rpcompile.models.zoo import TinyLlama
        from tests.test_reliability import CFG, _batch
        orig, rng, calls = C.estimate_costs, random.Random(7), []
        def noisy(*a, **kw):
            calls.append(1)
            c = orig(*a, **kw)
            return dataclasses.replace(c, fwd=tuple(x * rng.uniform(0.5, 2) for x in c.fwd),
                                       bwd=tuple(x * rng.uniform(0.5, 2) for x in c.bwd))
        C.estimate_costs = P.estimate_costs = noisy
        c = rpcompile.load({path!r}, TinyLlama(CFG, seed=123))
        assert c.steps == 3 and not calls, (c.steps, len(calls))
        for i in range(3, 6):
            c.step(_batch(i))
        torch.save({{n: p.detach().clone() for n, p in c.model().named_parameters()}}, {out!r})
        c.close()
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, timeout=300)
    got = torch.load(out)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
