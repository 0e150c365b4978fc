"""Running layers on one worker: `LayerRunner` runs a stage's layers forward, recomputes them and runs the
backward, with parameters given by name.

Randomness is seeded per (iteration, microbatch, layer) on the worker's own generator (`stage/rng.py`), so that
a B stage's recompute reproduces the dropout masks of the F stage that ran the same layer earlier. MoE routing
is recorded by the F stage and replayed by the recompute (`stage/routing.py`); evaluation runs the layers in
eval mode and counts the loss layer's right predictions (`stage/hits.py`).

Note:
    `torch.func.functional_call` swaps a module's parameters in place while it
    runs, so two threads may not call it on one module. Each worker gets its own
    copies of the layer modules, built without copying a parameter (they stay
    on the meta device and are never used); buffers move to the worker's device.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from rpcompile.ir.graph import LayerGraph
from rpcompile.passes.meta.moe import Routing, routers
from rpcompile.runtime.stage.hits import HITS, CountHits
from rpcompile.runtime.stage.routing import RoutingLog
from rpcompile.runtime.stage.rng import WorkerRandom, layer_seed

__all__ = ["LayerRunner", "tracked_buffers", "has_random_ops", "random_layers"]


_RANDOM_FNS = ("dropout", "bernoulli", "rand", "randn", "randint", "randperm", "multinomial", "normal")


def tracked_buffers(graph: LayerGraph) -> dict[int, dict[str, torch.Tensor]]:
    """Layer -> the buffers its forward updates in training: running statistics of BatchNorm-style norms.

    These are training state (saved, resumed, copied back by `Compiled.model()`); every other
    buffer (rotary tables, masks) is a constant of the layer.
    """
    out: dict[int, dict[str, torch.Tensor]] = {}
    for lay in graph.layers:
        if not isinstance(getattr(lay, "module", None), torch.nn.Module):
            continue  # a stand-in graph without modules (tests of the optimizer alone)
        named = dict(lay.module.named_buffers())
        tracked = {}
        for prefix, m in lay.module.named_modules():
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
                for k in ("running_mean", "running_var", "num_batches_tracked"):
                    name = f"{prefix}.{k}" if prefix else k
                    if named.get(name) is not None:
                        tracked[name] = named[name]
        if tracked:
            out[lay.index] = tracked
    return out


def has_random_ops(graph: LayerGraph) -> bool:
    """True if a layer may draw random numbers (dropout p > 0, attention dropout, rand* in glue)."""
    return bool(random_layers(graph))


def random_layers(graph: LayerGraph) -> frozenset[int]:
    """The layers that may draw random numbers: only they run under `WorkerRandom`.

    The dispatch mode sends every aten op of a layer through Python, so a layer
    with no random op (an LM-head shard, a norm, a block without dropout) runs
    without it.
    """
    return frozenset(lay.index for lay in graph.layers if _draws(lay))


def _draws(lay) -> bool:
    """True if layer `lay` may draw random numbers."""
    for m in lay.module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 or getattr(m, "draws_random", False):
            return True  # draws_random: a module that says so (NEFTune's noise, rpcompile.finetune.neftune)
        for attr in ("attention_dropout", "dropout", "dropout_p"):
            v = getattr(m, attr, 0.0)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return True
    for node in lay.module.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).lower()
        if node.op in ("call_function", "call_method") and any(r in name for r in _RANDOM_FNS):
            return True
    return False


class LayerRunner:
    """Runs the graph's layers on one worker's device with parameters passed by name.

    Args:
        graph: the traced model.
        device: where the worker's tensors live.
        seed: base seed of the per-layer RNG.
        generator: the worker's generator, or None when the graph draws no random numbers.
        routes: the runtime's RoutingLog (MoE routing replay; one per runtime, shared by its workers).
    """

    def __init__(self, graph: LayerGraph, device: torch.device, seed: int,
                 generator: torch.Generator | None, routes: RoutingLog | None = None) -> None:
        self.graph, self.device, self.seed, self.generator = graph, device, seed, generator
        self.random = random_layers(graph) if generator is not None else frozenset()  # layers under WorkerRandom
        self.routes = routes if routes is not None else RoutingLog()
        self._route: dict | None = None  # Routing arguments while a layer with routers records or replays
        self.modules, self.routed = [], set()  # routed: layers with MoE routers
        for lay in graph.layers:
            memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                    for p in lay.module.parameters()}
            self.modules.append(_buffers_to(copy.deepcopy(lay.module, memo), device))
            for r in routers(self.modules[-1]):
                r.forward = self._routed_forward(r.forward)
                self.routed.add(lay.index)
        self.modes = [[(m, m.training) for m in mod.modules()] for mod in self.modules]  # as compiled
        self.evaluating = [False] * len(self.modules)  # layer -> its modules are in eval mode now

    def _routed_forward(self, forward: Any) -> Any:
        """A router's forward that records or replays its topk when the runner asks (`_route`)."""
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._route is None:
                return forward(*args, **kwargs)
            with Routing(**self._route):
                return forward(*args, **kwargs)
        return run

    def run_layer(self, index: int, params: dict[str, torch.Tensor], env: dict[str, Any], iteration: int,
                  mb: int, buffers: dict[str, torch.Tensor] | None = None, keep: bool = True,
                  routing: str | None = None) -> None:
        """Run layer `index` reading and extending `env`, randomness seeded by (iteration, mb, layer).

        Args:
            buffers: host copies of the layer's tracked buffers (running statistics): loaded into
                this worker's module first; with `keep` the updated values are written back.
            keep: False for evaluation, which also runs the layer's modules in eval mode
                (`module.eval()`: no dropout, no NEFTune noise, BatchNorm's running statistics),
                and puts in env[HITS] the layer's (right, counted) predictions if it computes the loss
                (`CountHits`).
            routing: "record" this forward's MoE routing, "replay" the recorded one (a recompute), or None.
        """
        lay = self.graph.layers[index]
        if self.evaluating[index] == keep:  # this worker's own copy: only its compute stream runs it
            for m, mode in self.modes[index]:
                m.training = mode and keep  # training: each module's mode as compiled; evaluation: all off
            self.evaluating[index] = not keep
        mod_buffers = dict(self.modules[index].named_buffers()) if buffers else {}
        for n, b in (buffers or {}).items():
            mod_buffers[n].copy_(b, non_blocking=True)
        args = tuple(env[n] for n in lay.inputs)
        mine = {p: params[p] for p in lay.params}
        module, hits = self.modules[index], None
        if not keep and self.graph.loss in lay.outputs:  # evaluation's loss layer: count the right predictions
            module = CountHits(module)
            hits = module.hits
            mine = {f"layer.{p}": v for p, v in mine.items()}
        key = (iteration, mb, index)
        if routing is not None and index in self.routed:
            self._route = {"record": []} if routing == "record" else {"replay": self.routes.take(key, self.device)}
        try:
            if index not in self.random:
                outs = torch.func.functional_call(module, mine, args)
            else:
                with WorkerRandom(self.generator, layer_seed(self.seed, iteration, mb, index)):
                    outs = torch.func.functional_call(module, mine, args)
        finally:
            route, self._route = self._route, None
        if route is not None and "record" in route:
            self.routes.put(key, route["record"])
        if hits:
            env[HITS] = torch.stack(hits).sum(0)
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        if len(outs) != len(lay.outputs):
            raise RuntimeError(f"layer {index} ({lay.name}) returned {len(outs)} values, expected {len(lay.outputs)}")
        if keep:
            for n, b in (buffers or {}).items():
                b.copy_(mod_buffers[n], non_blocking=True)
        env.update(zip(lay.outputs, outs))

    def forward(self, layers: range, params: dict[str, torch.Tensor], inputs: dict[str, Any], iteration: int,
                mb: int, *, grad_of: tuple[str, ...] = (), buffers: dict | None = None,
                keep: bool = True, routing: str | None = None) -> dict[str, Any]:
        """Run `layers` in order from `inputs`; returns the environment of every value seen.

        Args:
            grad_of: input names to turn into leaves that require grad (the recompute's inputs).
            buffers: layer -> host copies of its tracked buffers (see `run_layer`); None: the
                worker's module buffers as they are (a recompute: their updates are dropped).
            keep: write the updated tracked buffers back (False: evaluation, in eval mode).
            routing: MoE routing: "record" (an F stage), "replay" (a recompute) or None (see `run_layer`).
        """
        env = {n: (t.detach().requires_grad_(True) if n in grad_of and t.is_floating_point() else t)
               for n, t in inputs.items()}
        for i in layers:
            self.run_layer(i, params, env, iteration, mb, (buffers or {}).get(i), keep, routing)
        return env


def _buffers_to(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move a module's buffers and tensor constants (not its meta parameters) to `device`, in place."""
    if device.type == "cpu":
        return module
    for m in module.modules():
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = b.to(device)
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                setattr(m, k, v.to(device))
    return module
