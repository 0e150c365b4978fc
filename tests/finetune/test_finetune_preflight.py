"""Before a fine-tuning run trains (issue 25): the dry run, the checks before the weights load (host memory,
the extras it needs) and the RAM that check counts against a real run's peak RSS."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import hf_fixtures as fx  # noqa: E402
from test_finetune_run import errors, run  # noqa: E402 - the same command line (FLAGS) and error lines


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune_preflight")
    rows = fx.text_rows()
    return SimpleNamespace(model=fx.model_folder(d / "tiny"), train=fx.write_jsonl(d / "train.jsonl", rows[:40]))


def _no_weights(monkeypatch):
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_dry_run_prints_the_plan_and_memory_and_writes_nothing(files, tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    out = tmp_path / "o"
    assert run(files, out, "--dry-run") == 0
    text = capsys.readouterr().out
    for what in ("data ", "plan (predicted", "device peak per worker", "host memory:", "fp32 masters",
                 "max_seq_len: ", "dry run:"):
        assert what in text, what
    assert not out.exists()
    out.mkdir()
    assert run(files, out, "--dry-run", "--lora", "4") == 0  # LoRA on meta too
    assert os.listdir(out) == []


def test_dry_run_prints_the_parameter_state_of_the_state_dtype(files, tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    per = {}
    for dtype in ("fp32", "bf16"):
        assert run(files, tmp_path / "o", "--dry-run", "--state-dtype", dtype) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameter state: "))
        assert line.endswith(f", {dtype} moments (--state-dtype)"), line
        per[dtype] = float(line.split()[2])
    assert per["fp32"] - per["bf16"] == 4.0  # two moments of 2 bytes instead of 4
    assert not (tmp_path / "o").exists()
    assert run(files, tmp_path / "o", "--dry-run", "--state-dtype", "bf16", "--master-dtype", "bf16") == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameter state: "))
    assert line.endswith(", bf16 moments (--state-dtype), bf16 master (--master-dtype)"), line
    assert per["bf16"] - float(line.split()[2]) == 2.0 and "master 2.0" in line  # a bf16 master: 2 bytes, not 4
    assert not (tmp_path / "o").exists()
    assert run(files, tmp_path / "o", "--dry-run", "--state-dtype", "bf16", "--master-dtype", "bf16",
               "--grad-dtype", "bf16") == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameter state: "))
    assert line.endswith(", bf16 master (--master-dtype), bf16 gradients (--grad-dtype)"), line
    assert per["bf16"] - float(line.split()[2]) == 4.0 and "gradient 2.0" in line  # and a bf16 gradient: 2, not 4
    assert not (tmp_path / "o").exists()


def test_a_host_too_small_is_refused_before_the_weights_load(files, tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**18)
    assert run(files, tmp_path / "o") == 2
    err = errors(capsys)
    assert len(err) == 1 and "host memory: the run needs" in err[0]


def test_without_transformers_one_line_names_the_extra(files, tmp_path, monkeypatch, capsys):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        find(name, *a))
    assert run(files, tmp_path / "o") == 2
    assert errors(capsys) == ['python -m rpcompile finetune: error: finetune needs transformers, peft and '
                              'tokenizers: pip install "rpcompile[finetune]"']


def test_report_to_tensorboard_without_it_names_the_extra(files, tmp_path, monkeypatch, capsys):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        find(name, *a))
    assert run(files, tmp_path / "o", "--report-to", "tensorboard") == 2
    err = errors(capsys)
    assert len(err) == 1 and 'rpcompile[tensorboard]' in err[0]
    assert not (tmp_path / "o").exists()  # refused before anything was written


PEAK_RSS = r"""
import resource, sys
from rpcompile.cli.main import main
rc = main(sys.argv[1:])
print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")  # Linux counts KiB
sys.exit(rc)
"""


def test_the_ram_a_run_is_said_to_need_on_host_workers_is_its_peak_rss_within_25_percent(tmp_path):
    """A 17.7M-parameter Llama on 2 host workers (fp32, seq 128): the RAM the pre-load check counts (host state,
    the loaded model and the runtime's buffers, every worker's device peak, the process's RSS at the check and the
    runtime's threads and libraries) against the run's peak RSS in a fresh process, on whatever torch build is
    installed (2.14's CUDA build maps 426 MiB more at import than 2.13's CPU build); the host state alone is a
    quarter of it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if sys.platform != "linux":
        pytest.skip("ru_maxrss in KiB is Linux's")
    tok = fx.tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "mid")
    tok.save_pretrained(tmp_path / "mid")
    data = fx.write_jsonl(tmp_path / "d.jsonl", fx.text_rows() * 4)
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, "finetune", "--model", str(tmp_path / "mid"), "--data", data,
                        "--out", str(tmp_path / "o"), "--seq", "128", "--steps", "3", "--gpus", "2", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    said = re.search(r"host memory: ([\d.]+) GiB of [\d.]+ GiB RAM: host state ([\d.]+) MiB .* \+ 2 host workers' "
                     r"device peaks ([\d.]+) MiB \(RAM here\) \+ this process so far \(Python, torch, the data\) "
                     r"([\d.]+) MiB \+ the runtime's threads and libraries 256.0 MiB", r.stdout)
    assert said, r.stdout
    predicted, state = float(said.group(1)) * 2**30, float(said.group(2)) * 2**20
    assert float(said.group(4)) > 200  # at least Python, torch and transformers: read, not zero
    peak = int(re.search(r"peak RSS (\d+)", r.stdout).group(1))
    assert abs(peak - predicted) <= 0.25 * predicted, (peak / 2**20, predicted / 2**20)
    assert state < 0.3 * peak  # what the check counted before: the host state alone


def test_dry_run_max_seq_len_is_for_the_micro_batch_size_given(files, tmp_path, monkeypatch, capsys):
    """Four sequences per microbatch hold four times the activations of one: a shorter max_seq_len."""
    _no_weights(monkeypatch)
    lengths = {}
    for mbs in ("1", "4"):
        assert run(files, tmp_path / "o", "--dry-run", "--micro-batch-size", mbs, "--memory-gib", str(2**22 / 2**30)) == 0
        found = re.search(r"max_seq_len: ([\d,]+) tokens; at [\d,]+ the (.+?) needs", capsys.readouterr().out)
        assert found, mbs
        lengths[mbs] = (int(found.group(1).replace(",", "")), found.group(2))
    assert lengths["4"][0] < 0.6 * lengths["1"][0], lengths


def test_resident_bytes_is_this_process_rss_now_and_follows_an_allocation():
    """What the check reads as the process's own footprint is its current RSS (VmRSS), not its peak or a constant:
    it grows by a touched 64 MiB block and falls back when the block is freed."""
    from rpcompile.finetune.preflight import resident_bytes
    if sys.platform != "linux":
        pytest.skip("VmRSS is Linux's")

    def vmrss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    assert abs(resident_bytes() - vmrss()) < 8 * 2**20
    before = resident_bytes()
    block = torch.ones(64 * 2**20 // 4)
    grown = resident_bytes()
    assert grown - before > 60 * 2**20
    del block
    assert grown - resident_bytes() > 60 * 2**20


def test_resident_bytes_without_proc_is_the_peak_rss_in_bytes(monkeypatch):
    """Where /proc/self/statm cannot be read, the check reads the peak RSS, converted to bytes (Linux counts
    it in KiB, macOS in bytes): at least what the process holds now, never a thousandth of it."""
    from rpcompile.finetune import preflight
    if sys.platform != "linux":
        pytest.skip("the KiB peak is Linux's")
    now = preflight.resident_bytes()

    def unreadable(path, *args, **kwargs):
        raise OSError(f"{path}: no /proc here")
    monkeypatch.setattr(preflight, "open", unreadable, raising=False)  # the module's `open`, not the builtin
    peak = preflight.resident_bytes()
    import resource
    assert peak == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 and peak >= now


def test_dry_run_max_seq_len_cuts_the_blocks_where_compile_does(files, tmp_path, monkeypatch, capsys):
    """Past the length where a whole decoder block no longer fits a worker, compile cuts the blocks into
    sub-blocks (norms, attention, MLP): the dry run's limit goes on with them, so what stops it is a
    sub-block's backward stage, not a whole block's (where the limit stopped before)."""
    _no_weights(monkeypatch)
    assert run(files, tmp_path / "o", "--dry-run", "--memory-gib", str(2**22 / 2**30)) == 0
    found = re.search(r"max_seq_len: ([\d,]+) tokens; at [\d,]+ the device: backward stage of layer \d+ '([\w.]+)'",
                      capsys.readouterr().out)
    assert found and re.fullmatch(r"model\.layers\.\d+\.\w+", found.group(2)), found and found.groups()


def test_the_dry_run_says_when_compile_chose_its_host_lean_plan() -> None:
    # where the partitioner's plan is over the host, compile takes the host-lean one and its report says so
    # (passes.partition.host_lean); the dry run's lines end with that note, after the five findings
    from rpcompile.finetune.preflight import Preflight
    from rpcompile.hostmem import HostBytes
    from rpcompile.ir.costs import CostTable
    from rpcompile.ir.hardware import Hardware
    from rpcompile.ir.plan import StagePlan
    from rpcompile.passes import with_report
    costs, plan = CostTable.from_lists([1.0] * 3, [2.0] * 3), StagePlan.from_str("1,1|1|1,1")
    found = dict(hardware=Hardware.preset("cpu"), program=None, peaks=(1, 1), budget=None,
                 host=HostBytes(0, 40, 40, 80, 0, 0), host_limit=2**30, workers_ram=0, buffers=0, seq_limit=None,
                 seq_limit_why="-", iteration=1.0, gemm_rate="bfloat16")
    lean = with_report(plan, costs, gpus=2, microbatches=2, note="host-lean plan: the partitioner's ...")
    assert Preflight(plan=lean, **found).lines()[5:] == ["host-lean plan: the partitioner's ..."]
    assert len(Preflight(plan=with_report(plan, costs, gpus=2, microbatches=2), **found).lines()) == 5
