"""`finetune` end to end (issue 16): train, export, resume bit for bit, LoRA and --merge, bad input.

Fixtures are built locally (tests/hf_fixtures.py): a 2-layer Llama (hidden 32,
a ~300-token BPE vocabulary, 64 positions) saved with save_pretrained, and JSONL
files of the README's lines. Every run uses 2 host workers and a memory budget
small enough that the model runs as a multi-stage pipeline.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from rpcompile import checkpoint  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
from rpcompile.finetune import FinetuneConfig, finetune  # noqa: E402
from rpcompile.finetune.data import pack, read_documents  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
from rpcompile.finetune.run import CHECKPOINT  # noqa: E402
import hf_fixtures as fx  # noqa: E402

SMALL = dict(seq=32, micro_batch_size=2, microbatches=2, gpus=2, lr=3e-3, warmup=3, progress=False,
             memory_gib=2**19 / 2**30, lm_head_shards=1)  # one head shard: a short plan, quick on 2 cores


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    rows = fx.text_rows()
    return SimpleNamespace(dir=d, model=fx.model_folder(d / "tiny"),
                           train=fx.write_jsonl(d / "train.jsonl", rows[:60]),
                           eval=fx.write_jsonl(d / "eval.jsonl", rows[60:76]))


def config(files, out, **kw) -> FinetuneConfig:
    return FinetuneConfig(model=files.model, data=files.train, out=str(out), **{**SMALL, **kw})


def hf_loss(model, data_file) -> float:
    """The handle's eval loss computed by transformers: each packed document alone (its own forward), the NLL
    summed over every trained target / their number (the token-weighted loss)."""
    return hf_eval(model, data_file)[0]


def hf_eval(model, data_file) -> tuple[float, float, int]:
    """`hf_loss`, the token accuracy (trained targets that are the logits' argmax / their number), that number."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(files_model_of(model))
    p = pack(read_documents(data_file, tok), tok, SMALL["seq"])
    total, right = 0.0, 0
    for r in range(len(p)):
        starts = [i for i, x in enumerate(p.positions[r].tolist()) if x == 0] + [p.ids.shape[1]]
        for a, b in zip(starts, starts[1:]):  # a document (or the padding, which trains nothing)
            labels = p.labels[r, a:b]
            if (labels[1:] != -100).any():
                with torch.no_grad():
                    logits = model(input_ids=p.ids[r:r + 1, a:b]).logits[0].float()
                total += torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100,
                                                           reduction="sum").item()
                right += int(((logits[:-1].argmax(-1) == labels[1:]) & (labels[1:] != -100)).sum())
    return total / p.trained, right / p.trained, p.trained


def files_model_of(model) -> str:
    """The folder a (peft or plain) model was loaded from, for its tokenizer."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config._name_or_path


def tensors(folder, name="model.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, name))


def test_thirty_steps_lower_the_loss_and_the_folder_loads_with_the_handles_loss(files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    before = hf_loss(AutoModelForCausalLM.from_pretrained(files.model), files.eval)
    r = finetune(config(files, tmp_path / "out", steps=30, eval=files.eval, eval_every=10))
    assert r.steps == 30 and len(r.losses) == 30
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.3, r.losses
    assert [s for s, _ in r.evals] == [0, 10, 20, 30] and r.evals[-1][1] < before - 0.3
    assert abs(r.evals[0][1] - before) < 1e-5  # the step-0 eval: the untrained model

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token == "<eos>" and model.config.use_cache
    loss, accuracy, trained = hf_eval(model, files.eval)
    assert abs(loss - r.evals[-1][1]) < 1e-5  # the handle's final evaluate
    evals = [x for x in read_metrics(os.path.join(tmp_path / "out", "metrics.jsonl")) if "eval_loss" in x]
    assert [x["step"] for x in evals] == [0, 10, 20, 30] and evals[-1]["eval_loss"] == r.evals[-1][1]
    assert accuracy > 0.05 and abs(evals[-1]["eval_token_accuracy"] - accuracy) < 1.5 / trained  # a near tie at most
    start = tensors(files.model)
    assert all(not torch.equal(t, start[k]) for k, t in tensors(tmp_path / "out").items() if "norm" not in k)


def test_resume_from_step_10_is_bit_identical_to_an_uninterrupted_run(files, tmp_path):
    # the two runs are compiled apart, so the plan must not depend on timing noise where it changes the
    # arithmetic: SMALL fixes the head shards (lm_head_shards="auto" picks K from measured times)
    ckpt = dict(save_every=10)
    full = finetune(config(files, tmp_path / "full", steps=20, **ckpt))

    class Crash(Exception):
        pass

    def crash_at_10(step, loss):
        if step == 10:
            raise Crash

    with pytest.raises(Crash):
        finetune(config(files, tmp_path / "split", steps=20, **ckpt), on_step=crash_at_10)
    assert checkpoint.load(str(tmp_path / "split" / CHECKPOINT))["steps"] == 10
    with pytest.raises(ValueError, match=r"--resume: the settings differ .* lr=0.003 then, 0.001 now"):
        finetune(config(files, tmp_path / "split", steps=20, resume=True, lr=1e-3, **ckpt))
    rest = finetune(config(files, tmp_path / "split", steps=20, resume=True, eval=files.eval, eval_every=5,
                           **ckpt))  # evaluating in between changes nothing
    assert rest.steps == 20 and rest.losses == full.losses[10:]  # exact floats

    a, b = tensors(tmp_path / "full"), tensors(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ha = checkpoint.load(str(tmp_path / "full" / CHECKPOINT))["host"]
    hb = checkpoint.load(str(tmp_path / "split" / CHECKPOINT))["host"]
    for part in ("compute", "master"):
        assert all(torch.equal(ha[part][k], hb[part][k]) for k in ha[part])
    assert all(torch.equal(v, hb["optim"][n][s]) for n, st in ha["optim"].items() for s, v in st.items())


def chat_rows(n=40) -> list[dict]:
    """Two-turn chats made of corpus lines."""
    rows = fx.text_rows(n)
    return [{"messages": [{"role": "user", "content": a["text"]}, {"role": "assistant", "content": b["text"]}]}
            for a, b in zip(rows[::2], rows[1::2])]


@pytest.fixture(scope="module")
def lora_run(files, tmp_path_factory):
    """One LoRA run from the command line on chat data, with --merge: merged model in out/, adapters in out/adapter."""
    import contextlib
    import io
    pytest.importorskip("peft")
    d = tmp_path_factory.mktemp("lora")
    out = d / "out"
    args = ["--model", files.model, "--data", fx.write_jsonl(d / "chat.jsonl", chat_rows()), "--out", str(out),
            "--steps", "8", "--seq", "32", "--micro-batch-size", "2", "--microbatches", "2", "--gpus", "2",
            "--lr", "1e-2", "--memory-gib", str(SMALL["memory_gib"]), "--lm-head-shards", "1", "--lora", "8",
            "--lora-targets", "q_proj,v_proj", "--merge", "--save-every", "4",
            "--packing", "split"]  # the README's lines are long: whole would truncate most replies away at --seq 32
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["finetune", *args])
    return SimpleNamespace(rc=rc, out=stdout.getvalue(), err=stderr.getvalue(), args=args, merged=out,
                           adapters=out / "adapter")


def test_cli_lora_run_on_chat_messages(lora_run, capsys):
    assert lora_run.rc == 0, lora_run.err[-3000:]
    assert "20 documents" in lora_run.out and "wrote " in lora_run.out
    assert "loss=" in lora_run.err and "tok_s=" in lora_run.err and "lr=" in lora_run.err  # the progress bar
    run = json.loads((lora_run.merged / "rpcompile-run.json").read_text())
    assert run["settings"]["steps"] == 8 and run["settings"]["lora_targets"] == ["q_proj", "v_proj"]
    assert checkpoint.load(str(lora_run.merged / CHECKPOINT))["steps"] == 8
    err = bad_input(capsys, *lora_run.args)  # nothing is overwritten (tests/cli/test_cli_safety.py: the details)
    assert "already holds a run or a model" in err and "--overwrite" in err


def test_lora_changes_only_the_adapters(files, lora_run):
    from rpcompile.finetune.hf import add_lora
    from transformers import AutoModelForCausalLM
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(lora_run.adapters))
    trained = tensors(lora_run.adapters, "adapter_model.safetensors")
    init = {k.replace(".default", ""): v for k, v in
            add_lora(AutoModelForCausalLM.from_pretrained(files.model), 8, targets=("q_proj", "v_proj"),
                     seed=0).named_parameters() if "lora_" in k}
    assert len(trained) == 2 * 2 * 2 and all("lora_" in k for k in trained)  # A, B x q, v x 2 layers
    assert all(not torch.equal(v, init[k]) for k, v in trained.items())

    # the merged folder: every tensor but the adapted projections is the original, bit for bit;
    # those moved by exactly the adapters' low-rank update (alpha / r = 2)
    start, merged = tensors(files.model), tensors(lora_run.merged)
    assert merged.keys() == start.keys()
    for k, w in merged.items():
        if "q_proj" in k or "v_proj" in k:
            pre = "base_model.model." + k.removesuffix(".weight")
            delta = 2.0 * trained[pre + ".lora_B.weight"] @ trained[pre + ".lora_A.weight"]
            assert delta.abs().max() > 1e-4
            torch.testing.assert_close(w, start[k] + delta, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(w, start[k]), k


def test_merged_folder_is_a_plain_model_with_the_adapter_models_loss(files, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(lora_run.merged, local_files_only=True)
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora_" in n for n, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files.model), lora_run.adapters)
    loss = hf_loss(adapted, files.eval)
    assert abs(hf_loss(merged, files.eval) - loss) < 1e-5
    assert loss < hf_loss(AutoModelForCausalLM.from_pretrained(files.model), files.eval)  # and it learned


def bad_input(capsys, *args) -> str:
    """Run the CLI in-process; assert exit 2 and a one-line error; return the line."""
    capsys.readouterr()  # drop what the fixtures wrote
    rc = main(["finetune", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("python -m rpcompile finetune: error: ")
    return err


def test_bad_input_is_one_line_and_exit_2(files, tmp_path, capsys):
    common = ["--model", files.model, "--out", str(tmp_path / "o"), "--seq", "32"]
    empty = fx.write_jsonl(tmp_path / "empty.jsonl", [])
    assert "holds no documents" in bad_input(capsys, *common, "--data", empty)
    wrong = fx.write_jsonl(tmp_path / "wrong.jsonl", [{"text": "fine"}, {"prompt": "a", "completion": "b"}])
    err = bad_input(capsys, *common, "--data", wrong)
    assert "wrong.jsonl' line 2 is a prompt/completion row, but line 1 is a text row" in err  # one kind per file
    bare = fx.model_folder(tmp_path / "no-tokenizer", with_tokenizer=False)
    err = bad_input(capsys, "--model", bare, "--data", files.train, "--out", str(tmp_path / "o"))
    assert "no-tokenizer' has no tokenizer" in err
    err = bad_input(capsys, "--model", files.model, "--data", files.train, "--out", str(tmp_path / "o"),
                    "--seq", "128")
    assert "--seq 128 is longer than the model's 64 positions" in err
    assert "does not exist" in bad_input(capsys, *common, "--data", files.train, "--resume")
    assert "needs --lora" in bad_input(capsys, *common, "--data", files.train, "--merge")
    assert not os.path.exists(tmp_path / "o" / CHECKPOINT)


def test_example_script_trains_and_exports(files, tmp_path, capsys):
    import importlib.util
    from transformers import AutoModelForCausalLM
    spec = importlib.util.spec_from_file_location("finetune_hf", os.path.join(fx.ROOT, "examples", "finetune_hf.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--model", files.model, "--data", files.train, "--out", str(tmp_path / "ex"),
                           "--steps", "3", "--seq", "32", "--gpus", "2", "--microbatches", "2", "--lr", "3e-3"])
    assert len(losses) == 3 and "step 3: loss" in capsys.readouterr().out
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "ex", local_files_only=True)
    start = tensors(files.model)
    moved = [k for k, p in trained.named_parameters() if not torch.equal(p.detach(), start[k])]
    assert len(moved) > len(start) // 2


def test_a_config_that_fails_transformers_validation_is_one_line_naming_the_folder_and_the_field(files, tmp_path,
                                                                                                 capsys):
    folder = fx.model_folder(tmp_path / "bad-config")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=4, layer_types=["full_attention"] * 2)  # 4 layers, 2 layer types
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    err = bad_input(capsys, "--model", folder, "--data", files.train, "--out", str(tmp_path / "o"), "--seq", "32")
    assert f"model folder {folder!r}: cannot read its config.json: " in err and "`num_hidden_layers` (4)" in err and "`layer_types` (2)" in err
