"""Standard Hugging Face stacks train equal to eager PyTorch (issue 14, item 6).

Each model is passed to `rpcompile.compile` as a user would (no `layers=`, no
`loss_fn=`, no `use_cache` tweak): BERT masked LM and T5 compute their loss inside
`forward` with a `CrossEntropyLoss()` built there, T5 shifts its labels right by
item assignment (`_shift_right`) and has an encoder stack beside its decoder, and
a peft LoRA model hides `use_cache` behind `forward(**kwargs)`. Two steps at
staleness 0 in fp32: the losses and every updated parameter equal an eager
AdamW loop over the mean of the microbatch losses within 1e-5.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn


import models  # noqa: E402
import rpcompile  # noqa: E402
from oracle import eager_optimizer  # noqa: E402

transformers = pytest.importorskip("transformers")

OPT = rpcompile.AdamW(lr=1e-2, eps=1e-4, impl="foreach")
MICROBATCHES = 2
STEPS = 2


def bert() -> nn.Module:
    """Tiny BertForMaskedLM (eager attention, dropout off; its MLM head is tied to the word embeddings)."""
    cfg = transformers.BertConfig(vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return models._build("BertForMaskedLM", cfg, seed=0)


def bert_batch(seed: int, batch: int = 4, seq: int = 8) -> dict[str, torch.Tensor]:
    """Token ids and masked-LM labels: -100 (ignored) at about half the positions, never at position 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.VOCAB, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) < 0.5
    keep[:, 0] = True
    return {"input_ids": ids, "labels": torch.where(keep, ids, -100)}


def t5() -> nn.Module:
    """Tiny T5ForConditionalGeneration (2 encoder + 2 decoder blocks, tied embeddings, dropout off)."""
    cfg = transformers.T5Config(vocab_size=models.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return models._build("T5ForConditionalGeneration", cfg, seed=0)


def t5_batch(seed: int, batch: int = 4, seq: int = 8, target: int = 6) -> dict[str, torch.Tensor]:
    """Source ids and shorter target labels whose last positions are -100 (`_shift_right` turns them into pad)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, models.VOCAB, (batch, seq), generator=g)
    labels = torch.randint(1, models.VOCAB, (batch, target), generator=g)
    labels[:, -2:] = -100
    return {"input_ids": ids, "labels": labels}


def lora_llama() -> nn.Module:
    """peft.get_peft_model on the tiny Llama: LoRA (r 4) on q_proj and v_proj, the base frozen."""
    peft = pytest.importorskip("peft", reason="peft is an optional test dependency (pip install peft)")
    base = models.llama()
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                          init_lora_weights="gaussian")  # B != 0: both LoRA factors get a gradient
    return peft.get_peft_model(base, cfg)


def lm_batch(seed: int) -> dict[str, torch.Tensor]:
    """Causal-LM ids and labels (the model shifts them itself)."""
    return models.lm_batch(batch=4, seq=8, seed=seed)


def mean_microbatch_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The runtime's loss: the mean of the model's loss over contiguous microbatch slices."""
    parts = [dict(zip(batch, p)) for p in zip(*(v.chunk(MICROBATCHES) for v in batch.values()))]
    return sum(model(**p).loss for p in parts) / MICROBATCHES


def eager_train(model: nn.Module, batches: list[dict]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a copy of `model` with torch.optim.AdamW over its trainable parameters; (losses, parameters)."""
    model = copy.deepcopy(model)
    opt = eager_optimizer(OPT, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss = mean_microbatch_loss(model, b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def check_trains_like_eager(model: nn.Module, make_batch, layers: list[str] | None = None,
                            lm_head_shards: int | str = 1) -> None:
    """Compile `model` as a user would, run STEPS steps and compare with `eager_train`.

    `layers`: the expected leading layer names (the LM head may be cut into shards after them).
    `lm_head_shards` is 1 by default only to keep the test fast (no second cost measurement).
    """
    batches = [make_batch(s) for s in range(STEPS)]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    want, ref = eager_train(model, batches)
    with rpcompile.compile(model, gpus=2, example=batches[0], microbatches=MICROBATCHES, staleness=0,
                           optimizer=OPT, dtype=torch.float32, lm_head_shards=lm_head_shards, backend="host") as c:
        if layers is not None:
            assert [lay.name for lay in c.graph.layers][:len(layers)] == layers
        got = [c.step(b) for b in batches]
        end = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    assert got == pytest.approx(want, abs=1e-5, rel=1e-5)
    assert set(end) == set(ref)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(not torch.equal(end[n], start[n]) for n in trained), "a parameter did not train"
    for n in ref:
        torch.testing.assert_close(end[n], ref[n], atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_bert_masked_lm_trains_like_eager():
    """The loss comes from `CrossEntropyLoss()` built inside forward; BertEmbeddings (tied, so traced through)
    slices its `position_ids` / `token_type_ids` buffers by the input's length."""
    check_trains_like_eager(bert(), bert_batch,
                            ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"])


def test_t5_conditional_generation_trains_like_eager():
    """`_shift_right` assigns items (and masked_fill_s -100 to pad); the loss is computed inside forward;
    both the encoder's and the decoder's blocks are layers; the LM head is sharded as compile chooses."""
    stack = lambda s: [f"{s}.embed_tokens", f"{s}.block.0", f"{s}.block.1", f"{s}.final_layer_norm"]  # noqa: E731
    check_trains_like_eager(t5(), t5_batch, [*stack("encoder"), *stack("decoder")],
                            lm_head_shards="auto")


def test_peft_lora_llama_trains_like_eager():
    """A PeftModel passed directly: its forward(**kwargs) hides `use_cache`, so no cache may be built."""
    model = lora_llama()
    config_use_cache = model.config.use_cache
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    check_trains_like_eager(model, lm_batch)
    assert model.config.use_cache == config_use_cache  # the user's config is left as it was
