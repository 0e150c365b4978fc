"""Mixture-of-experts models trace on the meta device with balanced routing."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rpcompile.passes.meta.moe import balanced_experts
from rpcompile.passes.trace import trace

models = pytest.importorskip("tests.models")
pytest.importorskip("transformers")


def _meta_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**models._tiny(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, decoder_sparse_step=1),
                         attn_implementation="eager", use_cache=False)
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(cfg)


def test_meta_moe_records_the_same_values_as_the_real_model():
    real = trace(models.qwen3_moe(), models.lm_batch())
    meta = trace(_meta_moe(), models.lm_batch())
    assert [layer.name for layer in meta.layers] == [layer.name for layer in real.layers]
    for name, v in real.values.items():
        assert (meta.values[name].shape, meta.values[name].dtype) == (v.shape, v.dtype), name


def test_balanced_routing_counts_tokens_times_top_k_over_experts():
    moe = models.qwen3_moe().model.layers[0].mlp
    x = torch.randn(16, 32)  # 16 tokens, top-2 of 4 experts: 8 tokens per expert
    with balanced_experts(moe) as patched, FlopCounterMode(display=False) as fc:
        out = moe.experts(x, torch.zeros(16, 2, dtype=torch.long), torch.ones(16, 2))
    assert patched == 1 and out.shape == x.shape
    per_expert = 2 * 8 * 32 * (2 * 32) + 2 * 8 * 32 * 32  # gate_up then down, 2 FLOPs per MAC
    assert fc.get_total_flops() == 4 * per_expert
    assert "forward" not in vars(moe.experts)  # the patch is gone after the block
