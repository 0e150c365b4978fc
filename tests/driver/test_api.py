"""The public API: compile, step, evaluate, model, re-planning, deadlines, bad input. Checkpoints (save, load,
resume) are test_checkpoints.py; `CFG`, `make`, `batch` and `params` here are what the driver tests share."""
import math
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import rpcompile
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from rpcompile.runtime.transfer import RuntimeFailure
from paths import ROOT  # noqa: E402 - tests/ is on sys.path (tests/conftest.py)

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)


def batch(seed, b=4, t=16):
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def make(staleness=1, model=None, **kw):
    opts = dict(gpus=2, example=batch(0), microbatches=2, staleness=staleness,
                optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"), memory_budget=2**20, backend="host")
    opts.update(kw)
    return rpcompile.compile(model or TinyLlama(CFG), **opts)


def params(c):
    return {n: p.detach().clone() for n, p in c.model().named_parameters()}


def test_compiled_is_printable_and_trains():
    with make() as c:
        for text in (str(c.graph), str(c.costs), str(c.plan), str(c.program), repr(c)):
            assert text
        assert "share of t_max" in str(c.plan)
        losses = [c.step(batch(0)) for _ in range(6)]
        assert losses[-1] < losses[0]
        assert c.evaluate(batch(0)) == pytest.approx(c.evaluate(batch(0)))


def test_model_gives_back_the_module_with_every_update_applied():
    with make(staleness=1) as c:
        before = params(c)
        c.step(batch(0))
        after = params(c)  # staleness 1: the update of step 1 is pending in the host state; model() applies it
        assert any(not torch.equal(before[n], after[n]) for n in before)
        masters = c.state.parameters_fp32()
        assert all(torch.equal(after[n], masters[n]) for n in masters)


def test_bad_batches_are_named_before_any_worker_starts():
    with make() as c:
        b = batch(0)
        with pytest.raises(ValueError, match="'input_ids'.*not divisible by 2"):
            c.step({"input_ids": b["input_ids"][:3], "labels": b["labels"][:3]})
        with pytest.raises(ValueError, match="missing 'labels'"):
            c.step({"input_ids": b["input_ids"]})
        with pytest.raises(ValueError, match="'labels' has dtype torch.float32"):
            c.step({"input_ids": b["input_ids"], "labels": b["labels"].float()})
        assert c.steps == 0
        c.step(b)  # still usable
        assert c.steps == 1


def test_a_new_sequence_length_replans_and_keeps_training(capsys):
    with make() as c:
        c.step(batch(0))
        loss = c.step(batch(1, t=24))
        assert "re-planned" in capsys.readouterr().err
        assert loss == loss and c.steps == 2


def test_a_script_that_forgets_close_exits_cleanly():
    script = textwrap.dedent("""
        import sys, rpcompile
        sys.path.insert(0, "tests")  # the helpers test_api imports
        from tests.driver.test_api import CFG, batch
        from rpcompile.models.zoo import TinyLlama
        import gc, threading

        def run_and_drop():  # the handle is dropped when this returns, its run never closed
            rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(0), microbatches=2, staleness=1).step(batch(0))
        run_and_drop()
        gc.collect()
        print("left", [t.name for t in threading.enumerate() if t.name.startswith("rpcompile")])
        c = rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(0), microbatches=2)
        c.step(batch(0))
        print("stepped")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]  # was -6 (SIGABRT: "terminate called without an active
    assert "stepped" in r.stdout and "left []" in r.stdout, r.stdout  # exception") with the dropped run's threads
    assert "terminate called" not in r.stderr


def test_simulate_predicts_costs_for_the_target_hardware():
    with make() as c:
        fast = c.simulate("h100")
        slow = c.simulate("rtx4090")
        assert 0 < fast.iteration_time < slow.iteration_time
        assert len(fast.peak_memory) == 2


# -- bad arguments are ValueErrors that name them, before tracing ----------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(gpus=0), "gpus"), (dict(gpus=-1), "gpus"), (dict(gpus=True), "gpus"), (dict(gpus=2.0), "gpus"),
    (dict(staleness=True), "staleness"), (dict(staleness=2), "staleness"),
    (dict(microbatches=0), "microbatches"), (dict(microbatches=True), "microbatches"),
    (dict(dtype=torch.int64), "dtype"), (dict(dtype="int8"), "dtype"), (dict(backend="tpu"), "backend"),
    (dict(lm_head_shards=0), "lm_head_shards"), (dict(on_nonfinite="ignore"), "on_nonfinite"),
])
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        make(**kw)


def test_torch_optimizers_and_meta_models_are_refused_with_what_to_do():
    model = TinyLlama(CFG)
    with pytest.raises(ValueError, match=r"rpcompile\.AdamW"):
        make(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"rpcompile\.SGD"):
        make(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.device("meta"):
        meta = TinyLlama(CFG)
    with pytest.raises(ValueError, match="meta device"):
        make(model=meta)


def test_dtype_names_are_accepted():
    with make(dtype="bfloat16") as c:
        assert c.options.dtype is torch.bfloat16
        assert next(iter(c.state.compute.values())).dtype is torch.bfloat16


NAP = {"cpu": 0.0, "sleep": 0.0}  # seconds the slow block spins (CPU time: what compile times) and sleeps


def nap(x):
    """Spin NAP["cpu"] s of this thread's CPU time, sleep NAP["sleep"] s, then x + 0: an op of its own, so the
    block's ops differ from its siblings' and compile times it apart from them."""
    end = time.thread_time() + NAP["cpu"]
    while time.thread_time() < end:
        pass
    time.sleep(NAP["sleep"])
    return x + 0


torch.fx.wrap("nap")


class Napping(torch.nn.Module):
    """A decoder block that spins and sleeps before it runs: a slow but healthy layer."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return self.block(nap(x), cos, sin)


def napping_llama():
    model = TinyLlama(CFG)
    model.layers[1] = Napping(model.layers[1])
    return model


def test_the_default_deadline_comes_from_the_plan_and_never_undercuts_ten_minutes(monkeypatch):
    from rpcompile.runtime import transfer
    costs = rpcompile.CostTable.from_lists(fwd=[1.0, 75.0], bwd=[2.0, 150.0], grad_bytes=[0, 10**9])
    # a 75 s layer: 4 microbatches of forward, recompute and backward, and 1 GB of gradient to step
    assert transfer.plan_deadline(costs, 4) == transfer.DEADLINE_FACTOR * (4 * (4.0 + 300.0) + 10.0)
    assert transfer.plan_deadline(rpcompile.CostTable.from_lists(fwd=[1e-3], bwd=[2e-3]), 4) == 600.0
    with make() as c:  # measured costs of milliseconds: the floor, far above the 75 s a layer may take once
        assert c.deadline_s == 600.0
    with make(timeout=2.5) as c:
        assert c.deadline_s == 2.5
    with pytest.raises(ValueError, match="timeout must be"):
        make(timeout=0)


def test_a_slow_layer_gets_a_deadline_from_its_measured_time_and_a_set_timeout_still_fails_it(monkeypatch):
    """A layer that compile measures at 0.1 s, with the floor scaled down from 600 s to 0.05 s.

    Its measured time sets the deadline (20x an iteration's serial work), so a step whose layer sleeps 0.3 s
    per call (6x the scaled floor) waits for it. The same run with `timeout=0.25` fails within that
    deadline, naming the instruction and what it waited for.
    """
    from rpcompile.runtime import transfer
    monkeypatch.setattr(transfer, "DEADLINE_FLOOR_S", 0.05)
    monkeypatch.setitem(NAP, "sleep", 0.0)
    monkeypatch.setitem(NAP, "cpu", 0.1)
    with make(model=napping_llama()) as c:
        assert c.costs.fwd[2] >= 0.1 and c.deadline_s == transfer.plan_deadline(c.costs, c.microbatches)
        assert transfer.DEADLINE_FACTOR * 2 * 0.2 <= c.deadline_s < 60  # from the measured layer, not a floor
        NAP.update(cpu=0.0, sleep=0.3)
        c.step(batch(0))
    NAP.update(cpu=0.0, sleep=0.0)
    with make(model=napping_llama(), timeout=0.25) as c:
        NAP.update(sleep=0.3)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeFailure, match=r"instruction .+ of iteration 0 failed: "
                                                 r"DeadlineExceeded: waited 0.25 s for ") as e:
            c.step(batch(0))
        assert time.perf_counter() - t0 < 5.0
        assert isinstance(e.value.__cause__, TimeoutError) and e.value.__cause__.waited == 0.25
        NAP.update(sleep=0.0)


@pytest.mark.parametrize("kw, name", [  # NaN, inf, negative, huge or a float where an int goes: named, before tracing
    (dict(timeout=math.nan), "timeout"), (dict(timeout=math.inf), "timeout"), (dict(timeout=-1.0), "timeout"),
    (dict(timeout="60"), "timeout"), (dict(memory_budget=math.nan), "memory_budget"),
    (dict(memory_budget=-1), "memory_budget"), (dict(memory_budget=1.5e9), "memory_budget"),
    (dict(microbatches=math.inf), "microbatches"), (dict(microbatches=10**20), "microbatches"),
    (dict(lm_head_shards=math.nan), "lm_head_shards"), (dict(seed=math.nan), "seed"), (dict(seed=1e20), "seed"),
    (dict(loss_scale=math.nan), "loss_scale"), (dict(loss_scale=math.inf), "loss_scale"), (dict(gpus=math.inf), "gpus"),
])
def test_numbers_that_are_not_finite_in_range_or_whole_are_refused_naming_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        make(**kw)


def test_a_timeout_longer_than_a_thread_can_wait_means_no_deadline():
    from rpcompile.options import check_timeout
    from rpcompile.runtime.streams.host import DEADLINE_MAX_S
    with make(timeout=1e10) as c:  # past threading.TIMEOUT_MAX (~9.2e9 s): an OverflowError in the first wait
        assert c.options.timeout == DEADLINE_MAX_S and math.isfinite(c.step(batch(1)))
    assert check_timeout(1e300) == DEADLINE_MAX_S  # rpcompile.load(timeout=) and finetune --timeout: the same
