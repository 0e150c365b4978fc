"""`rpcompile.compile(model, gpus=...)` without `example=`: the handle plans at its first step or evaluate.

What it plans is what `compile(..., example=batch)` plans (the same passes on the same batch), so the
run is the same bit for bit; until then, what only a plan has says so in one line, and every argument
is checked at `compile()`, before any batch.
"""
from __future__ import annotations

import threading

import pytest
import torch

import models  # noqa: E402 - tests/ is on sys.path (pytest rootdir)
import rpcompile
import rpcompile.api
from rpcompile.models.zoo import TinyLlama
from tests.driver.test_api import CFG, batch

_MLP, _xy = models.LossMLP, models.xy
NOT_PLANNED = r"^nothing is planned yet: compile\(model, gpus=2\) without example= plans at the first step\(batch\)"


def _llama(**kw):
    """TinyLlama compiled as tests/driver/test_api.py's `make` does, `example=` only where given."""
    opts = dict(gpus=2, microbatches=2, optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"), memory_budget=2**20,
                backend="host")
    return rpcompile.compile(TinyLlama(CFG), **{**opts, **kw})


def _mlp(**kw):
    return rpcompile.compile(_MLP(), gpus=2, microbatches=2, backend="host",
                             optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"), **kw)


def _weights(c) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in c.model().named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_compile_without_example_plans_at_the_first_step_what_compile_with_it_plans():
    b = batch(0)
    runs = []
    for lazy in (True, False):
        with _llama(**({} if lazy else {"example": b})) as c:  # staleness 1, the default
            losses = [c.step(batch(k)) for k in range(4)]
            runs.append((c.plan.to_str(), str(c.program), c.microbatches, losses, _weights(c)))
    (plan, program, m, losses, weights), want = runs
    assert (plan, program, m, losses) == want[:4]
    assert _same(weights, want[4])


def test_evaluate_as_the_first_call_plans_too():
    got = []
    for kw in ({}, {"example": _xy(0)}):
        with _mlp(**kw) as c:
            got.append((c.evaluate(_xy(0)), c.plan.to_str(), c.step(_xy(1)), _weights(c)))
    assert got[0][:3] == got[1][:3] and _same(got[0][3], got[1][3])


def test_set_lr_before_the_first_step_is_the_lr_of_the_first_update():
    got = []
    for kw in ({}, {"example": _xy(0)}):
        with _mlp(**kw) as c:
            c.set_lr(0.5)
            got.append(([c.step(_xy(k)) for k in range(3)], _weights(c)))
    assert got[0][0] == got[1][0] and _same(got[0][1], got[1][1])
    with _mlp() as c:  # the lr reached the updates: another lr gives other weights
        c.set_lr(1e-4)
        for k in range(3):
            c.step(_xy(k))
        assert not _same(_weights(c), got[0][1])


def _a_state_dict() -> dict:
    with _mlp(example=_xy(0)) as c:
        c.step(_xy(0))
        return c.state_dict()


@pytest.mark.parametrize("what", ["graph", "costs", "plan", "program", "microbatches", "state", "rank",
                                  "world_size", "deadline_s", "last_timeline", "simulate", "stats", "state_dict",
                                  "save", "load_state_dict"])
def test_before_the_first_step_what_needs_the_plan_says_so_in_one_line(what, tmp_path):
    calls = {"simulate": lambda c: c.simulate(), "stats": lambda c: c.stats(),
             "state_dict": lambda c: c.state_dict(), "save": lambda c: c.save(str(tmp_path / "run.ckpt")),
             "load_state_dict": lambda c: c.load_state_dict(_a_state_dict())}
    with _mlp() as c:
        with pytest.raises(RuntimeError, match=NOT_PLANNED) as err:
            calls[what](c) if what in calls else getattr(c, what)
        assert "\n" not in str(err.value)
        assert list(tmp_path.iterdir()) == []  # a refused save writes nothing
        c.step(_xy(0))  # the refusal changed nothing: the first step plans
        assert c.steps == 1 and c.plan.to_str()


def test_before_the_first_step_what_needs_no_plan_answers_for_zero_steps():
    model = _MLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with rpcompile.compile(model, gpus=2, microbatches=2, backend="host", timeout=30) as c:
        assert c.steps == 0 and c.skipped_steps == [] and c.deadline_s == 30.0
        assert c.model() is model and _same(_weights(c), before)  # the module as given: nothing trained
        assert c.flush() is None
        assert repr(c).startswith("Compiled(not planned yet")


@pytest.mark.parametrize("kw,name", [
    (dict(gpus=0), "gpus"), (dict(dtype=torch.int64), "dtype"), (dict(staleness=2), "staleness"),
    (dict(optimizer=torch.optim.SGD), "optimizer"), (dict(timeout=-1), "timeout"),
    (dict(optimizer=rpcompile.AdamW(decay={"no.such.weight"})), "no.such.weight"),
    (dict(layers=["blocks.9"]), "'blocks.9' matches no module"), (dict(layers="blocks.*"), "layers must be a list"),
])
def test_bad_arguments_are_refused_at_compile_before_any_batch(kw, name):
    with pytest.raises(ValueError, match=name):
        rpcompile.compile(_MLP(), **{"gpus": 2, "backend": "host", **kw})


def test_a_meta_model_is_refused_at_compile_before_any_batch():
    with torch.device("meta"):
        meta = _MLP()
    with pytest.raises(ValueError, match="meta device"):
        rpcompile.compile(meta, gpus=2, backend="host")


def test_a_first_batch_that_cannot_be_planned_leaves_the_handle_waiting_for_one():
    with _mlp() as c:
        x, y = _xy(0)
        with pytest.raises(ValueError, match="not divisible by 2"):
            c.step((x[:3], y[:3]))
        with pytest.raises(RuntimeError, match=NOT_PLANNED):
            c.plan
        assert c.steps == 0
        c.step((x, y))
        assert c.steps == 1


def _rpcompile_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("rpcompile")}


def test_close_before_the_first_step_is_clean():
    before = _rpcompile_threads()
    c = _mlp()
    c.close()
    c.close()
    assert _rpcompile_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        c.step(_xy(0))


def test_two_threads_stepping_before_the_plan_plan_once(monkeypatch):
    plans = []
    real = rpcompile.api.compile_passes
    monkeypatch.setattr(rpcompile.api, "compile_passes", lambda *a, **k: plans.append(1) or real(*a, **k))
    start, errors = threading.Barrier(2), []

    def one_step(c) -> None:
        try:
            start.wait(10)
            c.step(_xy(0))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    with _mlp() as c:
        threads = [threading.Thread(target=one_step, args=(c,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(plans) == 1 and c.steps == 2


def test_a_lazily_planned_run_saves_and_loads_bit_for_bit(tmp_path):
    path = str(tmp_path / "run.ckpt")
    with _mlp() as c:
        c.step(_xy(0))
        c.save(path)
        want = [c.step(_xy(k)) for k in (1, 2)], _weights(c)
    with rpcompile.load(path, _MLP()) as d:
        got = [d.step(_xy(k)) for k in (1, 2)], _weights(d)
    assert got[0] == want[0] and _same(got[1], want[1])
