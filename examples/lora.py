"""LoRA fine-tuning on a frozen base model with rpcompile.

Shows how rpcompile treats frozen parameters (`requires_grad=False`): they are
uploaded to the workers with their layer but get no gradient, no fp32 master
and no optimizer state on the host. Only the low-rank adapters train, so the
host-side training state shrinks to the adapters' size.

Steps: build a tiny LlamaForCausalLM (transformers, random weights), freeze every
base parameter, wrap the attention q/v projections in `LoRALinear` (frozen base
Linear + trainable A/B, scaled by alpha / r), compile, train a few steps, then
check that the base weights are bit-identical while the adapters moved, and
compare the host optimizer state with what full fine-tuning would hold.

Run (~15 s):

    python examples/lora.py
    python examples/lora.py --steps 20 --rank 8 --alpha 16
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import rpcompile
from rpcompile.models.demo import DemoConfig, batches, corpus


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * x A^T B^T, with `base` frozen and A (r x in), B (out x r) trainable.

    B starts at zero, so the wrapped model computes exactly what the base did.
    """

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> int:
    """Freeze every parameter of `model`, then wrap each Linear named in `targets`; returns the count wrapped."""
    model.requires_grad_(False)
    wrapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                wrapped += 1
    return wrapped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (small defaults, so the script runs in seconds on a CPU)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="training iterations")
    p.add_argument("--gpus", type=int, default=2, help="workers (GPUs; host threads without CUDA)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration")
    p.add_argument("--batch", type=int, default=8, help="sequences per iteration")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--rank", type=int, default=4, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=8.0, help="LoRA scale numerator (scale = alpha / r)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--memory-mib", type=float, default=2.0, help="device budget per worker")
    return p.parse_args(argv)


def tiny_llama(args: argparse.Namespace) -> nn.Module:
    """A LlamaForCausalLM with a small config and random weights (stands in for a pretrained base)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def nbytes(tensors) -> int:
    """Total bytes of an iterable of tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv: list[str] | None = None) -> None:
    """Freeze, adapt, compile, train, and check what moved."""
    args = parse_args(argv)
    model = tiny_llama(args)
    wrapped = add_lora(model, args.rank, args.alpha)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    print(f"{wrapped} projections wrapped: {n_train:,} trainable of {total:,} parameters "
          f"({n_train / total:.2%})")

    stream = batches(corpus(), DemoConfig(batch=args.batch, seq=args.seq, seed=0))
    c = rpcompile.compile(model, gpus=args.gpus, example=next(stream), microbatches=args.microbatches,
                          optimizer=rpcompile.AdamW(lr=args.lr, weight_decay=0.0),
                          memory_budget=int(args.memory_mib * 2**20))
    print(c.plan, end="\n\n")
    with c:
        for _ in range(args.steps):
            loss = c.step(next(stream))
            print(f"step {c.steps:3d}  loss {loss:.4f}", flush=True)
        # Host state: every parameter has a compute copy; only the adapters have master, grad, AdamW moments.
        host = c.state.state_dict()
        assert set(c.state.master) == trainable, sorted(set(c.state.master) ^ trainable)
        state_bytes = (nbytes(c.state.master.values()) + nbytes(c.state.grad.values())
                       + nbytes(t for s in host["optim"].values() for t in s.values() if t.dim() > 0))
        compute_bytes = nbytes(c.state.compute.values())
        end = {n: p.detach().clone() for n, p in c.model().named_parameters()}

    base_same = all(torch.equal(end[n], start[n]) for n in start if n not in trainable)
    moved = sum(not torch.equal(end[n], start[n]) for n in trainable)
    print(f"\nbase weights unchanged (bit for bit): {base_same}; adapters changed: {moved}/{len(trainable)}")
    full = 16 * total  # fp32 master + fp32 grad + two fp32 AdamW moments per parameter
    print(f"host optimizer state (masters + grads + AdamW moments): {state_bytes / 2**10:,.1f} KiB "
          f"vs {full / 2**10:,.1f} KiB for full fine-tuning ({full / state_bytes:.0f}x smaller); "
          f"compute copies {compute_bytes / 2**10:,.1f} KiB either way")
    if not base_same or moved != len(trainable):
        raise SystemExit("LoRA check failed")


if __name__ == "__main__":
    main()
