"""Models to compile: a small Llama in plain PyTorch, the RoundPipe paper's five models, the demo's data.

The fifth layer of the package, beside `rpcompile.finetune` (ir < passes < runtime < driver < models,
finetune < cli): libraries built on the driver, used by the command line and the examples.

    zoo.py        `TinyLlama` / `LlamaConfig`: a Llama-style causal LM (no transformers needed)
    demo.py       the demo's data: this repository's text as byte tokens (`corpus`, `batches`, `DemoConfig`)
    presets.py    the five paper models on the `meta` device from their public configs (`MODELS`, `build_meta`)
    planning.py   `plan_model`: plan a preset for a machine you may not have, beside bound-stage baselines
    attention.py  memory-efficient attention for transformers models with no SDPA path (attention sinks)

    >>> from rpcompile.models.zoo import LlamaConfig, TinyLlama
    >>> TinyLlama(LlamaConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=32)).cfg.layers
    2
"""
