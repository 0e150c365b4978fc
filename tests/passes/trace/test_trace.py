"""Acceptance tests for rpcompile.passes.trace (issue #2)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn


import models as M  # noqa: E402
from rpcompile.passes import trace  # noqa: E402
from rpcompile.passes.trace import match_units  # noqa: E402
from rpcompile.passes.trace.tracer import UntraceableError  # noqa: E402

pytest.importorskip("transformers")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: nn.Module, example, loss_fn) -> torch.Tensor:
    if loss_fn is None:
        return model(**example).loss
    if isinstance(example, tuple) and isinstance(model, nn.Sequential):
        return loss_fn(model(example[0]), example)
    return loss_fn(model(*example), example)


ZOO = {
    "nanogpt": (M.nanogpt, lambda b, t: M.token_batch(batch=b, seq=t), M.gpt_loss),
    "sequential": (M.sequential, lambda b, t: M.regression_batch(batch=b * t), M.mse_loss),
    "llama": (M.llama, lambda b, t: M.lm_batch(batch=b, seq=t), None),
    "llama_sdpa": (lambda: M.llama(attn="sdpa"), lambda b, t: M.lm_batch(batch=b, seq=t), None),
    "qwen3": (M.qwen3, lambda b, t: M.lm_batch(batch=b, seq=t), None),
    "qwen3_moe": (M.qwen3_moe, lambda b, t: M.lm_batch(batch=b, seq=t), None),
    "gpt2": (M.gpt2, lambda b, t: M.lm_batch(batch=b, seq=t), None),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_layers_reproduce_loss_and_grads(name: str) -> None:
    build, batch, loss_fn = ZOO[name]
    model = build()
    graph = trace(model, batch(2, 8), loss_fn=loss_fn)  # traced once, run at two shapes
    for shape in ((2, 8), (3, 16)):
        example = batch(*shape)
        model.zero_grad(set_to_none=True)
        ref = _reference(model, example, loss_fn)
        ref.backward()
        ref_grads = _grads(model)
        model.zero_grad(set_to_none=True)
        loss = graph.run(example)
        assert loss.shape == ()
        assert torch.equal(loss, ref), (shape, loss.item(), ref.item())
        loss.backward()
        got = _grads(model)
        assert got.keys() == ref_grads.keys() and got
        for pname, g in got.items():
            torch.testing.assert_close(g, ref_grads[pname], atol=1e-6, rtol=0, msg=f"{name} {shape} {pname}")


def test_llama_layers_and_live_values() -> None:
    model = M.llama()
    b, t = 2, 8
    graph = trace(model, M.lm_batch(batch=b, seq=t))
    n = model.config.num_hidden_layers
    assert [lay.name for lay in graph.layers] == (
        ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(n)] + ["model.norm", "lm_head"])
    assert graph.loss == graph.layers[-1].outputs[-1] and graph.values[graph.loss].shape == ()
    hidden, head_dim = model.config.hidden_size, model.config.hidden_size // model.config.num_attention_heads
    shared = {"position_embeddings_0": ((1, t, head_dim), torch.float32),
              "position_embeddings_1": ((1, t, head_dim), torch.float32),
              "position_ids": ((1, t), torch.int64)}  # no (b, 1, t, t) mask: each layer rebuilds it
    for i in range(n + 1):  # the cut after the embedding and after each decoder layer but the last
        live = {v.name: v for v in graph.live_at(i)}
        if i == n:
            assert set(live) == {f"h{i}", "labels"}
        else:
            assert set(live) == {f"h{i}", "labels", *shared}
            for vname, (shape, dtype) in shared.items():
                assert (live[vname].shape, live[vname].dtype) == (shape, dtype)
                assert live[vname].requires_grad is False
        h = live[f"h{i}"]
        assert h.shape == (b, t, hidden) and h.bytes == b * t * hidden * 4 and h.requires_grad and h.batch_dim == 0
        for v in live.values():
            numel = 1
            for d in v.shape:
                numel *= d
            assert v.bytes == numel * v.dtype.itemsize
        assert graph.cut_bytes(i) == sum(v.bytes for v in live.values())
    assert live["labels"].kind == "input"


def test_layer_modules_use_canonical_names_and_functional_call() -> None:
    model = M.gpt2()
    example = M.lm_batch()
    graph = trace(model, example)
    assert graph.tied == {"lm_head.weight": "transformer.wte.weight"}
    owners = graph.param_owners()
    assert owners["transformer.wte.weight"] == (0, len(graph.layers) - 1)
    assert sum(len(o) > 1 for o in owners.values()) == 1
    for layer in graph.layers:
        names = set(dict(layer.module.named_parameters()))
        assert names == set(layer.params) and names <= set(graph.params)
    # run every layer through torch.func.functional_call with copies keyed by canonical names
    copies = {n: p.detach().clone() for n, p in graph.parameters().items()}
    env = dict(graph.flatten_inputs(example))
    for layer in graph.layers:
        state = {n: copies[n] for n in layer.params}
        env.update(zip(layer.outputs, torch.func.functional_call(layer.module, state, tuple(
            env[i] for i in layer.inputs))))
    assert torch.equal(env[graph.loss], model(**example).loss)
    copies["transformer.wte.weight"].mul_(0.5)  # the tied weight now differs: so must the loss
    out = torch.func.functional_call(graph.layers[-1].module, {"transformer.wte.weight": copies[
        "transformer.wte.weight"]}, tuple(env[i] for i in graph.layers[-1].inputs))[0]
    assert not torch.equal(out, env[graph.loss])


def test_meta_model_records_same_shapes() -> None:
    example = M.lm_batch()
    real = trace(M.llama(), example)
    with torch.device("meta"):
        meta_model = M.llama()
    meta = trace(meta_model, example)
    assert [lay.name for lay in meta.layers] == [lay.name for lay in real.layers]
    assert meta.values == real.values
    assert [lay.inputs for lay in meta.layers] == [lay.inputs for lay in real.layers]


def test_layers_override() -> None:
    model = M.llama()
    example = M.lm_batch()
    same = trace(model, example, layers=["model.embed_tokens", "model.layers.*", "model.norm", "lm_head"])
    assert [lay.name for lay in same.layers] == [lay.name for lay in trace(model, example).layers]
    coarse = trace(model, example, layers=["model.layers.*"])  # embedding/norm/head become glue
    assert [lay.name for lay in coarse.layers] == ["model.layers.0", "model.layers.1"]
    assert "model.embed_tokens.weight" in coarse.layers[0].params
    assert "lm_head.weight" in coarse.layers[-1].params
    assert torch.equal(coarse.run(example), model(**example).loss)
    with pytest.raises(ValueError, match="matches no module"):
        trace(model, example, layers=["model.blocks.*"])


def test_print_graph_table() -> None:
    text = str(trace(M.llama(), M.lm_batch()))
    assert "param bytes" in text and "model.layers.1" in text and "lm_head" in text


class _Gated(nn.Module):
    """A parameter-free glue module with data-dependent control flow."""

    def forward(self, x):
        if x.mean() > 0:
            return x * 2
        return x


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.gate = _Gated()

    def forward(self, x):
        for block in self.blocks:
            x = self.gate(block(x))
        return x.sum()


def test_untraceable_module_is_named() -> None:
    with pytest.raises(UntraceableError) as info:
        trace(_Untraceable(), torch.randn(2, 4))
    msg = str(info.value)
    assert "'gate'" in msg and "_Gated" in msg and "layers=" in msg and "if x.mean() > 0" in msg


class _AssertingGPT(M.NanoGPT):
    def forward(self, idx, targets):
        assert idx.size(1) <= 32, "sequence too long"
        return super().forward(idx, targets)


def test_untraceable_glue_in_forward_is_named() -> None:
    torch.manual_seed(0)
    with pytest.raises(UntraceableError) as info:
        trace(_AssertingGPT(M.GPTConfig()), M.token_batch(), loss_fn=M.gpt_loss)
    msg = str(info.value)
    assert "_AssertingGPT" in msg and "assert idx.size(1) <= 32" in msg and "layers=" in msg


class _ScalarAcross(nn.Module):
    """Layer 0's glue turns a tensor into a Python float that layer 1 reads."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        h = self.blocks[0](x)
        scale = h.detach().abs().max().item()
        return (self.blocks[1](h) * scale).sum()


def test_non_tensor_crossing_value_is_named() -> None:
    with pytest.raises(UntraceableError, match=r"value 'item'.*'blocks\.0'.*'blocks\.1'"):
        trace(_ScalarAcross(), torch.randn(2, 4))


def test_shape_value_is_recomputed_not_passed() -> None:
    graph = trace(M.gpt2(), M.lm_batch())  # GPT-2 builds output_shape from input_ids.size() before the blocks
    for value in graph.values.values():
        assert value.kind in ("input", "activation", "loss")
    ln_f = next(lay for lay in graph.layers if lay.name == "transformer.ln_f")
    assert all(graph.values[i].dtype.is_floating_point or i == "input_ids" for i in ln_f.inputs)


def test_import_without_cuda_or_transformers(tmp_path) -> None:
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import rpcompile, rpcompile.passes, rpcompile.runtime\n"
            "from rpcompile.passes import trace\n"
            "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr


def _padded(batch: int, seq: int, seed: int, pad: int) -> dict[str, torch.Tensor]:
    """An LM batch whose attention mask pads `pad` leading tokens of row 0 (all ones for pad=0)."""
    example = M.lm_batch(batch=batch, seq=seq, seed=seed)
    example["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    example["attention_mask"][0, :pad] = 0
    return example


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("pad", [0, 3])
def test_attention_masks_are_rebuilt_in_each_layer(attn: str, pad: int) -> None:
    model = M.llama(attn=attn)
    b, t = 2, 12  # t differs from every model dimension (head 8, hidden 32)
    graph = trace(model, _padded(b, t, 1, pad))  # the example's padding (none at all for pad=0) is not frozen
    for i in range(-1, len(graph.layers) - 1):
        for v in graph.live_at(i):
            assert v.shape[-2:] != (t, t), (i, v.name, v.shape)  # no S x S mask crosses a cut
    assert graph.values["attention_mask"].shape == (b, t)
    assert sum("attention_mask" in lay.inputs for lay in graph.layers) == model.config.num_hidden_layers
    for seed, other in ((2, 0), (3, 5), (4, 1)):  # padding that differs from batch to batch
        example = _padded(b, t, seed, other)
        assert torch.equal(graph.run(example), model(**example).loss), (seed, other)
    plain = trace(model, M.lm_batch(batch=b, seq=t))  # no mask input: causal only, rebuilt as well
    assert all(v.shape[-2:] != (t, t) for i in range(len(plain.layers) - 1) for v in plain.live_at(i))


def test_layer_patterns_keep_the_outermost_match_of_each_branch():
    block = lambda: nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))  # noqa: E731
    model = nn.ModuleDict({"layer1": block(), "layer10": block(), "layer1x": nn.Linear(2, 2)})
    # layer10.* and layer1x are not inside layer1 (a name prefix, not a dotted one); 1.0 is inside 1
    assert match_units(model, ["*", "*.*", "*.*.*"]) == ["layer1", "layer10", "layer1x"]
    assert match_units(model, ["layer10.*", "layer10.1.0", "layer1"]) == ["layer1", "layer10.0", "layer10.1"]


def test_layer_code_is_made_on_first_use_and_repeated_blocks_share_a_structure_key_as_their_code(monkeypatch):
    """Tracing makes no layer's Python code (a 94-block model plans with few of them ever run); layers get
    the same `structure_key` exactly when their code is the same up to block indices, and run as before."""
    import re

    import torch.fx as fx

    from rpcompile.passes.trace.split import structure_key
    made = []
    original = fx.Graph.python_code
    monkeypatch.setattr(fx.Graph, "python_code", lambda self, *a, **k: made.append(1) or original(self, *a, **k))
    example = M.lm_batch()
    graph = trace(M.qwen3(), example)
    assert len(graph.layers) > 3 and not made
    keys = [structure_key(layer.module) for layer in graph.layers]
    codes = [re.sub(r"\d+", "#", layer.module.code) for layer in graph.layers]
    assert made and len(set(codes)) < len(codes)  # the blocks repeat
    assert all((keys[i] == keys[j]) == (codes[i] == codes[j]) for i in range(len(keys)) for j in range(len(keys)))
    assert torch.equal(graph.run(example), M.qwen3()(**example).loss)
