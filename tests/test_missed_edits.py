"""Issue 23 item 8: tests for five realistic one-line edits the rest of the suite missed or caught by chance.

Each test names the edit it exists for; each was run against a copy of the package with that edit
applied and failed there (see the issue's closing note):
  a. verify no longer checks the previous iteration's release (``_release``: ``if k < 0: continue``);
  b. the commit check ignores the gradient flags (``HostLanes._check_finite`` reads only the losses);
  c. ``Compiled.load_state_dict`` no longer restores the global RNG (``torch.set_rng_state`` dropped);
  d. ``StagePlan.stage_memory`` counts the saved activations of an FB/B stage twice;
  e. the clip coefficient loses its upper bound of 1 (``torch.clamp(..., max=1.0)`` dropped).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from oracle import eager_optimizer
from torch import nn

import rpcompile
from rpcompile import CostTable, ProgramError, StagePlan
from rpcompile.passes import emit, verify
from rpcompile.runtime.host.optimizer import HostState


# -- a. verify: a release dependency on the previous iteration ------------------------------------------------
def _drop(p, name: str, dep: str):
    """p with the dependency `dep` of instruction `name` removed (asserting it was a previous-iteration one)."""
    out = []
    for i in p.instrs:
        if i.name == name:
            (ref,) = [d for d in i.deps if d.name == dep]
            assert ref.back == 1, f"{name} <- {ref} is not a previous-iteration dependency"
            i = replace(i, deps=tuple(d for d in i.deps if d.name != dep))
        out.append(i)
    return replace(p, instrs=tuple(out))


@pytest.mark.parametrize("staleness", [0, 1])
def test_verify_rejects_a_removed_previous_iteration_release(staleness):
    # 5 stages on 2 workers: slot 1's upload w1 P1.r0.c0 reuses the buffer of slot 1 - 2N = -3, i.e. the
    # previous iteration's slot 7 (w1 E2.r1), reached only through a Ref with back=1
    p = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=4, staleness=staleness)
    assert verify(p) is p
    for name, dep in (("w1 P1.r0.c0", "w1 E2.r1"), ("w0 P2.r0.c0", "w0 E3.r1"), ("w1 P3.r0.c0", "w1 E4.r1")):
        with pytest.raises(ProgramError) as e:
            verify(_drop(p, name, dep))
        assert e.value.rule == "RELEASE" and e.value.instr == name and "iteration t)" in str(e.value)


def test_verify_rejects_a_program_without_any_previous_iteration_release():
    p = emit(StagePlan.from_str("2,1|1|1,2"), gpus=2, microbatches=8, round_size=4, staleness=1)
    cross = tuple(replace(i, deps=tuple(d for d in i.deps if not (d.back and " E" in d.name)))
                  if i.op.name == "PARAM_UP" else i for i in p.instrs)
    assert cross != p.instrs
    with pytest.raises(ProgramError) as e:
        verify(replace(p, instrs=cross))
    assert e.value.rule == "RELEASE"


# -- b. a NaN gradient under a finite loss -------------------------------------------------------------------
class _Gate(nn.Module):
    """Linear + ReLU plus a term that is 0 where x[:, 0] == 0 but whose gradient there is 0 * inf = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h, s = self.lin(x), x[:, :1]
        return torch.relu(h) + torch.sqrt(torch.abs(h * s)) * s


class _NanGradMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(_Gate(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks(x), y)


def _xy(seed: int, nan_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    if nan_grad:
        x[1, 0] = 0.0  # the loss stays finite, the gradient of blocks.0.lin is NaN
    return x, y


def test_the_nan_grad_batch_has_a_finite_loss_and_a_nan_gradient():
    m = _NanGradMLP()
    loss = m(*_xy(2, nan_grad=True))
    loss.backward()
    assert torch.isfinite(loss) and torch.isnan(m.blocks[0].lin.weight.grad).any()


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_nan_gradient_under_a_finite_loss_raises_and_keeps_the_weights(staleness):
    with rpcompile.compile(_NanGradMLP(), gpus=2, example=_xy(0), microbatches=2, staleness=staleness,
                           backend="host", optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach")) as c:
        c.step(_xy(0)), c.step(_xy(1))
        good = c.state_dict()["host"]  # flushed: the last good step applied
        with pytest.raises(FloatingPointError, match=r"step 2 .*non-finite gradient.*layer group 0"):
            loss = c.step(_xy(2, nan_grad=True))  # the loss is finite: the commit check raises from the next call
            assert loss == loss and abs(loss) != float("inf")
            c.model()
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        for n, st in good["optim"].items():
            assert all(torch.equal(now["optim"][n][k], v) for k, v in st.items()), n
        assert c.steps == 2
        c.step(_xy(2))  # a good batch trains on
        assert all(torch.isfinite(p).all() for p in c.model().parameters())


# -- c. the global RNG state in a checkpoint ------------------------------------------------------------------
class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks(x), y)


def _rng_compile():
    return rpcompile.compile(_MLP(), gpus=2, example=_xy(0), microbatches=2, backend="host",
                             optimizer=rpcompile.SGD(lr=1e-2, impl="foreach"))


def test_load_state_dict_restores_the_global_rng():
    with _rng_compile() as c:
        c.step(_xy(0))
        torch.manual_seed(1234)
        sd = c.state_dict()
        saved = torch.get_rng_state()
        assert torch.equal(sd["rng"], saved)
        expect = torch.rand(5)  # what the saved state draws next; the global RNG has moved on
        assert not torch.equal(torch.get_rng_state(), saved)
        c.step(_xy(1))
        c.load_state_dict(sd)
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(5), expect)


def test_rpcompile_load_restores_the_global_rng(tmp_path):
    path = str(tmp_path / "run.ckpt")
    with _rng_compile() as c:
        c.step(_xy(0))
        torch.manual_seed(4321)
        saved = torch.get_rng_state()
        c.save(path)
        assert torch.equal(torch.get_rng_state(), saved)  # saving draws nothing
        expect = torch.rand(5)
    model = _MLP()  # (seeds the global RNG itself)
    torch.rand(100)  # move the global RNG away from the saved state
    with rpcompile.load(path, model) as d:
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(5), expect)
        assert d.steps == 1


# -- d. stage_memory, term by term --------------------------------------------------------------------------
# distinct values per layer and column (primes), so a term counted twice or in the wrong place shows
P, G, A, SV, PK = ([11, 13, 17, 19, 101], [23, 29, 31, 37, 103], [41, 43, 47, 53, 107], [59, 61, 67, 71, 109],
                   [73, 79, 83, 89, 113])
COLUMNS = {"param_bytes": P, "grad_bytes": G, "act_bytes": A, "saved_bytes": SV, "peak_bytes": PK}

# The documented model (StagePlan.stage_memory's Note), counted by hand: per plan, the number of layers,
# each stage's own parameters and every other column's bytes per stage (slot order).
HAND = {
    # s0 F[0], s1 F[1,2], s2 FB[3], s3 B[2], s4 B[0,1]; the backward cut at layer 2 lies inside s1
    "1,2|1|1,2": (4, [P[0], P[1] + P[2], P[3], P[2], P[0] + P[1]], {
        "grad_bytes": [0, 0, G[3], G[2], G[0] + G[1]],  # FB/B only
        "peak_bytes": [0, 0, PK[3], PK[2], PK[0] + PK[1]],  # FB/B only: the whole stage's workspace
        # s0: the batch (current + next); s1: the saved input of the cut at 2; s3, s4: their saved inputs
        "saved_bytes": [2 * SV[0], SV[2], 0, 2 * SV[2], 2 * SV[0]],
        # s0 output; s1 2 inputs + output; s2 2 inputs + output + outgoing gradient;
        # s3 output + outgoing + incoming gradient; s4 output + incoming gradient (none leaves layer 0)
        "act_bytes": [A[0], 2 * A[0] + A[2], 2 * A[2] + A[3] + A[2], A[2] + A[1] + A[2], A[1] + A[1]],
    }),
    # s0 F[0,1], s1 F[2,3], s2 FB[4], s3 B[2,3], s4 B[0,1]; s1 starts at the cut: its input is the
    # activation a1, it holds no saved input of its own
    "2,2|1|2,2": (5, [P[0] + P[1], P[2] + P[3], P[4], P[2] + P[3], P[0] + P[1]], {
        "grad_bytes": [0, 0, G[4], G[2] + G[3], G[0] + G[1]],
        "peak_bytes": [0, 0, PK[4], PK[2] + PK[3], PK[0] + PK[1]],
        "saved_bytes": [2 * SV[0], 0, 0, 2 * SV[2], 2 * SV[0]],
        "act_bytes": [A[1], 2 * A[1] + A[3], 2 * A[3] + A[4] + A[3], A[3] + A[1] + A[3], A[1] + A[1]],
    }),
}


def _table(n: int, only: str | None = None) -> CostTable:
    cols = {k: (v[:n] if only in (None, k) else [0] * n) for k, v in COLUMNS.items()}
    return CostTable.from_lists(fwd=[1.0] * n, bwd=[2.0] * n, **cols)


@pytest.mark.parametrize("gpus", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("plan_str", list(HAND))
def test_stage_memory_term_by_term(plan_str, gpus):
    plan = StagePlan.from_str(plan_str)
    assert [s.kind.value for s in plan.stages] == ["F", "F", "FB", "B", "B"]
    n, own, cols = HAND[plan_str]
    if gpus is None:  # a bound: the largest other stage's parameters
        nxt = [max(o for j, o in enumerate(own) if j != i) for i in range(5)]
    else:  # the stage N slots later in the rotation, prefetched
        nxt = [own[(i + gpus) % 5] for i in range(5)]
    hand = {"param_bytes": [own[i] + nxt[i] for i in range(5)], **cols}
    for column, want in hand.items():
        assert list(plan.stage_memory(_table(n, column), gpus=gpus)) == want, column
    total = [sum(col[i] for col in hand.values()) for i in range(5)]
    assert list(plan.stage_memory(_table(n), gpus=gpus)) == total


def test_stage_memory_single_fused_stage_by_hand():
    c = CostTable.from_lists(fwd=[1.0] * 2, bwd=[1.0] * 2, param_bytes=[3, 5], grad_bytes=[7, 11],
                             act_bytes=[13, 17], saved_bytes=[19, 23], peak_bytes=[29, 31])
    # FB[0,1]: params 3+5, prefetched itself (one stage) 3+5, batch 2*19, output 17, grads 7+11, peaks 29+31
    assert StagePlan.from_str("|2|").stage_memory(c, gpus=1) == (8 + 8 + 2 * 19 + 17 + 18 + 60,)


# -- e. clipping with a global norm below the limit ------------------------------------------------------------
def _flat(cfg):
    torch.manual_seed(3)
    params = {f"p{i}": nn.Parameter(torch.randn(4 + i, 3)) for i in range(3)}
    state = HostState(params, {f"p{i}": (i,) for i in range(3)}, 3, optimizer=cfg)
    return state, {k: nn.Parameter(v.detach().clone()) for k, v in params.items()}


def _grads(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    raw = {f"p{i}": torch.randn(4 + i, 3, generator=g) for i in range(3)}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in raw.values()]))
    return {k: v * (scale / norm) for k, v in raw.items()}  # global norm ~= scale


@pytest.mark.parametrize("norm,limit", [(0.5, 1.0), (0.999, 1.0), (1e-3, 10.0), (3.0, 1.0)])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_clipping_leaves_gradients_below_the_limit_unchanged(norm, limit, opt):
    cfg = (rpcompile.SGD(lr=0.1, max_grad_norm=limit, impl="foreach") if opt == "sgd"
           else rpcompile.AdamW(lr=0.1, weight_decay=0.0, max_grad_norm=limit, impl="foreach"))
    state, eager = _flat(cfg)
    before = {k: v.detach().clone() for k, v in eager.items()}
    grads = _grads(norm)
    ref_opt = eager_optimizer(cfg, eager.values())
    for k, p in eager.items():
        p.grad = grads[k].clone()
        state.accumulate_grad(k, grads[k])
    for l in (2, 1, 0):
        state.grads_complete(l)
    total = torch.nn.utils.clip_grad_norm_(eager.values(), limit)
    assert torch.equal(state.global_norm(), total)
    if total < limit:  # torch leaves them as they are (its coefficient is clamped to 1)
        assert all(torch.equal(p.grad, grads[k]) for k, p in eager.items())
    ref_opt.step()
    for l in (2, 1, 0):
        state.step(l)
    assert all(torch.equal(state.master[k], p) for k, p in eager.items())
    if opt == "sgd" and total < limit:  # the update is -lr * g with g unchanged (up to the kernel's rounding)
        for k in eager:
            torch.testing.assert_close(state.master[k], before[k] - 0.1 * grads[k], rtol=1e-6, atol=1e-7)
