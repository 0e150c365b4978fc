"""The op recorder of both cost modes: FLOPs and bytes per aten op, and the live device memory.

`Recorder` is a dispatch mode; every aten op a layer runs (forward, and the
backward autograd runs for it) passes through it. It records

- an `OpCount` per op that moves data: FLOPs from `meta.attention.FLOP_RULES`,
  `meta.moe.GROUPED_MM_FLOPS` or torch's `flop_registry`, bytes = every tensor it reads and writes (a
  broadcast operand counts its distinct elements once); views and
  allocation-only ops are not priced;
- in a shared `Tracker`, the storages every op creates and when they die (weak
  references checked at each op), so the live bytes after every op are known.

The live curve is what a device would hold on top of the layer's parameters
and inputs: autograd's saved tensors, the outputs, the output gradients, every
backward transient and the input gradients (parameter gradients are excluded:
they are `grad_bytes`). Its maximum is the layer's `peak_bytes`. The same
recorder runs on meta (predict) and on real CPU tensors (measure), so the two
modes count the same lifetimes; only the kernels' private scratch is unseen.

Chunk loops (`meta.regions.chunk_loop`) are folded: op k of every iteration
becomes one OpCount with summed FLOPs, bytes and `launches`, and one point of
the live curve holding the largest value over the iterations.

A fused region (`meta.regions.fused_region`) is recorded twice: op by op with
`form="eager"` (what host workers run) and as one op with `form="fused"` (the
compiled kernel CUDA runs: the bytes it reads from outside the region plus the
bytes of what it leaves alive). `priced` keeps the form a Hardware runs. Ops
of a gradient region (`meta.regions.grad_region`) go to `grad_ops`, which cost
counting adds to the backward.

The rate an op is priced at (`op_rate`) is its dtype's, except for GEMMs in
fp16 when the run accumulates in fp16 (`fp16_accumulation`): those use the
"float16/float16" rate (`Hardware.flops`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from rpcompile.ir.hardware import Hardware, dtype_key
from rpcompile.passes.meta.attention import FLOP_RULES
from rpcompile.passes.meta.moe import GROUPED_MM_FLOPS
from rpcompile.passes.meta.regions import Folding, Regions

__all__ = ["OpCount", "Tracker", "Recorder", "tensor_bytes", "storage_id", "GEMMS", "op_rate", "priced"]

# aten ops that run as cuBLAS GEMMs: the ops `torch.backends.cuda.matmul.allow_fp16_accumulation` speeds up
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_grouped_mm"})

_NO_DATA = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                      "alias", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
                      "set_", "resize_", "is_same_size", "_unsafe_view", "_reshape_alias"})


@dataclass(frozen=True, slots=True)
class OpCount:
    """One aten op (or one position of a folded chunk loop) as the roofline prices it."""

    name: str  # aten op name, e.g. "mm"
    flops: int  # FLOPs (see module docstring; 0 if none)
    bytes: int  # bytes read + written (0 for views)
    dtype: str  # dtype key of its first floating input, for the peak FLOP/s lookup
    launches: int = 1  # kernels it stands for: the iterations of a folded chunk loop
    form: str = ""  # "" every device; "eager": part of a fused region as host workers run it; "fused": the
                    # region as the one compiled kernel CUDA runs (`priced` keeps one of the two)


def _shapes_only(args: tuple) -> tuple:
    """An op's positional arguments without dtypes (`addmm.dtype_out` takes `out_dtype` positionally)."""
    return tuple(a for a in args if not isinstance(a, torch.dtype))


def op_rate(op: OpCount, fp16_accumulation: bool = False) -> str:
    """The `Hardware.flops` rate key an op runs at: fp16 GEMMs accumulate in fp16 when the run asks for it.

    >>> op_rate(OpCount("mm", 2, 8, "float16"), True), op_rate(OpCount("mul", 1, 8, "float16"), True)
    ('float16/float16', 'float16')
    """
    return "float16/float16" if fp16_accumulation and op.dtype == "float16" and op.name in GEMMS else op.dtype


def priced(ops: Iterable[OpCount], hardware: Hardware) -> list[OpCount]:
    """The ops `hardware` runs: a fused region as one kernel on CUDA, op by op on host workers."""
    skip = "eager" if hardware.kind == "cuda" else "fused"
    return [o for o in ops if o.form != skip]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op touches in `t`: a broadcast (expanded) operand counts its distinct elements once.

    >>> tensor_bytes(torch.zeros(4).expand(3, 4))
    16
    """
    size = t.element_size()
    n = t.numel() * size
    distinct = size
    for d, st in zip(t.shape, t.stride()):
        distinct *= d if st else 1
    try:
        return min(n, distinct, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return min(n, distinct)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested tuples, lists, dicts), in `tree_flatten`'s order.

    Every op of a count comes through here; pytree's general flattening took about a third of the
    recorder's time outside the ops themselves.

    >>> a, b = torch.zeros(1), torch.ones(2)
    >>> [t.numel() for t in tensors_in(((a, 3), {"x": [b]}, None))]
    [1, 2]
    """
    out: list[torch.Tensor] = []
    stack = [value]  # no recursive closure: its reference cycle would keep the tensors alive until a collection
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return out


def storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (works on meta)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


class Tracker:
    """Lifetimes of the storages created while recording (see module docstring).

    Args:
        resident: storage ids that are there before the run and not counted (parameters, inputs).
    """

    def __init__(self, resident: Iterable[int]) -> None:
        self.resident = set(resident)
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}  # sid -> (weak ref, event index)
        self.events: list[list[int]] = []  # [sid, bytes, first step alive, first step dead (0: never)]
        self.steps = 0  # ops observed
        self.groups: list[list[int]] = []  # points of the (folded) live curve: the steps each stands for
        self._fold: list[int] | None = None  # curve points of the current loop's first iteration
        self._iters = 0  # iterations of the current loop started so far
        self._pos = 0  # position within the current iteration

    def observe(self, outputs: Iterable[Any]) -> None:
        """One op ran and returned `outputs`: note storages that died and the ones it created."""
        self.steps += 1
        expired = torch.UntypedStorage._expired  # `StorageWeakRef.expired` without its two Python calls per check
        for sid, (ref, k) in list(self.alive.items()):
            if expired(ref.cdata):
                self.events[k][3] = self.steps
                del self.alive[sid]
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            sid = storage_id(t)
            if sid in self.resident or sid in self.alive:
                continue
            try:
                ref = StorageWeakRef(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            self.alive[sid] = (ref, len(self.events))
            self.events.append([sid, tensor_bytes(t), self.steps, 0])  # the tensor's bytes: kernels may over-allocate
        self._group(self.steps)

    def _group(self, step: int) -> None:
        """Put a step into the live curve: a new point, or the point of its loop position."""
        if self._fold is None or self._iters < 2:
            self.groups.append([step])
            if self._fold is not None and self._iters == 1:
                self._fold.append(len(self.groups) - 1)
        elif self._pos < len(self._fold):
            self.groups[self._fold[self._pos]].append(step)
            self._pos += 1
        else:  # a longer iteration than the first: its extra ops stay unfolded
            self.groups.append([step])

    def fold_begin(self) -> None:
        """A chunk loop starts (nested loops are not folded twice)."""
        if self._fold is not None:
            raise RuntimeError("nested chunk loops are not supported")
        self._fold, self._iters, self._pos = [], 0, 0

    def fold_next(self) -> None:
        """Next iteration: from the second on, its ops fold onto the first iteration's positions."""
        if self._fold is not None:
            self._iters += 1
            self._pos = 0

    def fold_end(self) -> None:
        """The loop ended."""
        self._fold = None

    def live(self, exclude: Iterable[int] = ()) -> list[int]:
        """Live bytes at each point of the (folded) curve, without storages in `exclude` alive at the end."""
        skip = set(exclude)
        delta = [0] * (self.steps + 2)
        for sid, n, start, stop in self.events:
            if stop == 0 and sid in skip:
                continue
            delta[start] += n
            delta[stop or self.steps + 1] -= n
        level, per_step = 0, [0] * (self.steps + 1)
        for i in range(1, self.steps + 1):
            level += delta[i]
            per_step[i] = level
        return [max(per_step[s] for s in g) for g in self.groups]


_aten = torch.ops.aten
# pointwise ops whose result is a new tensor of the broadcast shape at `torch.result_type` of its operands
# (numbers included; `alpha` changes neither), laid out as TensorIterator orders the operands' strides
_POINTWISE = frozenset({_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor,
                        _aten.add.Scalar, _aten.sub.Scalar, _aten.mul.Scalar, _aten.div.Scalar,
                        _aten.neg.default, _aten.rsqrt.default, _aten.pow.Tensor_Scalar})
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _pointwise_on_meta(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The result of a `_POINTWISE` op on floating meta tensors (and numbers) laid out in row-major order,
    made directly; None for anything else (the op itself runs).

    What the op's own meta kernel gives, by TensorIterator's rules: the broadcast shape, the operands'
    promoted dtype, and a contiguous result where every operand is in row-major order (`_row_major`:
    contiguous, or a slice of a wider row, as a chunked gate/up projection's halves): then no dimension
    is reordered.
    Made without the op's Python reference implementation, which took most of the time of counting a
    layer on meta (about 0.3-1 ms per `mul` against a few us).
    """
    if func not in _POINTWISE or (kwargs and set(kwargs) != {"alpha"}) or not 1 <= len(args) <= 2:
        return None
    shape: Any = None
    tensors = [a for a in args if type(a) in _PLAIN_TENSORS]
    for a in args:
        if type(a) in _PLAIN_TENSORS:
            if not (a.is_meta and a.is_floating_point()):
                return None
            try:
                shape = a.shape if shape is None else torch._C._infer_size(shape, a.shape)
            except RuntimeError:  # not broadcastable: the op says so itself
                return None
        elif type(a) not in (int, float):
            return None
    if shape is None:
        return None
    if not all(_row_major(t, shape) for t in tensors):
        return None
    dtype = torch.result_type(*args) if len(args) == 2 else args[0].dtype
    return torch.empty(shape, dtype=dtype, device="meta")


def _row_major(t: torch.Tensor, shape: torch.Size) -> bool:
    """Whether `t`, broadcast to `shape`, is in row-major order as TensorIterator compares strides: of any two
    of its dimensions (broadcast ones, stride 0, left out) the outer has the larger stride, or the same
    stride and at least the inner one's size; then it orders no dimension before another."""
    lead = len(shape) - t.dim()
    dims = [(n, s) for d, (n, s) in enumerate(zip(t.shape, t.stride())) if s and not (n == 1 and shape[lead + d] != 1)]
    return all(so > si or (so == si and no >= ni) for k, (no, so) in enumerate(dims) for ni, si in dims[k + 1:])


class Recorder(TorchDispatchMode, Folding, Regions):
    """Dispatch mode appending an OpCount per op to `self.ops` and feeding the Tracker (module docstring).

    Args:
        tracker: the lifetime tracker shared by a layer's forward and backward recorders (optional).
    """

    def __init__(self, tracker: Tracker | None = None) -> None:
        super().__init__()
        self.ops: list[OpCount] = []
        self.grad_ops: list[OpCount] = []  # ops of gradient regions (counted with the backward)
        self.tracker = tracker
        self._loop: list[list[tuple[bool, OpCount]]] | None = None  # iterations: (in a grad region, op)
        self._times: list[int] = []  # per iteration of the current loop: how many iterations it stands for
        self._grad = False  # inside a gradient region
        self._fused: dict | None = None  # the open fused region: storages made and read, FLOPs, dtype

    def _add(self, op: OpCount) -> None:
        """Append an op where it belongs: the current loop iteration, else the forward or gradient list."""
        if self._loop:
            self._loop[-1].append((self._grad, op))
        else:
            (self.grad_ops if self._grad else self.ops).append(op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _pointwise_on_meta(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        flat_out = tensors_in(out)
        if self.tracker is not None:
            self.tracker.observe(flat_out)
        name = func.__name__.split(".")[0]
        if func.is_view or name in _NO_DATA or func.namespace == "prim":
            return out
        ins = (args, {k: v for k, v in kwargs.items() if k != "out"})  # an out= tensor is written: in flat_out
        tensors = tensors_in(ins) + flat_out
        nbytes = sum(tensor_bytes(t) for t in tensors)
        packet = func._overloadpacket
        rule = FLOP_RULES.get(packet) or GROUPED_MM_FLOPS.get(packet) or flop_registry.get(packet)
        flops = int(rule(*_shapes_only(args), **{k: v for k, v in kwargs.items() if k not in ("out", "out_dtype")},
                         out_val=out)) if rule is not None else 0
        floats = [t for t in tensors if t.is_floating_point()]
        if name in GEMMS and len(floats) > 2:  # addmm(acc, a, b): the operands' dtype picks the rate, not acc's
            floats = floats[1:]
        dtype = dtype_key(floats[0].dtype) if floats else "float32"
        if self._fused is not None:
            self._in_fused(tensors_in((args, kwargs)), flat_out, flops, dtype)
        self._add(OpCount(name, flops, nbytes, dtype, form="eager" if self._fused is not None else ""))
        return out

    def _in_fused(self, ins: list, outs: list, flops: int, dtype: str) -> None:
        """Note what an op of the open fused region reads from outside it and the storages it makes."""
        r = self._fused
        for t in ins:
            if isinstance(t, torch.Tensor) and storage_id(t) not in r["made"]:
                r["read"][storage_id(t)] = tensor_bytes(t)
        for t in outs:
            try:
                r["made"].setdefault(storage_id(t), (StorageWeakRef(t.untyped_storage()), tensor_bytes(t)))
            except (RuntimeError, NotImplementedError):
                pass
        r["flops"] += flops
        r["dtype"] = r["dtype"] or dtype

    def fused_begin(self) -> None:
        if self._fused is not None:
            raise RuntimeError("nested fused regions are not supported")
        self._fused = {"made": {}, "read": {}, "flops": 0, "dtype": ""}

    def fused_end(self) -> None:
        r, self._fused = self._fused, None
        if r is None or not r["made"]:
            return
        alive = sum(n for ref, n in r["made"].values() if not ref.expired())
        self._add(OpCount("fused_elementwise", r["flops"], sum(r["read"].values()) + alive, r["dtype"] or "float32",
                          form="fused"))

    def grad_begin(self) -> None:
        self._grad = True

    def grad_end(self) -> None:
        self._grad = False

    def fold_begin(self) -> None:
        self._loop, self._times = [], []
        if self.tracker is not None:
            self.tracker.fold_begin()

    def fold_next(self) -> None:
        if self._loop is not None:
            self._loop.append([])
            self._times.append(1)
        if self.tracker is not None:
            self.tracker.fold_next()

    def fold_repeat(self, k: int) -> None:
        """The iteration that just ran stands for itself and `k` more like it (`regions._Loop.over`).

        Its live memory needs nothing: the skipped iterations would repeat its curve.
        """
        if self._loop:
            self._times[-1] += k

    def fold_end(self) -> None:
        loop, self._loop = self._loop or [], None
        if self.tracker is not None:
            self.tracker.fold_end()
        if not loop:
            return
        first, times = loop[0], self._times
        for k, (grad, op) in enumerate(first):
            same = [(it[k][1], n) for it, n in zip(loop, times) if len(it) > k and it[k][1].name == op.name]
            (self.grad_ops if grad else self.ops).append(OpCount(
                op.name, sum(o.flops * n for o, n in same), sum(o.bytes * n for o, n in same), op.dtype,
                sum(o.launches * n for o, n in same), op.form))
        for it, n in zip(loop, times):  # ops beyond the first iteration's length (or renamed) stay unfolded
            for k, (grad, o) in enumerate(it):
                if k >= len(first) or first[k][1].name != o.name:
                    (self.grad_ops if grad else self.ops).extend([o] * n)
