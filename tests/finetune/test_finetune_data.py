"""Fine-tuning data, schedule and learning rate (issue 16): packing, formats, lr_at, Compiled.set_lr.

The data tests check the packed tensors against the tokenizer called directly;
the set_lr test checks a staleness-0 and a staleness-1 run whose lr changes
every step against a plain eager SGD loop with the same delays.
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import rpcompile  # noqa: E402
from rpcompile.finetune.data import IGNORE, Document, pack, read_documents  # noqa: E402
from rpcompile.finetune.schedule import lr_at  # noqa: E402
from rpcompile.models.zoo import LlamaConfig, TinyLlama  # noqa: E402
import hf_fixtures as fx  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return fx.tokenizer()


def test_pack_puts_eos_after_each_document_and_pads_only_the_end(tok):
    docs = [Document("hello world", False), Document("the plan", False), Document("a", False)]
    want = [t for d in docs for t in (*tok(d.text)["input_ids"], tok.eos_token_id)]
    seq = next(s for s in (8, 7, 9, 6, 10) if len(want) % s >= 2)  # a padded last sequence (a one-token
    # one is dropped instead: tests/cli/test_cli_safety.py)
    p = pack(docs, tok, seq=seq, packing="split")
    flat_ids, flat_labels = p.ids.flatten().tolist(), p.labels.flatten().tolist()
    assert p.ids.shape == (-(-len(want) // seq), seq) and p.tokens == len(want) and p.documents == 3
    lengths = [len(tok(d.text)["input_ids"]) + 1 for d in docs]
    starts = {sum(lengths[:i]) for i in range(len(docs))}  # each document's first token
    assert flat_ids[:len(want)] == want  # no token predicts across a document boundary (issue 24):
    assert flat_labels[:len(want)] == [IGNORE if i in starts else t for i, t in enumerate(want)]
    assert set(flat_labels[len(want):]) == {IGNORE} and set(flat_ids[len(want):]) == {tok.pad_token_id}


def test_txt_lines_whole_file_and_jsonl_text(tmp_path, tok):
    txt = fx.write_txt(tmp_path / "a.txt", ["first line", "", "  ", "second line"])
    assert [d.text for d in read_documents(txt)] == ["first line", "second line"]
    assert [d.text for d in read_documents(txt, whole_file=True)] == ["first line\n\n  \nsecond line\n"]
    js = fx.write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two", "id": 3}])
    assert [(d.text, d.templated) for d in read_documents(js, tok)] == [("one", False), ("two", False)]


def test_chat_messages_use_the_tokenizers_template(tmp_path, tok):
    msgs = [{"role": "user", "content": "what is a stage?"}, {"role": "assistant", "content": "layers"}]
    path = fx.write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    (doc,) = read_documents(path, tok)
    assert doc.templated and doc.text == tok.apply_chat_template(msgs, tokenize=False)
    assert doc.text == "<|user|>what is a stage?\n<|assistant|>layers\n"
    p = pack([doc], tok, seq=64)
    want = tok(doc.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert p.ids[0, :len(want)].tolist() == want
    plain = fx.tokenizer(chat=False)  # no template: refused (issue 24: no "role: content" fallback)
    with pytest.raises(ValueError, match="line 1: messages rows are rendered with a chat template"):
        read_documents(path, plain)


@pytest.mark.parametrize("rows, match", [
    ([], "holds no documents"),
    ([{"prompt": "x"}], r"line 1: needs a 'text' string, a 'messages' list, .* found \['prompt'\]"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
      {"messages": [{"role": "user"}]}],
     "line 2: each message must be"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, tok, rows, match):
    path = fx.write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        read_documents(path, tok)


def test_batches_are_a_function_of_the_step(tok):
    p = pack([Document(" ".join(map(str, range(i, i + 20))), False) for i in range(30)], tok, seq=16)
    n = len(p)
    seen = torch.cat([p.batch(s, 4, seed=1)["input_ids"] for s in range(-(-n // 4) + 2)])
    first_epoch = seen[:n]
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, p.ids.tolist()))  # each once per epoch
    assert torch.equal(p.batch(5, 4, seed=1)["input_ids"], seen[20:24])  # same step, same batch
    assert not torch.equal(p.batch(0, 4, seed=1)["input_ids"], p.batch(0, 4, seed=2)["input_ids"])
    assert len(p.eval_batches(4)) == -(-n // 4) and all(b["labels"].shape == (4, 16) for b in p.eval_batches(4))


@pytest.mark.parametrize("kind, hf", [("cosine", "cosine"), ("linear", "linear"), ("constant", "constant_with_warmup")])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_schedules_are_transformers_get_scheduler_step_for_step(kind, hf, warmup):
    from transformers import get_scheduler
    total, lr = 100, 3e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(hf, opt, num_warmup_steps=warmup, num_training_steps=total)
    want = []
    for _ in range(total):  # optimizer step k uses the lr the scheduler holds before its k-th step()
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [lr_at(s, lr=lr, total=total, warmup=warmup, kind=kind) for s in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert (got[0] == 0) == (warmup > 0) and all(v > 0 for v in got[max(1, warmup):])
    with pytest.raises(ValueError, match="schedule must be one of"):
        lr_at(0, lr=1.0, total=3, kind="step")


def _eager_sgd(model, batches, lrs, staleness):
    """Eager SGD with DESIGN.md idea 7's delayed reads and lr lrs[t] for the update of batch t's gradient."""
    master = copy.deepcopy(model)
    reads = [copy.deepcopy(master)]
    losses = []
    for t, b in enumerate(batches):
        read = reads[0] if staleness else copy.deepcopy(master)
        loss = sum(read(*p) for p in zip(*(v.chunk(2) for v in b.values()))) / 2  # mean of 2 microbatches
        grads = torch.autograd.grad(loss, list(read.parameters()))
        losses.append(loss.item())
        reads = [copy.deepcopy(master)]  # what the next iteration reads (staleness 1)
        with torch.no_grad():
            for p, g in zip(master.parameters(), grads):
                p -= lrs[t] * g
    return losses, dict(master.named_parameters())


@pytest.mark.parametrize("staleness", [0, 1])
def test_set_lr_applies_to_the_update_of_the_next_step(staleness):
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32), seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (4, 16), generator=gen)), "labels": ids}
               for _ in range(6)]
    lrs = [0.5, 0.05, 0.0, 0.3, 0.01, 0.2]
    want, ref = _eager_sgd(model, batches, lrs, staleness)
    c = rpcompile.compile(copy.deepcopy(model), gpus=2, example=batches[0], microbatches=2, staleness=staleness,
                          optimizer=rpcompile.SGD(lr=1.0, impl="foreach"), memory_budget=2**18,
                          lm_head_shards=1, backend="host")
    assert len(c.plan.to_str().replace("|", ",").split(",")) > 2, c.plan.to_str()  # a real pipeline
    with c:
        got = []
        for lr, b in zip(lrs, batches):
            c.set_lr(lr)
            got.append(c.step(b))
        end = dict(c.model().named_parameters())
        with pytest.raises(ValueError, match="lr must be a finite number"):
            c.set_lr(float("nan"))
    assert got == pytest.approx(want, abs=1e-5)
    for n, p in ref.items():
        torch.testing.assert_close(end[n], p, atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")



CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]


@pytest.mark.parametrize("row, field", [
    ({"text": "ok \ud800 then"}, "'text'"),
    ({"prompt": "Q: ", "completion": "\udfff"}, "'completion'"),
    ({"messages": [CHAT[0], {"role": "assistant", "content": "x\ud800"}]}, "message 2 'content'"),
    ({"conversations": [{"from": "human", "value": "\ud83d"}, {"from": "gpt", "value": "b"}]}, "turn 1 'value'"),
])
def test_a_lone_surrogate_in_a_row_is_refused_naming_the_file_line_and_field(tmp_path, tok, row, field):
    fine = {"text": {"text": "fine"}, "prompt": {"prompt": "a", "completion": "b"}, "messages": {"messages": CHAT},
            "conversations": {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}}
    path = fx.write_jsonl(tmp_path / "bad.jsonl", [fine[next(iter(row))], row])  # JSON writes the \ud800 escape
    with pytest.raises(ValueError, match=rf"data file '{path}' line 2: {field} holds a lone UTF-16 surrogate"):
        read_documents(path, tok)
