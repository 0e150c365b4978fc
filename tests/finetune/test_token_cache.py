"""Fine-tuning data with bounded memory, and a token cache (issue 25, item 5): `rpcompile.finetune.data.token_cache`.

The cache-backed `Packed` is checked bit for bit against the issue-24 packing
(tests/packing_reference.py, whole tensors in memory) on mixed documents; a
second `prepare` on the same file is checked to make zero tokenizer calls with a
counting wrapper; num_proc=2 must write the same bytes as num_proc=1; a killed
build, or a file that changes while it is read, must leave nothing that is read;
and a 50,000-line file's preparation must stay within the memory bound, measured
in a fresh process (bench/data_memory.py's measurement).
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from rpcompile.finetune import data as data_mod  # noqa: E402
from rpcompile.finetune.data import Document, pack, prepare, read_documents  # noqa: E402
from rpcompile.finetune.data.token_cache import FILES, META  # noqa: E402
import hf_fixtures as fx  # noqa: E402
import packing_reference as ref  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
STATS = ("tokens", "documents", "truncated", "dropped", "trained")
COUNTED = ("__call__", "encode", "encode_plus", "batch_encode_plus", "_encode_plus", "_batch_encode_plus",
           "tokenize", "apply_chat_template", "encode_batch")


class Counting:
    """A tokenizer (or backend tokenizer) that counts its encoding calls and delegates everything else."""

    def __init__(self, inner, calls=None):
        self._inner, self.calls = inner, calls if calls is not None else []

    def __call__(self, *a, **k):
        self.calls.append("__call__")
        return self._inner(*a, **k)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_inner", "calls"):  # pickling probes an instance not yet filled
            raise AttributeError(name)
        value = getattr(self._inner, name)
        if name in COUNTED:
            def counted(*a, **k):
                self.calls.append(name)
                return value(*a, **k)
            return counted
        if name in ("backend_tokenizer", "_tokenizer"):
            return Counting(value, self.calls)
        return value


@pytest.fixture(scope="module")
def tok():
    return fx.turn_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tok") / "tok"
    tok.save_pretrained(path)
    return str(path)


def load(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def conversations(n):
    """n conversations of 1 to 3 exchanges, some with a system prompt."""
    lines = fx.corpus_lines()
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": lines[i % 7][:30]}] if i % 3 == 0 else []
        for j in range(1 + i % 3):
            msgs += [{"role": "user", "content": lines[(i + j) % len(lines)][:10 + (7 * i) % 60]},
                     {"role": "assistant", "content": lines[(3 * i + j) % len(lines)][:5 + (11 * i) % 90]}]
        rows.append({"messages": msgs})
    return rows


def files(tmp_path):
    """Three files of the three kinds of masking: text rows, chat (assistant masks), prompt/completion."""
    lines = fx.corpus_lines()
    text = fx.write_jsonl(tmp_path / "text.jsonl", [{"text": lines[i][:3 + (17 * i) % 150]} for i in range(60)]
                          + [{"text": ""}])
    chat = fx.write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    pc = fx.write_jsonl(tmp_path / "pc.jsonl", [{"prompt": lines[i][:20], "completion": lines[i + 1][:(5 * i) % 70]}
                                                for i in range(40)])
    return text, chat, pc


def same(a, b):
    """The cache-backed `b` equals the reference `a`: tensors, counts, batches across epochs, eval batches."""
    assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels) and torch.equal(a.positions, b.positions)
    assert [getattr(a, k) for k in STATS] == [getattr(b, k) for k in STATS] and len(a) == len(b)
    for step in range(3 * len(a) // 5 + 2):  # batches of 5 over several epochs
        x, y = a.batch(step, 5, seed=7), b.batch(step, 5, seed=7)
        assert all(torch.equal(x[k], y[k]) for k in x), step
    for fill in ("repeat", "ignore"):
        ea, eb = a.eval_batches(3, fill=fill), b.eval_batches(3, fill=fill)
        assert len(ea) == len(eb) and all(torch.equal(p[k], q[k]) for p, q in zip(ea, eb) for k in p)
    x, y = a.rows([2, 0, 2], train=False), b.rows([2, 0, 2], train=False)
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_packed_matches_the_reference_packing_bit_for_bit(tmp_path, tok):
    text, chat, pc = files(tmp_path)
    docs = {f: read_documents(f, tok, train_on=t) for f, t in ((text, None), (chat, None), (pc, None))}
    docs["last"] = read_documents(chat, tok, train_on="last")
    mixed = [d for group in zip(*(v[:40] for v in docs.values())) for d in group] + docs[text][40:]
    assert {d.spans is None for d in mixed} == {True, False} and {d.templated for d in mixed} == {True, False}
    for seq in (8, 33, 64):  # 8: truncation and dropped documents; 33: a split tail of one token somewhere
        for packing in ("whole", "split", "none"):
            same(ref.pack(mixed, tok, seq, packing), pack(mixed, tok, seq, packing))
    for path, want in docs.items():
        if path != "last":
            got = prepare(path, tok, seq=32, packing="whole", cache_root=str(tmp_path / "cache"))
            same(ref.pack(want, tok, 32, "whole"), got)
    with pytest.raises(ValueError, match="no token to train on"):
        pack([Document("", False)] * 3, tok, seq=8, packing="split")


def test_split_documents_holds_out_a_seeded_disjoint_part(tmp_path, tok):
    text, chat, _ = files(tmp_path)
    p = prepare(chat, tok, seq=48, packing="split", cache_root=str(tmp_path / "cache"))
    train, held = p.split_documents(0.25, seed=3)
    assert held.read == 10 and train.read == 30 and not set(held.selection) & set(train.selection)
    docs = read_documents(chat, tok)
    same(ref.pack([docs[i] for i in held.selection], tok, 48, "split"), held)
    same(ref.pack([docs[i] for i in train.selection], tok, 48, "split"), train)
    again, other = p.split_documents(0.25, seed=3)[1], p.split_documents(0.25, seed=4)[1]
    assert list(again.selection) == list(held.selection) and list(other.selection) != list(held.selection)
    assert p.split_documents(3, seed=0)[1].read == 3 and held.fingerprint() != train.fingerprint()
    for bad in (0, 1.0, 40, -0.5, True):
        with pytest.raises(ValueError, match="--val-size"):
            p.split_documents(bad)


def test_a_second_prepare_never_calls_the_tokenizer(tmp_path, folder):
    text, chat, _ = files(tmp_path)
    cache = str(tmp_path / "cache")
    first = Counting(load(folder))
    a = prepare(chat, first, seq=32, cache_root=cache)
    assert first.calls and not a.cached
    again = Counting(load(folder))  # a fresh load of the same tokenizer, as a resumed run has
    b = prepare(chat, again, seq=32, cache_root=cache)
    assert again.calls == [] and b.cached and b.fingerprint() == a.fingerprint()
    for step in range(4):
        x, y = a.batch(step, 4, seed=0), b.batch(step, 4, seed=0)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert prepare(chat, Counting(load(folder)), seq=24, packing="split", cache_root=cache).cached  # same tokens
    misses = []
    with open(chat, "ab") as f:
        f.write(b" ")  # one byte more (a blank at the end of the last line: the same documents)
    misses.append((chat, {}))
    changed = load(folder)
    changed.chat_template = fx.TURN_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>\n\n")
    misses.append((chat, {"tokenizer": changed}))
    misses.append((chat, {"train_on": "last"}))
    misses.append((text, {}))
    for path, kw in misses:
        t = Counting(kw.pop("tokenizer", load(folder)))
        p = prepare(path, t, seq=32, packing="split", cache_root=cache, **kw)
        assert t.calls and not p.cached, (path, kw)
    assert len([n for n in os.listdir(cache) if not n.startswith(".")]) == 5
    assert prepare(chat, Counting(load(folder)), seq=32, cache_root=cache).fingerprint() == a.fingerprint()


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path, tok):
    _, chat, _ = files(tmp_path)

    class Appending(Counting):
        def __call__(self, *a, **k):
            with open(chat, "a") as f:
                f.write("\n")  # another program still writing the file
            return super().__call__(*a, **k)

    with pytest.raises(ValueError, match="changed while it was read"):
        prepare(chat, Appending(tok), seq=32, cache_root=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # its cache is not kept
    assert not prepare(chat, Counting(tok), seq=32, cache_root=str(tmp_path / "cache")).cached


def cache_bytes(root):
    """{file name: bytes} of the one cache under `root`."""
    (name,) = [n for n in os.listdir(root) if not n.startswith(".")]
    return {f: open(os.path.join(root, name, f), "rb").read() for f in [n for n, _ in FILES.values()] + [META]}


def test_num_proc_2_writes_the_same_bytes_and_the_same_errors(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(data_mod, "CHUNK_DOCS", 37)  # many chunks from a small file
    path = fx.write_jsonl(tmp_path / "chat.jsonl", conversations(400))
    here = [Counting(tok), Counting(tok)]
    one = prepare(path, here[0], seq=64, cache_root=str(tmp_path / "one"))
    two = prepare(path, here[1], seq=64, cache_root=str(tmp_path / "two"), num_proc=2)
    assert cache_bytes(tmp_path / "one") == cache_bytes(tmp_path / "two") and two.fingerprint() == one.fingerprint()
    assert here[0].calls.count("__call__") == 11 and here[1].calls.count("__call__") == 1  # the rest: in workers
    bad = conversations(400)
    bad[300]["messages"][1]["role"] = 7
    path = fx.write_jsonl(tmp_path / "bad.jsonl", bad)
    errors = []
    for n in (1, 2):
        with pytest.raises(ValueError, match="line 301: each message must be") as e:
            prepare(path, tok, seq=64, cache_root=str(tmp_path / "bad"), num_proc=n)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and os.listdir(tmp_path / "bad") == []  # nothing left behind


KILLED = r"""
import os, sys
sys.path[:0] = sys.argv[1].split(os.pathsep)  # this test's folder and tests/ (the helpers)
from transformers import AutoTokenizer
from rpcompile.finetune import data
from test_token_cache import Counting

class Dying(list):
    def append(self, name):
        if name == "__call__" and self.count(name) == 2:
            os._exit(9)  # killed in the middle of writing the cache: at its third chunk's tokenizer call
        super().append(name)

data.CHUNK_DOCS = 5
data.prepare(sys.argv[3], Counting(AutoTokenizer.from_pretrained(sys.argv[2]), Dying()), seq=32,
             cache_root=sys.argv[4])
"""


def test_a_killed_build_leaves_nothing_that_is_read(tmp_path, folder, tok):
    _, chat, _ = files(tmp_path)
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", KILLED, os.pathsep.join([HERE, TESTS]), folder, chat, str(cache)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 9, r.stderr
    (left,) = os.listdir(cache)
    assert left.startswith(".tmp-") and META not in os.listdir(cache / left)  # a half-written cache
    t = Counting(load(folder))
    p = prepare(chat, t, seq=32, cache_root=str(cache))
    assert t.calls and not p.cached and left not in os.listdir(cache)  # not read, and removed
    same(ref.pack(read_documents(chat, tok), tok, 32, "whole"), p)
    (name,) = os.listdir(cache)
    with open(cache / name / "ids.i32", "r+b") as f:
        f.truncate(12)  # damaged on disk
    t = Counting(load(folder))
    q = prepare(chat, t, seq=32, cache_root=str(cache))
    assert t.calls and not q.cached and q.fingerprint() == p.fingerprint()


def bench_script():
    """bench/data_memory.py as a module: the generated rows and the fresh-process measurement are its own."""
    spec = importlib.util.spec_from_file_location("data_memory", os.path.join(fx.ROOT, "bench", "data_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preparing_50000_lines_stays_within_the_memory_bound(tmp_path, folder):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    bench = bench_script()
    data = bench.write_rows(str(tmp_path / "big.jsonl"), "pc", 50_000)  # prompt/completion: masked by offsets
    m = bench.measure("build", data, folder, str(tmp_path / "cache"))
    bound = 2 * m["arrays"] + 100 * 2**20  # the final arrays: token cache + packing layout
    assert m["tokens"] > 1_000_000 and not m["cached"], m
    assert m["growth"] <= bound, f"peak RSS growth {m['growth'] / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB: {m}"


def test_a_cache_changed_in_place_is_rebuilt_and_says_so(tmp_path, folder, tok, capsys):
    _, chat, _ = files(tmp_path)
    cache = tmp_path / "cache"
    p = prepare(chat, Counting(load(folder)), seq=32, cache_root=str(cache))
    (name,) = os.listdir(cache)
    ids = cache / name / "ids.i32"
    data = open(ids, "rb").read()
    with open(ids, "r+b") as f:
        f.write(data[4:] + data[:4])  # the same size, other tokens (meta.json untouched)
    t = Counting(load(folder))
    q = prepare(chat, t, seq=32, cache_root=str(cache))
    err = capsys.readouterr().err
    assert f"token cache {cache / name}: damaged, its files' sha256 is not the one in meta.json" in err
    assert t.calls and not q.cached and q.fingerprint() == p.fingerprint()  # tokenized again: the same tokens
    assert open(ids, "rb").read() == data
    same(ref.pack(read_documents(chat, tok), tok, 32, "whole"), q)


@pytest.mark.parametrize("field, value", [("tokens", "many"), ("documents", -1), ("eos", 1.5), ("content", 7)])
def test_a_meta_json_with_a_wrong_type_is_damage_and_is_rebuilt(tmp_path, folder, field, value, capsys):
    """A meta.json whose counts are not counts is damage like another: one line naming the field, then rebuilt."""
    import json
    _, chat, _ = files(tmp_path)
    cache = tmp_path / "cache"
    p = prepare(chat, Counting(load(folder)), seq=32, cache_root=str(cache))
    (name,) = os.listdir(cache)
    meta = cache / name / META
    good = meta.read_bytes()
    meta.write_text(json.dumps({**json.loads(good), field: value}))
    t = Counting(load(folder))
    q = prepare(chat, t, seq=32, cache_root=str(cache))
    err = capsys.readouterr().err
    assert f"token cache {cache / name}: damaged, meta.json's {field!r} is {value!r}, not a " in err, err
    assert t.calls and not q.cached and q.fingerprint() == p.fingerprint() and meta.read_bytes() == good


TRUNCATED = r"""
import os, sys
sys.path[:0] = sys.argv[1].split(os.pathsep)
import hf_fixtures as fx
from rpcompile.finetune.data import prepare
p = prepare(sys.argv[2], fx.turn_tokenizer(), seq=32, cache_root=sys.argv[3])
p.batch(0, 4, seed=0)
(name,) = os.listdir(sys.argv[3])
os.truncate(os.path.join(sys.argv[3], name, "ids.i32"), 0)  # another program, while this job reads the cache
try:
    p.batch(1, 4, seed=0)
except OSError as exc:
    print(exc)
"""


def test_a_cache_file_truncated_under_a_running_job_is_one_line_not_sigbus(tmp_path):
    _, chat, _ = files(tmp_path)
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", TRUNCATED, os.pathsep.join([HERE, TESTS]), chat, str(cache)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # SIGBUS: -7
    (name,) = os.listdir(cache)
    assert r.stdout.startswith(f"token cache file {str(cache / name / 'ids.i32')!r} shrank to 0 of its "), r.stdout
    assert r.stdout.count("\n") == 1


def test_a_cache_of_many_tokenizer_chunks_matches_the_reference_packing_bit_for_bit(tmp_path, tok, monkeypatch):
    """Documents after the first chunk must point at their own tokens (chunks of 7 documents: 6 chunks and a part)."""
    from rpcompile.finetune.data import packing
    monkeypatch.setattr(data_mod, "CHUNK_DOCS", 7)  # prepare: a data file's rows
    monkeypatch.setattr(packing, "CHUNK_DOCS", 7)  # pack: a list of documents
    text, chat, _ = files(tmp_path)
    for path in (text, chat):
        docs = read_documents(path, tok)
        for packing_kind in ("whole", "split"):
            want = ref.pack(docs, tok, 40, packing_kind)
            same(want, prepare(path, tok, seq=40, packing=packing_kind, cache_root=str(tmp_path / "cache")))
            same(want, pack(docs, tok, 40, packing_kind))
