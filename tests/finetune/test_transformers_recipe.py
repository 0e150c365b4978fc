"""A fine-tuning run is the same recipe as in transformers: Trainer's weight-decay groups, get_scheduler's lr,
and at staleness 0 the same losses and weights as a plain transformers loop on the same batches.

The model is a tiny Qwen2 (biases on q/k/v, RMSNorm), saved locally with the fixtures' tokenizer; the data
are short two-turn chats (tests/hf_fixtures.py).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile import checkpoint  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune import FinetuneConfig, finetune  # noqa: E402
from rpcompile.finetune.hf import add_lora, decay_parameters, trainable_module  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT, RUN_FILE  # noqa: E402
import hf_fixtures as fx  # noqa: E402
import models  # noqa: E402

RECIPE = dict(seq=32, micro_batch_size=1, microbatches=8, gpus=2, staleness=0, dtype="fp32", lr=2e-3, warmup=4,
              weight_decay=0.1, max_grad_norm=1.0, steps=8, schedule="cosine", packing="none", progress=False,
              memory_gib=2**19 / 2**30, lm_head_shards=1)


def qwen2(tok=None, seed: int = 0):
    """A tiny Qwen2ForCausalLM for the fixtures' tokenizer (random weights, train mode)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tok or fx.tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=fx.POSITIONS,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).train()


def short_chats(n: int = 48) -> list[dict]:
    """Two-turn chats of a few words each (a question, a reply), from the corpus lines."""
    rows = []
    for line in fx.corpus_lines():
        words = line.split()
        if len(words) >= 10:
            rows.append({"messages": [{"role": "user", "content": " ".join(words[:4])},
                                      {"role": "assistant", "content": " ".join(words[4:10])}]})
    return rows[:n]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    tok = fx.tokenizer()
    folder = str(d / "qwen2")
    qwen2(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return SimpleNamespace(model=folder, chat=fx.write_jsonl(d / "chat.jsonl", short_chats()),
                           llama=fx.model_folder(d / "llama"))


def trainer_decay(model) -> set[str]:
    """transformers' own rule, as Trainer's optimizer groups it: decayed names that require grad."""
    from transformers import Trainer
    names = set(Trainer.get_decay_parameter_names(object.__new__(Trainer), model))
    return {n for n, p in model.named_parameters() if n in names and p.requires_grad}


def no_norm_no_bias(module) -> set[str]:
    """The names Trainer should decay, by structure: trainable, not a bias, not in a *Norm module."""
    owners = dict(module.named_modules())
    return {n for n, p in module.named_parameters() if p.requires_grad and not n.endswith(".bias")
            and "norm" not in type(owners[n.rpartition(".")[0]]).__name__.lower()}


@pytest.mark.parametrize("build", [models.llama, models.qwen3, models.qwen3_moe, models.gpt2, qwen2])
def test_decay_applies_to_trainers_decay_parameters_for_each_architecture(build):
    model = build()
    got = decay_parameters(model)
    assert got == trainer_decay(model) == no_norm_no_bias(model)
    assert len(got) < len(dict(model.named_parameters()))  # some norm weight or bias is left out


def test_lora_decays_the_adapters_under_the_compiled_modules_names(files):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    peft_model = add_lora(AutoModelForCausalLM.from_pretrained(files.model), 4, targets=["q_proj", "v_proj"])
    module = trainable_module(peft_model)
    adapters = {n for n, p in module.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert decay_parameters(peft_model) == adapters  # Trainer decays every adapter weight; named as compiled
    assert {f"base_model.model.{n}" for n in adapters} == trainer_decay(peft_model)


@pytest.mark.parametrize("decay_all", [False, True])
def test_decay_all_is_recorded_and_reaches_the_optimizer(files, tmp_path, decay_all):
    out = tmp_path / "out"
    args = ["--model", files.llama, "--data", files.chat, "--out", str(out), "--seq", "32", "--microbatches", "2",
            "--gpus", "2", "--steps", "2", "--save-every", "2", "--weight-decay", "0.1", "--no-progress",
            "--memory-gib", str(RECIPE["memory_gib"]), "--lm-head-shards", "1"] + ["--decay-all"] * decay_all
    assert main(["finetune", *args]) == 0
    with open(out / RUN_FILE) as f:
        assert json.load(f)["settings"]["decay_all"] is decay_all
    opt = checkpoint.load(str(out / CHECKPOINT))["options"]["optimizer"]
    names = {n for n, _ in torch.nn.Module.named_parameters(_llama(files))}
    assert opt.weight_decay == 0.1
    assert set(opt.decay if opt.decay is not None else names) == (names if decay_all else no_norm_no_bias(
        _llama(files)))


def _llama(files):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(files.llama)


def transformers_loop(folder: str, batches: list[dict], cfg: dict) -> tuple[list[float], dict]:
    """Trainer's recipe written out: its decay groups, get_scheduler, token-mean loss over the step's
    microbatches (num_items_in_batch), clip_grad_norm_, AdamW; returns the step losses and the weights."""
    from transformers import AutoModelForCausalLM, get_scheduler
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    decay = trainer_decay(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n in decay]},
                             {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0}],
                            lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = get_scheduler(cfg["schedule"], opt, num_warmup_steps=cfg["warmup"], num_training_steps=cfg["steps"])
    losses = []
    for b in batches:
        n = int((b["labels"][:, 1:] != -100).sum())
        total = 0.0
        for r in range(b["input_ids"].shape[0]):  # microbatches of one sequence, as the run's
            logits = model(input_ids=b["input_ids"][r:r + 1], position_ids=b["position_ids"][r:r + 1]).logits
            nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), b["labels"][r, 1:], reduction="sum")
            (nll / n).backward()
            total += nll.item()
        losses.append(total / n)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_a_run_with_warmup_decay_and_clipping_equals_the_transformers_loop(files, tmp_path, monkeypatch):
    batches, losses = [], []
    real = rpcompile.Compiled.step

    def step(self, batch):
        batches.append({k: v.clone() for k, v in batch.items()})
        losses.append(real(self, batch))
        return losses[-1]
    monkeypatch.setattr(rpcompile.Compiled, "step", step)
    r = finetune(FinetuneConfig(model=files.model, data=files.chat, out=str(tmp_path / "out"), **RECIPE))
    assert r.losses == losses and len(batches) == RECIPE["steps"]
    want, weights = transformers_loop(files.model, batches, RECIPE)
    assert r.losses == pytest.approx(want, rel=1e-5, abs=0)
    from safetensors.torch import load_file
    got = load_file(os.path.join(tmp_path / "out", "model.safetensors"))
    assert got.keys() == weights.keys()
    assert max((got[k] - weights[k]).abs().max().item() for k in got) < 1e-5
    start = load_file(os.path.join(files.model, "model.safetensors"))
    norm = "model.norm.weight"  # an RMSNorm gain: trained, never decayed
    assert not torch.equal(got[norm], start[norm])
