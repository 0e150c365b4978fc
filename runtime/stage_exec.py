"""Running a stage's layers: what crosses its cuts, forward, recompute and backward.

`StageIO` says, per stage of a plan, which values a stage reads, downloads and
which gradients it receives and sends (DESIGN.md idea 3). `LayerRunner` runs
layers on one worker with parameters given by name, with per-(iteration,
microbatch, layer) seeded randomness on the worker's own generator
(`runtime/rng.py`) so that a B stage's recompute reproduces the dropout masks
of the F stage that ran the same layer earlier.

MoE routing replay: `LayerRunner.forward(routing="record")` (an F stage) keeps
each MoE layer's routing (`passes.meta.moe.Routing`: the top-k indices and
weights of its routers) in the runtime's `RoutingLog`; the recompute of that
layer in a B stage (`routing="replay"`), on any worker, routes with it, so the
backward differentiates the experts the forward used even when the router's
logits differ in the last bit there.

Note:
    `torch.func.functional_call` swaps a module's parameters in place while it
    runs, so two threads may not call it on one module. Each worker gets its own
    copies of the layer modules, built without copying a parameter (they stay
    on the meta device and are never used); buffers move to the worker's device.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from rpcompile.ir.graph import LayerGraph
from rpcompile.ir.plan import StageKind, StagePlan
from rpcompile.passes.meta.moe import Routing, routers
from rpcompile.passes.shard_head.chunked import lse_loss
from rpcompile.runtime.rng import WorkerRandom, layer_seed

__all__ = ["StageIO", "stage_io", "LayerRunner", "RoutingLog", "HITS", "tracked_buffers", "layer_seed", "split_batch",
           "has_random_ops", "random_layers", "flat_ranges", "up_keys", "count_readers", "chunk_elements", "grads_of",
           "trained_tokens", "token_weights"]

HITS = "<token hits>"  # env key of evaluation's (right, counted) predictions (`LayerRunner.run_layer`)
_CE = inspect.signature(F.cross_entropy)
_RANDOM_FNS = ("dropout", "bernoulli", "rand", "randn", "randint", "randperm", "multinomial", "normal")


@dataclass(frozen=True)
class StageIO:
    """The values at a stage's cuts (names; see `stage_io`)."""

    index: int
    kind: StageKind
    layers: range
    params: tuple[str, ...]  # canonical parameter names used by the stage, first-use order
    own: dict  # layer -> the params it brings to the stage's flat layout (dedup'ed within the stage)
    reads: tuple[str, ...]  # values produced before the stage (or batch inputs) that its layers read
    down: tuple[str, ...]  # F: values produced here that later stages read (outputs + saved inputs)
    grad_in: tuple[str, ...]  # B: gradients received at the cut after the stage (requires_grad only)
    grad_out: tuple[str, ...]  # X/B: gradients sent at the cut before the stage (requires_grad only)


def stage_io(graph: LayerGraph, plan: StagePlan) -> list[StageIO]:
    """Per stage, the values it reads, downloads, receives and sends gradients for.

    Args:
        graph: the traced model.
        plan: stage plan covering the graph's layers.
    Returns:
        One StageIO per stage, in slot order.
    """
    if plan.num_layers != len(graph.layers):
        raise ValueError(f"plan covers {plan.num_layers} layers but the graph has {len(graph.layers)}")
    cuts = {r.start - 1 for r in plan.bwd if r.start > 0}
    out = []
    for s in plan.stages:
        lo, hi = s.layers.start, s.layers.stop - 1
        layers = [graph.layers[i] for i in s.layers]
        produced = {n for lay in layers for n in lay.outputs}
        read = {n for lay in layers for n in lay.inputs}
        reads = tuple(v.name for v in graph.live_at(lo - 1) if v.name in read)
        down: tuple[str, ...] = ()
        if s.kind is StageKind.F:
            need = {v.name for v in graph.live_at(hi)}
            need |= {v.name for c in cuts if lo <= c <= hi for v in graph.live_at(c)}
            down = tuple(n for lay in layers for n in lay.outputs if n in need and n in produced)
        grad_in = tuple(v.name for v in graph.live_at(hi) if v.requires_grad) if s.kind is StageKind.B else ()
        grad_out = () if s.kind is StageKind.F else tuple(v.name for v in graph.live_at(lo - 1) if v.requires_grad)
        params, own = [], {}
        for lay in layers:
            own[lay.index] = tuple(p for p in lay.params if p not in params)
            params += own[lay.index]
        out.append(StageIO(s.index, s.kind, s.layers, tuple(params), own, reads, down, grad_in, grad_out))
    return out


def flat_ranges(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Split the flat element range [lo, hi) over consecutive tensors of `sizes` elements.

    Returns:
        (tensor index, start, stop) within each tensor that the range touches.

    >>> flat_ranges([4, 4], 2, 6)
    [(0, 2, 4), (1, 0, 2)]
    """
    out, off = [], 0
    for k, n in enumerate(sizes):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((k, a - off, b - off))
        off += n
    return out


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


def split_batch(graph: LayerGraph, batch: Any, microbatches: int) -> list[dict[str, torch.Tensor]]:
    """The batch's named inputs cut into `microbatches` equal slices along each input's batch dim.

    Inputs with `batch_dim` None are shared by every microbatch.

    Raises:
        ValueError: an input's batch size is not divisible by `microbatches` (names it).
    """
    inputs = graph.flatten_inputs(batch)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(microbatches)]
    for name, t in inputs.items():
        bd = graph.values[name].batch_dim if name in graph.values else 0
        if bd is None or t.dim() == 0:
            parts = [t] * microbatches
        else:
            if t.shape[bd] % microbatches:
                raise ValueError(f"input {name!r} has batch size {t.shape[bd]}, not divisible into "
                                 f"{microbatches} microbatches")
            parts = list(t.tensor_split(microbatches, dim=bd))
        for m in range(microbatches):
            out[m][name] = parts[m].contiguous()
    return out


def trained_tokens(graph: LayerGraph, batch: Any, microbatches: int, ignore_index: int = -100) -> list[int]:
    """Per microbatch, the targets its loss averages over: shifted `labels` that are not `ignore_index`.

    As transformers' causal LMs count them (`(labels[..., 1:] != -100).sum()`); the microbatches are cut
    as `split_batch` cuts them.

        >>> trained_tokens(graph, {"input_ids": ids, "labels": torch.tensor([[5, 6, 7], [5, -100, -100]])}, 2)  # doctest: +SKIP
        [2, 0]

    Raises:
        ValueError: the batch is not a dict with a `labels` tensor.
    """
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"loss_mean='tokens' needs the batch to be a dict with a `labels` tensor (the model's "
                         f"targets, -100 where nothing is trained); got "
                         f"{'a dict without labels' if isinstance(batch, dict) else type(batch).__name__}")
    v = graph.values.get("labels") if "labels" in graph.inputs else None
    bd = 0 if v is None or v.batch_dim is None else v.batch_dim
    if labels.dim() == 0 or labels.shape[bd] % microbatches:
        raise ValueError(f"input 'labels' of shape {tuple(labels.shape)} does not split into {microbatches} "
                         f"microbatches")
    return [int((part[..., 1:] != ignore_index).sum()) for part in labels.tensor_split(microbatches, dim=bd)]


def token_weights(counts: list[int], total: int, world: int = 1) -> list[float]:
    """Each microbatch's factor in the step's loss: world * n_m / N (N: the step's trained tokens, all ranks).

    The world factor undoes the data-parallel average of gradients and losses over `world` ranks, so
    their mean is sum(NLL) / N over every rank's tokens.

        >>> token_weights([3, 1], 4), token_weights([3, 0], 6, world=2)
        ([0.75, 0.25], [1.0, 0.0])
    """
    if total <= 0:
        raise ValueError("loss_mean='tokens': the step has no trained token (every shifted label is -100), so "
                         "its loss is 0/0; drop the batch or train on some of its labels")
    return [world * n / total for n in counts]


class RoutingLog:
    """The MoE routing of each (iteration, microbatch, layer) forward, kept for its recompute (module docstring).

    Host workers keep the recorded tensors. CUDA workers copy them to pinned host memory on the
    forward's compute stream and record an event; the recomputing worker's stream waits for that
    event before it copies them in. A recompute whose forward has not run yet waits for it (the
    forward depends on nothing after the recompute), at most `timeout` seconds.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._log: dict[tuple, tuple[list, Any]] = {}  # (t, mb, layer) -> (topk outputs, CUDA event or None)

    def put(self, key: tuple, entries: list) -> None:
        """Keep one forward's topk outputs (values, indices) in call order."""
        event = None
        if entries and entries[0][0].is_cuda:
            entries = [(v.to("cpu", non_blocking=True), i.to("cpu", non_blocking=True)) for v, i in entries]
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            self._log[key] = (entries, event)
            self._cond.notify_all()

    def take(self, key: tuple, device: torch.device) -> list:
        """The forward's routing for its recompute on `device` (removed from the log).

        Raises:
            RuntimeError: the forward did not record it within the timeout (names the key).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._log, timeout=self.timeout):
                raise RuntimeError(f"routing replay: no routing recorded for (iteration, microbatch, layer) "
                                   f"{key} within {self.timeout:.0f}s")
            entries, event = self._log.pop(key)
        if event is None:
            return entries
        torch.cuda.current_stream(device).wait_event(event)
        return [(v.to(device, non_blocking=True), i.to(device, non_blocking=True)) for v, i in entries]

    def forget_from(self, t: int) -> None:
        """Drop the routing of iterations >= t (abandoned after a failure)."""
        with self._cond:
            for k in [k for k in self._log if k[0] >= t]:
                del self._log[k]


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
                (`_Hits`).
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
            module = _Hits(module)
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


class _Hits(torch.nn.Module):
    """A layer run through an fx Interpreter that notes (right, counted) targets of each cross-entropy it computes.

    A target counts unless it is the ignore_index; it is right where the logits' argmax is the target:
    `F.cross_entropy` / `nn.CrossEntropyLoss` read the argmax of their input, `lse_loss` (the sharded
    head, whose logits never exist whole) has the target logit equal the running max. The same ops run
    in the same order as the layer's own forward, so the loss is the same bits.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.hits = layer, []

    def forward(self, *args: Any) -> Any:
        return _HitInterpreter(self.layer, self.hits).run(*args)


class _HitInterpreter(fx.Interpreter):
    """`_Hits`'s interpreter: each call of a cross-entropy appends a (right, counted) tensor to `hits`."""

    def __init__(self, gm: fx.GraphModule, hits: list) -> None:
        super().__init__(gm)
        self.found = hits

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_function(target, args, kwargs)
        if target is F.cross_entropy:
            a = _CE.bind(*args, **kwargs).arguments
            self.found.append(_right(a["input"], a["target"], a.get("ignore_index", -100)))
        elif target is lse_loss:
            m, _, t, tgt, ignore = args[:5]
            keep = tgt != ignore
            self.found.append(torch.stack([((t >= m) & keep).sum(), keep.sum()]))
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_module(target, args, kwargs)
        mod = self.fetch_attr(target)
        if isinstance(mod, torch.nn.CrossEntropyLoss):
            self.found.append(_right(args[0], args[1], mod.ignore_index))
        return out


def _right(logits: torch.Tensor, target: torch.Tensor, ignore: int) -> torch.Tensor:
    """(targets where the argmax over the class dim is right, targets counted); ignore_index left out."""
    keep = target != ignore
    pred = logits.detach().argmax(1 if logits.dim() > 1 else 0)
    return torch.stack([((pred == target) & keep).sum(), keep.sum()])


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


def up_keys(io: list[StageIO], i) -> list[tuple]:
    """Host keys (without the iteration) that an upload instruction reads."""
    st = io[i.stage]
    if i.grad:
        return [("g", i.mb, st.layers.stop - 1, n) for n in st.grad_in]
    return [("a", i.mb, n) for n in st.reads]


def count_readers(program, io: list[StageIO]) -> dict[tuple, int]:
    """Host key (without the iteration) -> number of uploads of one iteration that read it."""
    out: dict[tuple, int] = {}
    for i in program.instrs:
        if i.op.value == "U":
            for k in up_keys(io, i):
                out[k] = out.get(k, 0) + 1
    return out


def chunk_elements(program, io: list[StageIO], state) -> tuple[dict, dict]:
    """(stage, chunk) -> [(param, start, stop)] flat element ranges; (stage, param) -> piece count.

    A piece (layer, a, z) of a chunk is the byte range [a, z) of the layer's parameter bytes as
    the cost table counted them; it maps to the same fraction of the layer's actual flat
    elements (its parameters in `StageIO.own` order). A layer counted as 0 bytes goes whole.
    """
    total: dict[tuple[int, int], int] = {}
    for c in program.chunks:
        for l, _, z in c.pieces:
            total[(c.stage, l)] = max(total.get((c.stage, l), 0), z)
    elems, count = {}, {}
    for c in program.chunks:
        out = []
        for l, a, z in c.pieces:
            names = io[c.stage].own.get(l, ())
            sizes = [state.read(n).numel() for n in names]
            e, tb = sum(sizes), total[(c.stage, l)]
            lo, hi = (0, e) if tb == 0 else (a * e // tb, z * e // tb)
            out += [(names[k], s, f) for k, s, f in flat_ranges(sizes, lo, hi)]
        elems[(c.stage, c.index)] = out
        for n, _, _ in out:
            count[(c.stage, n)] = count.get((c.stage, n), 0) + 1
    return elems, count


def grads_of(env: dict, names: tuple[str, ...], passthrough: dict) -> dict[str, torch.Tensor]:
    """Gradients of `names`: a leaf's .grad (zeros if none), or the received one for unused pass-throughs."""
    out = {}
    for n in names:
        v = env.get(n)
        if v is None or not isinstance(v, torch.Tensor) or not v.requires_grad:
            out[n] = passthrough[n]
        else:
            out[n] = v.grad if v.grad is not None else torch.zeros_like(v)
    return out
