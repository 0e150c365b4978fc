"""The example scripts run end to end with their smallest settings (each as a subprocess)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "3", "--batch", "4", "--microbatches", "2", "--seq", "32", "--layers", "2"]


def run_example(name: str, *args: str) -> str:
    """Run examples/<name> with `args`; returns its stdout (fails with stderr on a non-zero exit)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_train_tiny_llama_trains_saves_and_resumes(tmp_path):
    out = run_example("train_tiny_llama.py", *SMALL, "--save", str(tmp_path / "ckpt.rp"))
    assert "plan " in out and "share of t_max" in out
    assert "reloaded at step 3" in out
    assert "resumed training: step 4" in out
    assert (tmp_path / "ckpt.rp").exists()


def test_finetune_transformers():
    pytest.importorskip("transformers")
    out = run_example("finetune_transformers.py", *SMALL)
    assert "LlamaForCausalLM:" in out
    assert "step   3" in out and "fine-tuned: loss on the first batch" in out


def test_lora_keeps_the_base_and_trains_the_adapters():
    pytest.importorskip("transformers")
    out = run_example("lora.py", *SMALL)
    assert re.search(r"base weights unchanged \(bit for bit\): True; adapters changed: (\d+)/\1\b", out), out
    assert "x smaller" in out


def test_plan_paper_models_one_model():
    pytest.importorskip("transformers")
    out = run_example("plan_paper_models.py", "--models", "qwen3-1.7b")
    row = next(line for line in out.splitlines() if line.startswith("qwen3-1.7b "))
    assert "1.72 B" in row and "28" in row
