"""Attention masks are rebuilt inside each layer that reads them, never passed across a cut.

Note:
    Hugging Face builds the attention mask once, in the glue before the first
    decoder layer (`masking_utils.create_causal_mask` and friends; `trace` makes
    them opaque leaves), and passes it to every layer. Passed across cuts, an
    eager (B, 1, S, S) mask is 4 * B * S^2 bytes in every saved stage input;
    and with SDPA the call returns None when the example has no padding, which
    tracing would freeze into every consumer, silently dropping a padding mask
    that a later batch has. So `fix_crossings` copies the mask call into every
    consumer layer, right before its first use there: what crosses the cut is
    the call's inputs, the [B, S] padding mask (a model input) and the
    position ids, and the consumer gets a fresh mask (or None) for every batch.

    The call's `inputs_embeds` tensor is only read for its batch size, dtype and
    device (masking_utils documents this), so in the consumer it is replaced
    by a tensor of the same shape and dtype the consumer already has (its
    hidden-state input); other tensor arguments are passed as they are.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from rpcompile.passes.trace.props import TMeta

__all__ = ["is_mask_call", "rebuild_in_consumers", "position"]


def is_mask_call(n: fx.Node) -> bool:
    """True for a call of a transformers `masking_utils.create_*mask` function (an fx leaf of `trace`)."""
    if n.op != "call_function":
        return False
    fn = getattr(n.target, "__wrapped__", n.target)
    return getattr(fn, "__module__", "") == "transformers.masking_utils" and \
        getattr(fn, "__name__", "").startswith("create_")


def position(graph: fx.Graph, node: fx.Node) -> int:
    """Index of `node` in graph order."""
    for i, m in enumerate(graph.nodes):
        if m is node:
            return i
    raise KeyError(node.name)


def _stand_in(x: fx.Node, first: fx.Node, record: dict[fx.Node, Any]) -> fx.Node:
    """`x` if the consumer already reads it, else one of the consumer's inputs with x's shape and dtype."""
    ins = first.all_input_nodes
    if x in ins:
        return x
    rec = record.get(x)
    if isinstance(rec, TMeta):
        for cand in ins:
            crec = record.get(cand)
            if cand.op != "get_attr" and isinstance(crec, TMeta) and (crec.shape, crec.dtype) == (rec.shape, rec.dtype):
                return cand
    return x


def rebuild_in_consumers(graph: fx.Graph, n: fx.Node, users: list[fx.Node], layer_of: dict[fx.Node, int],
                         record: dict[fx.Node, Any], user_layer) -> None:
    """Replace mask call `n` read by later layers with a copy in each of them (see module note).

    Args:
        graph: the traced top-level graph (edited in place).
        n: the mask call.
        users: its users in layers after its own.
        layer_of, record: node -> layer and node -> recorded value (updated for the copies).
        user_layer: node -> its layer index (the output node counts as the last layer).
    """
    for b in sorted({user_layer(u) for u in users}):
        mine = [u for u in users if user_layer(u) == b]
        first = min(mine, key=lambda u: position(graph, u))

        def arg(x: fx.Node) -> fx.Node:
            if x.op in ("placeholder", "get_attr") or layer_of.get(x) == b:
                return x
            return _stand_in(x, first, record)

        with graph.inserting_before(first):
            copy = graph.node_copy(n, arg)
        layer_of[copy], record[copy] = b, record.get(n)
        for u in mine:
            u.args = fx.node.map_arg(u.args, lambda y: copy if y is n else y)
            u.kwargs = fx.node.map_arg(u.kwargs, lambda y: copy if y is n else y)
