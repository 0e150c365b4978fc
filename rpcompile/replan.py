"""Re-planning at `step`: one program per batch signature, kept so that a batch can switch back to it.

A program is traced for what its example held (`batch.signature`: the inputs present, a value that is
None counting as absent, and the tensor shapes). An input the example lacked is not part of the
program, so a batch with another signature must never run it: it gets a program of its own, planned
once by `plan_for` with the layer units and LM-head shards of the first plan (the training state's
layer groups stay the same), and kept in `Variants`. A key that comes and goes (a padding mask in
some batches only) then switches between programs without planning again. What cannot be planned
raises ValueError naming the key that was added or removed.

    >>> v = Variants(limit=2)
    >>> for sig in "abc":
    ...     v.put(sig, sig.upper())
    >>> v.get("a"), v.get("c")
    (None, 'C')
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from rpcompile.batch import describe_change, signature
from rpcompile.options import Options
from rpcompile.pipeline import compile_passes, frozen_of

__all__ = ["Variant", "Variants", "plan_for"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """What the compiler made for one batch signature; the runtime is rebuilt from it at each switch."""

    graph: Any         # LayerGraph
    costs: Any         # CostTable
    plan: Any          # StagePlan
    program: Any       # Program
    microbatches: int
    example: Any       # the batch it was planned for (costed by `simulate`, saved by `state_dict`)
    assignment: Any    # BufferAssignment: the program's host buffers (`runtime.host.assign`)


class Variants:
    """The `limit` most recently used variants, by signature (the least recently used is dropped first)."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._items: collections.OrderedDict[tuple, Variant] = collections.OrderedDict()

    def get(self, sig: tuple) -> Variant | None:
        """The variant planned for `sig`, or None."""
        v = self._items.get(sig)
        if v is not None:
            self._items.move_to_end(sig)
        return v

    def put(self, sig: tuple, v: Variant) -> None:
        """Keep `v` for `sig`."""
        self._items[sig] = v
        self._items.move_to_end(sig)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def plan_for(model: torch.nn.Module, opts: Options, current: Variant, units: Any, batch: Any) -> Variant:
    """Plan `batch` as `current` was planned: the same layer units and LM-head shards, new costs and plan.

    Raises:
        ValueError: the batch lacks an input the model cannot be planned without, or planning for an
            input the example lacked failed (names the key); or the new trace has another layer count.
        Any other planning error for a batch whose inputs are those of `current` (a new shape only).
    """
    head = frozen_of(current.graph, current.costs, current.program).head  # keep the layers: the state's groups
    opts = dataclasses.replace(opts, lm_head_shards=head["shards"] if head else 1, layers=units or opts.layers)
    old, new = signature(current.example), signature(batch)
    try:
        graph, costs, plan, program, m, _, _, assignment = compile_passes(model, batch, opts)
    except Exception as exc:  # noqa: BLE001 - re-raised with the key that changed
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        present = dict(new)
        missing = [n for n in current.graph.inputs if n not in present]
        if missing:
            raise ValueError(f"the batch is missing {missing[0]!r} (the model was compiled with inputs "
                             f"{list(current.graph.inputs)}) and cannot be planned without it: {why}") from exc
        if set(dict(old)) != set(present):
            raise ValueError(f"the batch's inputs changed ({describe_change(old, new)}) and planning for "
                             f"them failed: {why}") from exc
        raise
    if len(graph.layers) != len(current.graph.layers):
        raise ValueError(f"re-planning for the batch ({describe_change(old, new)}) split the model into "
                         f"{len(graph.layers)} layers instead of {len(current.graph.layers)}; compile again")
    return Variant(graph, costs, plan, program, m, batch, assignment)
