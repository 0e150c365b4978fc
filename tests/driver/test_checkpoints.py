"""Checkpoints of a compiled run: save and load, a fresh process resuming bit for bit (even when its measurements
differ), truncated or corrupt files refused, the global RNG restored, and checkpoints of older versions loaded."""
import dataclasses
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import models
import rpcompile
from rpcompile.models.zoo import TinyLlama
from paths import ROOT  # noqa: E402 - tests/ is on sys.path (tests/conftest.py)
from tests.driver.test_api import CFG, batch, make, params


def _saved_at_3_trained_to_6(tmp_path, staleness):
    """A run saved after step 3 and trained on to step 6: (checkpoint path, weights at 6, a path for the resumed)."""
    ref = make(staleness)
    for i in range(3):
        ref.step(batch(i))
    path = str(tmp_path / "ckpt.rp")
    ref.save(path)
    for i in range(3, 6):
        ref.step(batch(i))
    want = params(ref)
    ref.close()
    return path, want, str(tmp_path / "resumed.pt")


@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path, staleness):
    path, want, out = _saved_at_3_trained_to_6(tmp_path, staleness)
    script = textwrap.dedent(f"""
        import sys, torch, rpcompile
        sys.path.insert(0, "tests")  # the helpers test_api imports
        from rpcompile.models.zoo import LlamaConfig, TinyLlama
        from tests.driver.test_api import CFG, batch, params
        c = rpcompile.load({path!r}, TinyLlama(CFG, seed=123))
        assert c.steps == 3, c.steps
        for i in range(3, 6):
            c.step(batch(i))
        torch.save(params(c), {out!r})
        c.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
    got = torch.load(out)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_truncated_checkpoint_is_detected_and_the_previous_file_survives(tmp_path):
    path = str(tmp_path / "ckpt.rp")
    with make() as c:
        c.step(batch(0))
        c.save(path)
        good = open(path, "rb").read()
        with open(path + ".part", "wb") as f:
            f.write(good[: len(good) // 2])
        with pytest.raises(ValueError, match="truncated"):
            rpcompile.checkpoint.load(path + ".part")
        real_replace = os.replace

        def crash(src, dst):  # the process dies between writing the temp file and the rename
            raise KeyboardInterrupt

        os.replace = crash
        try:
            with pytest.raises(KeyboardInterrupt):
                c.step(batch(1))
                c.save(path)
        finally:
            os.replace = real_replace
        assert open(path, "rb").read() == good
        assert [f for f in os.listdir(tmp_path) if ".tmp-" in f] == []


def test_a_checkpoint_with_one_flipped_payload_byte_is_refused(tmp_path):
    """The right length, one bit of a weight changed: only the SHA-256 can tell, and load must check it."""
    path = str(tmp_path / "ckpt.rp")
    with make() as c:
        c.step(batch(0))
        c.save(path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # in the middle of the payload: tensor bytes
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match=f"checkpoint {path!r} is corrupt: its SHA-256 does not match"):
        rpcompile.checkpoint.load(path)
    with pytest.raises(ValueError, match="is corrupt"):
        rpcompile.load(path, TinyLlama(CFG))


# -- the global RNG state in a checkpoint ------------------------------------------------------------------
class _RngMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks(x), y)


def _rng_compile():
    return rpcompile.compile(_RngMLP(), gpus=2, example=models.xy(0), microbatches=2, backend="host",
                             optimizer=rpcompile.SGD(lr=1e-2, impl="foreach"))


def test_load_state_dict_restores_the_global_rng():
    with _rng_compile() as c:
        c.step(models.xy(0))
        torch.manual_seed(1234)
        sd = c.state_dict()
        saved = torch.get_rng_state()
        assert torch.equal(sd["rng"], saved)
        expect = torch.rand(5)  # what the saved state draws next; the global RNG has moved on
        assert not torch.equal(torch.get_rng_state(), saved)
        c.step(models.xy(1))
        c.load_state_dict(sd)
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(5), expect)


def test_rpcompile_load_restores_the_global_rng(tmp_path):
    path = str(tmp_path / "run.ckpt")
    with _rng_compile() as c:
        c.step(models.xy(0))
        torch.manual_seed(4321)
        saved = torch.get_rng_state()
        c.save(path)
        assert torch.equal(torch.get_rng_state(), saved)  # saving draws nothing
        expect = torch.rand(5)
    model = _RngMLP()  # (seeds the global RNG itself)
    torch.rand(100)  # move the global RNG away from the saved state
    with rpcompile.load(path, model) as d:
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(5), expect)
        assert d.steps == 1


def test_a_checkpoint_whose_hardware_was_pickled_before_kind_existed_loads(tmp_path, monkeypatch):
    # Checkpoints hold the compile options; one written before issue 33 holds a Hardware without `kind`.
    hw = rpcompile.Hardware.preset("cpu")
    path = str(tmp_path / "old.ckpt")
    with make(hardware=hw) as c:
        c.step(batch(1))
        with monkeypatch.context() as m:  # pickle the Hardware as the version before `kind` did
            m.setattr(rpcompile.Hardware, "__getstate__",
                      lambda self: [getattr(self, f.name) for f in dataclasses.fields(self)][:-1])
            c.save(path)
    with rpcompile.load(path, TinyLlama(CFG)) as d:
        assert d.options.hardware == hw and d.options.hardware.kind == "cpu"
        assert d.steps == 1 and math.isfinite(d.step(batch(2)))


# -- exact resume: a checkpoint rebuilds its own plan, nothing is re-measured ---------------------------------
@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_with_perturbed_measurements_is_bit_identical(tmp_path, staleness):
    """Save at step 3; load in a fresh process whose every measured time is multiplied by U(0.5, 2) noise
    (and whose plans would differ): steps 4-6 are bit-identical to the uninterrupted run."""
    path, want, out = _saved_at_3_trained_to_6(tmp_path, staleness)
    script = textwrap.dedent(f"""
        import random, dataclasses, sys, torch, rpcompile
        sys.path.insert(0, "tests")  # the helpers test_api imports
        import rpcompile.passes as P, rpcompile.passes.cost as C
        from rpcompile.models.zoo import TinyLlama
        from tests.driver.test_api import CFG, batch
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
            c.step(batch(i))
        torch.save({{n: p.detach().clone() for n, p in c.model().named_parameters()}}, {out!r})
        c.close()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
    got = torch.load(out)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
