"""Chat fine-tuning data (issue 24): loss masking, row formats, packing that keeps documents apart, eval at step 0.

The tokenizer fixture (tests/hf_fixtures.py `turn_tokenizer`) has a chat
template with distinct turn markers (<|im_start|>role\\n ... <|im_end|>\\n) and a
generation prompt, so the trained span of a reply is "reply<|im_end|>\\n" by
the rule in rpcompile/finetune/data/__init__.py. Nothing is downloaded.
"""
import contextlib
import io
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from rpcompile.finetune import FinetuneConfig, finetune  # noqa: E402
from rpcompile.finetune.data import IGNORE, pack, read_documents  # noqa: E402
from rpcompile.cli.main import main  # noqa: E402
import hf_fixtures as fx  # noqa: E402

SEQ = 64
SMALL = dict(seq=SEQ, micro_batch_size=1, microbatches=2, gpus=2, lr=3e-3, progress=False,
             memory_gib=2**19 / 2**30, lm_head_shards=1, staleness=0)
CONV = [{"role": "system", "content": "You plan pipelines."}, {"role": "user", "content": "What is a stage?"},
        {"role": "assistant", "content": "A run of layers."}, {"role": "user", "content": "And a microbatch?"},
        {"role": "assistant", "content": "A slice of the batch."}]
SHAREGPT = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in CONV]
WORDS = ["plan", "stage", "layer", "step", "batch", "worker", "cost", "seq"]


@pytest.fixture(scope="module")
def tok():
    return fx.turn_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    short = [{"messages": [{"role": "user", "content": f"a {a}?"}, {"role": "assistant", "content": f"the {b}"}]}
             for a in WORDS for b in WORDS[:3]]
    return SimpleNamespace(dir=d, model=fx.model_folder(d / "tiny", tok=fx.turn_tokenizer()),
                           plain=fx.model_folder(d / "plain", tok=fx.turn_tokenizer(chat=False)),
                           train=fx.write_jsonl(d / "train.jsonl", short[:16]),
                           eval=fx.write_jsonl(d / "eval.jsonl", short[16:]))


def trained(p, row=0) -> list[int]:
    """The ids whose label is a target (not -100) in one packed row."""
    return [t for t, y in zip(p.ids[row].tolist(), p.labels[row].tolist()) if y != IGNORE]


def packed(tmp_path, tok, rows, name="d.jsonl", seq=256, **kw):
    return pack(read_documents(fx.write_jsonl(tmp_path / name, rows), tok, **kw), tok, seq)


def test_assistant_last_and_all(tmp_path, tok):
    p = packed(tmp_path, tok, [{"messages": CONV}])
    assert tok.decode(trained(p)) == "A run of layers.<|im_end|>\nA slice of the batch.<|im_end|>\n"
    p = packed(tmp_path, tok, [{"messages": CONV}], train_on="last")
    assert tok.decode(trained(p)) == "A slice of the batch.<|im_end|>\n"
    p = packed(tmp_path, tok, [{"messages": CONV}], train_on="all")
    n = p.tokens
    text = tok.apply_chat_template(CONV, tokenize=False)
    assert p.ids[0, :n].tolist() == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert p.labels[0, 0] == IGNORE and p.labels[0, 1:n].tolist() == p.ids[0, 1:n].tolist()  # every target


def test_messages_and_sharegpt_give_identical_ids_and_labels(tmp_path, tok):
    for train_on in (None, "last", "all"):
        a = packed(tmp_path, tok, [{"messages": CONV}], "m.jsonl", train_on=train_on)
        b = packed(tmp_path, tok, [{"conversations": SHAREGPT}], "s.jsonl", train_on=train_on)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels) and torch.equal(a.positions, b.positions)


def test_prompt_completion_trains_the_completion_and_eos(tmp_path, tok):
    row = {"prompt": "Question: what is a stage? Answer:", "completion": " a run of layers"}
    p = packed(tmp_path, tok, [row])
    ids, labels = p.ids[0, :p.tokens].tolist(), p.labels[0, :p.tokens].tolist()
    n_prompt = len(tok(row["prompt"])["input_ids"])
    assert ids[:n_prompt] == tok(row["prompt"])["input_ids"] and set(labels[:n_prompt]) == {IGNORE}
    assert labels[n_prompt:] == ids[n_prompt:] and ids[-1] == tok.eos_token_id
    assert tok.decode(trained(p)) == " a run of layers<eos>"
    alone = packed(tmp_path, tok, [row], train_on="all")
    assert alone.labels[0, 1:alone.tokens].tolist() == ids[1:]


def test_text_field(tmp_path, tok):
    p = packed(tmp_path, tok, [{"body": "the plan"}, {"body": "a stage"}], text_field="body")
    assert p.documents == 2
    with pytest.raises(ValueError, match=r"line 1: needs a 'text' string"):
        packed(tmp_path, tok, [{"body": "the plan"}])


def segments(p):
    """Each row cut where its position restarts at 0: [(ids, labels, positions)] per row."""
    out = []
    for r in range(len(p)):
        starts = [i for i, x in enumerate(p.positions[r].tolist()) if x == 0] + [p.ids.shape[1]]
        out.append([(p.ids[r, a:b].tolist(), p.labels[r, a:b].tolist(), p.positions[r, a:b].tolist())
                    for a, b in zip(starts, starts[1:])])
    return out


def test_packing_whole_starts_every_sequence_at_a_document(tmp_path, tok):
    lines = [line[:k] for line, k in zip(fx.corpus_lines()[:40], [5, 30, 12, 80, 3, 45] * 7)]
    docs = read_documents(fx.write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in lines]), tok)
    want = [(tok(d.text)["input_ids"] + [tok.eos_token_id])[:32] for d in docs]
    p = pack(docs, tok, 32, "whole")
    assert p.truncated == sum(len(tok(d.text)["input_ids"]) + 1 > 32 for d in docs) > 0
    got = []
    for row in segments(p):
        *real, last = row
        if set(last[1]) == {IGNORE} and set(last[0]) == {tok.pad_token_id}:  # the padding segment
            pass
        else:
            real.append(last)
        for ids, labels, pos in real:
            assert pos == list(range(len(ids))) and labels[0] == IGNORE and labels[1:] == ids[1:]
            got.append(ids)
    assert sorted(got) == sorted(want)  # every sequence starts at a document start; each document whole, once
    assert len(p) < len(docs) and p.trained == sum(len(w) - 1 for w in want)
    assert pack(docs, tok, 32, "whole").ids.equal(p.ids)  # deterministic

    s = pack(docs, tok, 32, "split")
    assert (s.positions[:, 0] == 0).all() and s.truncated == 0
    flat = [t for w in (tok(d.text)["input_ids"] + [tok.eos_token_id] for d in docs) for t in w]
    assert s.ids.flatten()[:s.tokens].tolist() == flat[:s.tokens]
    n = pack(docs, tok, 32, "none")
    assert len(n) == len(docs) and (n.positions == torch.arange(32)).all()
    b = p.batch(0, 4, seed=0)
    assert sorted(b) == ["input_ids", "labels", "position_ids"] and b["position_ids"].shape == (4, 32)


def bad_input(capsys, *args) -> str:
    """The CLI must exit 2 with one line on stderr; returns it."""
    capsys.readouterr()
    rc = main(["finetune", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bad_conversational_input_is_one_line(files, tmp_path, capsys):
    common = ["--out", str(tmp_path / "o"), "--seq", str(SEQ)]
    err = bad_input(capsys, "--model", files.plain, "--data", files.train, *common)
    assert "train.jsonl' line 1" in err and "no" in err and "--chat-template" in err
    lone = fx.write_jsonl(tmp_path / "lone.jsonl", [{"messages": CONV}, {"messages": CONV[:2]}])
    err = bad_input(capsys, "--model", files.model, "--data", lone, *common)
    assert "lone.jsonl' line 2" in err and "no assistant message" in err
    mixed = fx.write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CONV}, {"conversations": SHAREGPT}])
    err = bad_input(capsys, "--model", files.model, "--data", mixed, *common)
    assert "mixed.jsonl' line 2 is a sharegpt row, but line 1 is a messages row" in err
    unknown = fx.write_jsonl(tmp_path / "unknown.jsonl", [{"question": "a", "answer": "b"}])
    assert "unknown.jsonl' line 1: needs" in bad_input(capsys, "--model", files.model, "--data", unknown, *common)
    text = fx.write_jsonl(tmp_path / "text.jsonl", [{"text": "the plan"}])
    assert "--train-on all" in bad_input(capsys, "--model", files.model, "--data", text, *common,
                                         "--train-on", "assistant")


def test_chat_template_file_replaces_a_missing_one(files, tmp_path, tok):
    template = tmp_path / "turns.jinja"
    template.write_text(fx.TURN_TEMPLATE)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = finetune(FinetuneConfig(model=files.plain, data=files.train, out=str(tmp_path / "o"), steps=1,
                                    chat_template=str(template), **SMALL))
    assert r.steps == 1
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path / "o").chat_template == fx.TURN_TEMPLATE  # exported with it


def nll_alone(model, tok, path) -> float:
    """Each eval conversation alone through the transformers model (fp32): summed NLL over trained targets / count."""
    total, count = 0.0, 0
    for doc in read_documents(path, tok):
        p = pack([doc], tok, SEQ, "none")
        n = p.tokens
        ids, labels = p.ids[:, :n], p.labels[:, :n]
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE, reduction="sum")
        total, count = total + nll.item(), count + int((labels[0, 1:] != IGNORE).sum())
    return total / count


def test_cli_summary_line_and_evals_start_at_step_0(files, tmp_path, capsys, tok):
    from transformers import AutoModelForCausalLM
    capsys.readouterr()
    rc = main(["finetune", "--model", files.model, "--data", files.train, "--eval", files.eval,
               "--out", str(tmp_path / "o"), "--steps", "2", "--seq", str(SEQ), "--micro-batch-size", "1",
               "--microbatches", "2", "--gpus", "2", "--memory-gib", str(SMALL["memory_gib"]), "--lm-head-shards",
               "1", "--no-progress", "--staleness", "0", "--eval-every", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    train = pack(read_documents(files.train, tok), tok, SEQ, "whole")
    line = next(line for line in out.splitlines() if line.startswith(f"data {files.train}:"))
    assert (f"16 rows, 16 documents, {len(train)} sequences of {SEQ} (packing whole), {train.trained} trained tokens, "
            f"0 documents truncated") in line, line
    assert len(train) < 16  # several conversations share a sequence
    assert "step 0: eval loss" in out

    r = finetune(FinetuneConfig(model=files.model, data=files.train, eval=files.eval, out=str(tmp_path / "p"),
                                steps=1, **SMALL))
    assert [s for s, _ in r.evals] == [0, 1]
    want = nll_alone(AutoModelForCausalLM.from_pretrained(files.model).eval(), tok, files.eval)
    assert abs(r.evals[0][1] - want) < 1e-5, (r.evals, want)


EMPTY = "{% for m in messages %}{% endfor %}"  # a chat template that renders nothing


def test_no_trained_token_names_the_file_and_the_chat_template_in_use(files, tmp_path, capsys):
    common = ["--out", str(tmp_path / "o"), "--seq", str(SEQ)]
    template = tmp_path / "empty.jinja"
    template.write_text(EMPTY)
    err = bad_input(capsys, "--model", files.model, "--data", files.train, "--chat-template", str(template), *common)
    assert err.endswith(f"error: --data {files.train!r}: none of its 16 conversation(s) leaves a token to train on "
                        f"(--train-on assistant) as the template of --chat-template {str(template)!r} renders them: "
                        f"does it render each message's content?")
    tok = fx.turn_tokenizer()
    tok.chat_template = EMPTY
    silent = fx.model_folder(tmp_path / "silent", tok=tok)
    text = fx.write_jsonl(tmp_path / "text.jsonl", [{"text": f"the {w} plan"} for w in WORDS])
    err = bad_input(capsys, "--model", silent, "--data", text, "--eval", files.eval, *common)
    assert err.endswith(f"error: --eval {files.eval!r}: none of its 8 conversation(s) leaves a token to train on "
                        f"(--train-on assistant) as the tokenizer's chat template (of --model {silent!r}) renders "
                        f"them: does it render each message's content?")


def test_a_lean_host_state_fine_tunes_to_the_fp32_states_eval_loss(files, tmp_path):
    """bf16 AdamW moments and a bf16 master (stochastically rounded, 12 B a parameter instead of 18), and bf16
    gradients too (10 B): a chat fine-tune of the tiny model ends with an eval loss within 1% of the fp32
    state's, having learned as much."""
    runs = {}
    for name, lean in (("fp32", {}), ("bf16", dict(state_dtype="bf16", master_dtype="bf16")),
                       ("10B", dict(state_dtype="bf16", master_dtype="bf16", grad_dtype="bf16"))):
        r = finetune(FinetuneConfig(model=files.model, data=files.train, eval=files.eval, out=str(tmp_path / name),
                                    steps=12, eval_every=12, **{**SMALL, "lr": 1e-3}, **lean))
        runs[name] = [loss for _, loss in r.evals]
    f0, f1 = runs["fp32"]
    assert f1 < 0.95 * f0, runs  # fp32 learns
    for b0, b1 in (runs["bf16"], runs["10B"]):
        assert abs(b0 - f0) <= 1e-4 * f0, runs  # the same start (to rounding)
        assert abs(b1 - f1) <= 0.01 * f1 and b0 - b1 >= 0.9 * (f0 - f1), runs
