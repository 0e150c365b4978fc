"""Fine-tune a local Hugging Face model folder on a data file with your own loop.

What `python -m rpcompile finetune` does, written out: read the data (chat
rows train the assistant replies: `--train-on`), pack it so documents stay
apart (`--packing`: positions restart per document), load the model offline,
compile it for RoundPipe with the token-weighted loss (`loss_mean="tokens"`),
set the scheduled learning rate before every step, and `save_pretrained` the
result. Add LoRA with
`rpcompile.finetune.hf.add_lora` (compile `trainable_module(peft_model)`), an eval
loop with `c.evaluate(batch)`, checkpoints with `c.save(path)`.

    python examples/finetune_hf.py --model ./Qwen3-1.7B --data chat.jsonl --out ./tuned --steps 100 --seq 1024 \
        --train-on assistant --packing whole
"""
from __future__ import annotations

import argparse

import torch

import rpcompile
from rpcompile.finetune.data import PACKINGS, TRAIN_ON, pack, read_documents, read_template
from rpcompile.finetune.hf import export, load_model, load_tokenizer
from rpcompile.finetune.schedule import lr_at


def main(argv: list[str] | None = None) -> list[float]:
    """Train `--steps` steps and write `--out`; returns the losses."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--model", "--data", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq", type=int, default=512, help="tokens per packed sequence")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2, help="workers")
    p.add_argument("--microbatches", type=int, default=4, help="one sequence each")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--train-on", choices=TRAIN_ON, help="default: assistant for chat rows, all for text")
    p.add_argument("--packing", choices=PACKINGS, default="whole")
    p.add_argument("--chat-template", help="a jinja chat template file instead of the tokenizer's")
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    if args.chat_template:
        tokenizer.chat_template = read_template(args.chat_template)  # also saved with the model
    docs = read_documents(args.data, tokenizer, train_on=args.train_on)  # each with its trained characters
    # batches of input_ids, labels (-100: not trained) and position_ids (0 at each document start)
    data = pack(docs, tokenizer, seq=args.seq, packing=args.packing)
    print(f"{len(docs)} rows, {data.documents} documents, {len(data)} sequences, {data.trained} trained tokens, "
          f"{data.truncated} documents truncated")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = load_model(args.model, dtype=dtype)  # AutoModelForCausalLM, offline, use_cache=False
    c = rpcompile.compile(model, gpus=args.gpus, example=data.batch(0, args.microbatches, seed=0),
                          microbatches=args.microbatches, dtype=dtype, loss_mean="tokens",
                          optimizer=rpcompile.AdamW(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0))
    print(c.plan)
    losses = []
    with c:
        for t in range(args.steps):
            c.set_lr(lr_at(t, lr=args.lr, total=args.steps, warmup=args.steps // 10))  # this step's update
            losses.append(c.step(data.batch(t, args.microbatches, seed=0)))
            print(f"step {t + 1}: loss {losses[-1]:.4f}", flush=True)
        c.model()  # every update into `model`, the pending staleness-1 one too
    export(model, tokenizer, args.out)  # save_pretrained: AutoModelForCausalLM.from_pretrained(args.out) loads it
    print(f"wrote {args.out}")
    return losses


if __name__ == "__main__":
    main()
