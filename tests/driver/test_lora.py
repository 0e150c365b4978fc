"""Frozen parameters (issue 6): a LoRA-adapted model whose base is frozen.

Frozen parameters (`requires_grad=False`) are uploaded with their layer but get
no gradient, no fp32 master and no optimizer state; training matches an eager
PyTorch loop that optimizes only the trainable (adapter) parameters.
"""
import copy

import pytest
import torch
from torch import nn

import rpcompile
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from oracle import reference_train

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)
OPT = rpcompile.AdamW(lr=1e-2, impl="foreach")
MICROBATCHES = 2


class LoRALinear(nn.Module):
    """Frozen base Linear plus a trainable low-rank update (alpha / r) * B A."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)  # nonzero: A gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def lora_model(seed: int = 0) -> TinyLlama:
    """TinyLlama with every base parameter frozen and LoRA on each block's q and kv projections."""
    model = TinyLlama(CFG, seed=seed).requires_grad_(False)
    torch.manual_seed(seed)
    for block in model.layers:
        block.q, block.kv = LoRALinear(block.q), LoRALinear(block.kv)
    return model


def batch(seed: int, b: int = 4, t: int = 16) -> dict[str, torch.Tensor]:
    """A random token batch."""
    ids = torch.randint(0, CFG.vocab, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def mean_microbatch_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The runtime's loss: the mean of the microbatch losses (contiguous slices along dim 0)."""
    parts = zip(*(v.chunk(MICROBATCHES) for v in b.values()))
    return sum(model(*p) for p in parts) / MICROBATCHES


def compiled(model: nn.Module, staleness: int) -> rpcompile.Compiled:
    """The model compiled for 2 host workers with a budget small enough to force a pipeline."""
    return rpcompile.compile(model, gpus=2, example=batch(0), microbatches=MICROBATCHES, staleness=staleness,
                             optimizer=OPT, memory_budget=2**20, backend="host")


def named(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached clones of the parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_frozen_base_staleness0_matches_eager_adapter_training():
    model = lora_model()
    start = named(model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)

    # eager: torch.optim.AdamW over the adapters only, loss = mean of the microbatch losses
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=OPT.lr, betas=OPT.betas,
                            eps=OPT.eps, weight_decay=OPT.weight_decay)
    want = []
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        loss = mean_microbatch_loss(eager, batch(i))
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert all(p.grad is None for p in eager.parameters() if not p.requires_grad)

    with compiled(model, staleness=0) as c:
        # frozen parameters are uploaded (compute copies), but only adapters get master/grad/optimizer state
        assert set(c.state.compute) == set(start)
        assert set(c.state.master) == adapters
        assert set(c.state.grad) == adapters
        assert {n for g in c.state.groups for n in g} == adapters
        got = [c.step(batch(i)) for i in range(3)]
        sd = c.state.state_dict()
        assert set(sd["optim"]) == adapters
        assert set(sd["master"]) == adapters
        end = named(c.model())
        compute = {n: t.clone() for n, t in c.state.compute.items()}

    assert got == pytest.approx(want, abs=1e-5, rel=1e-5)
    ref = named(eager)
    for n in adapters:
        assert not torch.equal(end[n], start[n]), f"adapter {n} did not train"
        torch.testing.assert_close(end[n], ref[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    for n in set(start) - adapters:
        assert torch.equal(end[n], start[n]), f"frozen {n} changed"
        assert torch.equal(compute[n], start[n]), f"frozen {n}: compute copy changed"


def test_frozen_base_staleness1_matches_oracle():
    model = lora_model(seed=1)
    start = named(model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    batches = [batch(i) for i in range(3)]
    want, ref = reference_train(model, batches, optimizer=OPT, staleness=1, loss_fn=mean_microbatch_loss)
    with compiled(model, staleness=1) as c:
        got = [c.step(b) for b in batches]
        assert set(c.state.master) == adapters
        end = named(c.model())
    assert got == pytest.approx(want, abs=1e-5, rel=1e-5)
    for n in start:
        if n in adapters:
            torch.testing.assert_close(end[n], ref[n], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(end[n], start[n]), f"frozen {n} changed"


def test_frozen_groups_with_global_clipping_match_the_oracle():
    """Clipping needs every group's gradient; groups with nothing to train (a frozen head, frozen norms)
    step too. Their steps must not declare the next iteration's gradients complete early (an R4 failure
    once the plan had several stages)."""
    opt = rpcompile.AdamW(lr=1e-2, impl="foreach", max_grad_norm=0.5)
    model = lora_model(seed=2)
    batches = [batch(i) for i in range(4)]
    want, ref = reference_train(model, batches, optimizer=opt, staleness=1, loss_fn=mean_microbatch_loss)
    with rpcompile.compile(model, gpus=2, example=batch(0), microbatches=MICROBATCHES, staleness=1,
                           optimizer=opt, memory_budget=262144, backend="host") as c:
        assert c.plan.num_stages > 3
        got = [c.step(b) for b in batches]
        end = named(c.model())
    assert got == pytest.approx(want, abs=1e-5, rel=1e-5)
    for n, v in ref.items():
        torch.testing.assert_close(end[n], v, atol=1e-5, rtol=1e-5)


def test_fully_frozen_model_is_refused():
    model = lora_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        compiled(model, staleness=1)
