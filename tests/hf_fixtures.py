"""Tiny Hugging Face fixtures for the finetune tests, built locally (nothing is downloaded).

`model_folder(path)` writes a 2-layer LlamaForCausalLM (hidden 32) with
`save_pretrained`, and beside it a byte-level BPE tokenizer trained on a small
text (the repository's README), wrapped as `PreTrainedTokenizerFast`, with EOS,
pad and a chat template. `turn_tokenizer()` is the same tokenizer with a
chat template of distinct turn markers (<|im_start|>role ... <|im_end|>, added
as special tokens) and a generation prompt, for the loss-masking tests;
`model_folder(path, tok=turn_tokenizer())` saves a model sized for it.
`write_jsonl` / `write_txt` make data files.

    >>> folder = model_folder(tmp_path / "tiny")                 # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(folder)             # doctest: +SKIP
"""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 300  # BPE vocabulary (256 bytes + 4 specials + merges)
POSITIONS = 64  # max_position_embeddings of the tiny model
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
TURN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TURN_MARKERS = ["<|im_start|>", "<|im_end|>"]


def corpus_lines() -> list[str]:
    """Non-blank lines of the README: the tokenizer's training text and the fine-tuning documents."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


def tokenizer(chat: bool = True):
    """A byte-level BPE tokenizer with <eos>, <pad> and (optionally) a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<pad>", "<eos>", "<bos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def turn_tokenizer(chat: bool = True):
    """`tokenizer(chat=False)` with the turn markers as special tokens and (optionally) TURN_TEMPLATE."""
    fast = tokenizer(chat=False)
    fast.add_special_tokens({"additional_special_tokens": TURN_MARKERS})
    if chat:
        fast.chat_template = TURN_TEMPLATE
    return fast


def model_folder(path, *, with_tokenizer: bool = True, seed: int = 0, tok=None) -> str:
    """Write the tiny Llama (and its tokenizer: `tok`, default `tokenizer()`) to `path`; returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = str(path)
    tok = tok if tok is not None else tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    if with_tokenizer:
        tok.save_pretrained(folder)
    return folder


def write_jsonl(path, rows: list[dict]) -> str:
    """Write one JSON object per line; returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def text_rows(n: int | None = None) -> list[dict]:
    """{"text": line} rows from the corpus."""
    return [{"text": line} for line in corpus_lines()[:n]]


def write_txt(path, lines: list[str]) -> str:
    """Write lines to a .txt file; returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if lines else ""))
    return str(path)
