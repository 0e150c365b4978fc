"""Mixture-of-experts blocks on the meta device: balanced routing instead of data-dependent dispatch.

transformers' default experts implementation (`grouped_mm`: tokens sorted by
expert, one grouped matmul per projection) has no data-dependent op and runs
on meta as it is in bf16; `GROUPED_MM_FLOPS` prices its `_grouped_mm` calls
(2 x rows x inner x outer, whatever the split over experts). The eager
implementation (`experts_implementation="eager"`, `Qwen3MoeExperts`,
`GptOssExperts`, ...) picks the tokens of each expert with `nonzero`/`where`,
which cannot run on `meta`.
For shapes, FLOPs and memory we only need what an average step does: with T
tokens routed to K of E experts each, every expert sees ceil(T*K/E) tokens.
Inside `balanced_experts(model)` such modules run transformers' eager loop
exactly (gather, gate/up projection, the module's own `_apply_gate`, down
projection, routing weight, `index_add_`), one expert after the other, with
that many tokens each; the loop is a `chunk_loop`, folded by cost counting.

    >>> import torch
    >>> with balanced_experts(torch.nn.Linear(2, 2)):  # no experts module: nothing changes
    ...     pass

Routing replay (`Routing`, `routers`). The runtime recomputes a layer's forward
on another worker before its backward; a router whose logits differ there in
the last bit (another GEMM kernel, a tie) would send tokens to other experts
than the forward did. Within a router's forward, `Routing` records the
`(values, indices)` of every `topk` (the forward), or returns the recorded
ones (the recompute): the indices as recorded, the values equal to the
recorded ones and differentiable through the recompute's scores at those
indices, so the router still gets its gradient.

    >>> x = torch.tensor([[1.0, 2.0, 2.0]])
    >>> log = []
    >>> with Routing(record=log):
    ...     _ = torch.topk(x, 1)
    >>> with Routing(replay=log):   # a tie broken the other way would not change it
    ...     torch.topk(torch.tensor([[1.0, 2.0, 2.1]]), 1).indices
    tensor([[1]])
"""
from __future__ import annotations

import contextlib
import functools
import types
from types import MappingProxyType
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rpcompile.passes.meta.regions import chunk_loop

__all__ = ["balanced_experts", "expert_count", "GROUPED_MM_FLOPS", "Routing", "routers"]

_TOPK = (torch.topk, torch.Tensor.topk)


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs)`: every row (or, grouped over K, every column) meets one group."""
    if a.dim() == 2 and b.dim() == 3:  # (M, K) x (G, K, N): each of the M rows uses one group's matrix
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:  # (M, K) x (K, N) grouped along K (weight gradients): (G, M, N) out
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    batch = a.shape[0] if a.dim() == 3 else b.shape[0]  # (G, M, K) x (G, K, N) or mixed
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


# aten overload packet -> FLOP rule, as `meta.attention.FLOP_RULES` (torch's flop_registry has no grouped_mm)
GROUPED_MM_FLOPS = MappingProxyType({torch.ops.aten._grouped_mm: _grouped_mm_flops})


def _is_experts(m: torch.nn.Module) -> bool:
    """True for modules holding stacked expert weights `gate_up_proj` and `down_proj` (E, ., .) that need patching.

    Experts run by transformers' `grouped_mm` implementation in bf16 (its only dtype on meta) have
    no data-dependent op and run on meta as they are; every other experts module is patched.
    """
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter)
            and gu.dim() == 3 and dn.dim() == 3 and gu.shape[0] == dn.shape[0]
            and not (impl == "grouped_mm" and gu.dtype == torch.bfloat16))


def _gate(self: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's own gating (transformers' `_apply_gate`), else SwiGLU on the [gate; up] halves."""
    apply = getattr(self, "_apply_gate", None)
    if apply is not None:
        return apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _balanced_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                      top_k_weights: torch.Tensor | None = None, *args, run: int | None = None,
                      **kwargs) -> torch.Tensor:
    """transformers' eager experts loop with every expert given ceil(T*K/E) tokens (the first n, first choice);
    `run`: only the first `run` experts run (the tokens per expert stay those of all E)."""
    experts, tokens, hidden = self.gate_up_proj.shape[0], hidden_states.shape[0], hidden_states.shape[-1]
    k = top_k_index.shape[-1] if top_k_index is not None else 1
    n = max(1, min(tokens, -(-tokens * k // experts)))
    transposed = getattr(self, "is_transposed", self.gate_up_proj.shape[1] == hidden)  # (E, H, 2I) vs (E, 2I, H)
    gu_bias, down_bias = getattr(self, "gate_up_proj_bias", None), getattr(self, "down_proj_bias", None)
    out = torch.zeros_like(hidden_states)
    idx = torch.arange(n, device=hidden_states.device)
    pos = torch.zeros(n, dtype=torch.long, device=hidden_states.device)
    with chunk_loop() as loop:  # not `loop.over`: autograd records each expert's ops for the backward
        for e in range(experts if run is None else min(run, experts)):
            with loop.iteration():
                x = hidden_states[idx]
                gate_up = x @ self.gate_up_proj[e] if transposed else F.linear(x, self.gate_up_proj[e])
                if gu_bias is not None:
                    gate_up = gate_up + gu_bias[e]
                h = _gate(self, gate_up)
                y = h @ self.down_proj[e] if transposed else F.linear(h, self.down_proj[e])
                if down_bias is not None:
                    y = y + down_bias[e]
                if top_k_weights is not None:
                    y = y * top_k_weights[idx, pos, None]
                out.index_add_(0, idx, y.to(out.dtype))
    return out


@contextlib.contextmanager
def balanced_experts(model: torch.nn.Module, run: int | None = None) -> Iterator[int]:
    """Within the block, every experts module of `model` routes tokens evenly; yields how many were patched.

    `run`: each module runs only its first `run` experts (`passes.cost.experts` extrapolates from such counts).
    """
    patched = [m for m in model.modules() if _is_experts(m)]
    forward = _balanced_forward if run is None else functools.partial(_balanced_forward, run=run)
    for m in patched:
        m.forward = types.MethodType(forward, m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def expert_count(model: torch.nn.Module) -> int:
    """E of the experts modules `balanced_experts` patches in `model` (0: none, or not all with the same E)."""
    counts = {m.gate_up_proj.shape[0] for m in model.modules() if _is_experts(m)}
    return counts.pop() if len(counts) == 1 else 0


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers in `module`: modules with an int `top_k` and no such module inside (transformers'
    `*TopKRouter`, or an older sparse block that routes itself)."""
    found = [m for m in module.modules() if isinstance(getattr(m, "top_k", None), int)]
    return [m for m in found if not any(c is not m and c in found for c in m.modules())]


class Routing(TorchFunctionMode):
    """Records every `topk` of the block (`record=` a list), or replays the recorded ones (`replay=`, in order).

    A replayed topk returns the recorded indices and values; the values carry the gradient of the
    current input gathered at those indices (see the module docstring).
    """

    def __init__(self, record: list | None = None, replay: list | None = None) -> None:
        super().__init__()
        self.record, self.replay = record, replay  # replay: consumed in order (shared by a layer's routers)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        if self.replay is None:
            out = func(*args, **kwargs)
            self.record.append((out.values.detach(), out.indices))
            return out
        if not self.replay:
            raise RuntimeError("routing replay: the recompute ran more topk calls than the forward recorded")
        values, indices = self.replay.pop(0)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        got = args[0].gather(dim, indices)
        return torch.return_types.topk((values + (got - got.detach()), indices))
