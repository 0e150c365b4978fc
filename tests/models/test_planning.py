"""plan_model: the longest sequence it reports is `seq_len_limit`'s for the same model, built once for both."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers")

from rpcompile.ir.hardware import Hardware  # noqa: E402
from rpcompile.models.planning import plan_model  # noqa: E402
from rpcompile.models.presets import build_meta, long_sequence_graph, seq_len_limit  # noqa: E402
from rpcompile.passes.cost.host_bytes import round_saved_bytes  # noqa: E402
from rpcompile.passes.cost import seqlen_model  # noqa: E402
from rpcompile.passes.cost.seqlen import max_seq_len, seq_len_costs  # noqa: E402
from rpcompile.passes.partition import partition  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=False)


def config(tmp_path, name: str, **fields) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**TINY, **fields}))
    return str(path)


@pytest.mark.parametrize("frozen", [False, True])
def test_plan_model_reports_the_limit_of_the_model_it_planned(tmp_path, frozen) -> None:
    # a mixture of experts: with a frozen base the limit runs its experts one after the other (eager), also
    # where plan_model hands it its own model, built with grouped experts
    path = config(tmp_path, "moe", model_type="qwen3_moe", moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    hw = Hardware.preset("rtx4090").replace(device_memory=64 * 2**20)
    r = plan_model(path, gpus=2, hardware=hw, seq=64, microbatches=2, frozen_base=frozen)
    alone = seq_len_limit(path, hw, gpus=2, microbatches=2, host_memory=hw.host_memory, frozen_base=frozen)
    assert r.max_seq_why is None and r.max_seq == alone and r.max_seq.length > 0, (r.max_seq, alone)


def test_the_limit_of_a_frozen_base_built_grouped_runs_its_experts_eagerly_and_leaves_them_grouped(tmp_path) -> None:
    # plan_model hands its own model (grouped experts) to seq_len_limit: the limit switches it to the eager loop
    # for its trace and counts (the same limit as a model built eager), and back after, also when it fails
    path = config(tmp_path, "moe", model_type="qwen3_moe", moe_intermediate_size=256, num_experts=8,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    hw = Hardware.preset("rtx4090").replace(device_memory=64 * 2**20)
    net = build_meta(path)
    for p in net.parameters():
        p.requires_grad_(p.dim() == 1)
    assert net.config._experts_implementation == "grouped_mm"
    kw = dict(gpus=2, microbatches=2, host_memory=hw.host_memory, frozen_base=True)
    assert seq_len_limit(path, hw, model=net, **kw) == seq_len_limit(path, hw, **kw)
    assert net.config._experts_implementation == "grouped_mm"
    with pytest.raises(ValueError):
        seq_len_limit(path, hw, model=net, microbatch_size=0, **kw)
    assert net.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("staleness", [0, 1])
def test_plan_model_simulates_its_program_once(tmp_path, monkeypatch, staleness) -> None:
    # the round size is chosen by simulating each candidate program; the row for the chosen one reuses that
    # timeline (the same program, costs, hardware and window) instead of simulating it again
    import rpcompile.models.planning as planning
    import rpcompile.pipeline as pipeline
    runs = []

    def counted(real):
        def simulate(program, *a, **kw):
            runs.append((program, kw.get("iterations", 1)))  # held, so no two programs share an id
            return real(program, *a, **kw)
        return simulate
    monkeypatch.setattr(pipeline, "simulate", counted(pipeline.simulate))
    monkeypatch.setattr(planning, "simulate", counted(planning.simulate))
    path = config(tmp_path, "llama", model_type="llama")
    r = plan_model(path, gpus=2, hardware="rtx4090", seq=64, microbatches=4, staleness=staleness, seq_limit=False)
    keys = [(id(p), k) for p, k in runs]
    assert len(keys) == len(set(keys)), keys
    hw = Hardware.preset("rtx4090")
    fresh = planning.simulate(r.program, r.costs, hw, iterations=planning.steady_iterations(r.program))
    assert r.rows[0][1] == fresh.steady_iteration_time
    # and the row's other columns: the bubble of the same plan at staleness 0 (the comparison child's), the steady
    # bubble and the peak of this one
    sync = planning.simulate(planning.passes.emit(r.plan, gpus=2, microbatches=4, round_size=r.program.round_size,
                                                  staleness=0, costs=r.costs), r.costs, hw)
    assert r.rows[0][3:6] == (sync.bubble_ratio, fresh.steady_bubble, max(fresh.peak_memory) / 2**30)
    assert staleness == 0 or sync.bubble_ratio != fresh.bubble_ratio


def test_plan_model_finds_the_limit_in_a_child_alongside_with_the_same_result(tmp_path, monkeypatch) -> None:
    # and the comparison rows (our schedule at staleness 0, the baselines) in another, while it verifies
    import rpcompile.models.planning as planning
    pids, rows_pids = tmp_path / "pids", tmp_path / "rows_pids"

    def recorded(real, where):  # notes which process computed it
        def fn(*args, **kw):
            with open(where, "a") as f:
                f.write(f"{os.getpid()}\n")
            return real(*args, **kw)
        return fn
    monkeypatch.setattr(planning, "_seq_limit", recorded(planning._seq_limit, pids))
    monkeypatch.setattr(planning, "_comparison", recorded(planning._comparison, rows_pids))
    path = config(tmp_path, "llama", model_type="llama")
    hw = Hardware.preset("rtx4090").replace(device_memory=64 * 2**20)
    got = [plan_model(path, gpus=2, hardware=hw, seq=64, microbatches=2, **kw) for kw in ({}, {"parallel": False})]
    assert got[0].max_seq == got[1].max_seq and got[0].max_seq.length > 0
    assert got[0].rows == got[1].rows and str(got[0].plan) == str(got[1].plan)
    for where in (pids, rows_pids):
        child, here = map(int, where.read_text().split())
        assert here == os.getpid()
        if sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1:
            assert child != os.getpid()


HOSTILE = {  # config.json -> the words of the one-line refusal (file and field)
    "negative hidden size": ({**TINY, "hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    "0 attention heads": ({**TINY, "num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    "vocab 0": ({**TINY, "vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    "a string hidden size": ({**TINY, "hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    "0 layers": ({**TINY, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    "heads not dividing hidden": ({**TINY, "head_dim": None, "num_attention_heads": 6, "num_key_value_heads": 6},
                                  "hidden_size (64) must be a multiple of num_attention_heads (6)"),
    "kv heads not dividing heads": ({**TINY, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    "null": ({**TINY, "intermediate_size": None}, "intermediate_size must be a positive integer, got None"),
    "a list where an int goes": ({**TINY, "num_hidden_layers": [2]}, "num_hidden_layers must be a positive integer"),
    "a non-object": ([1, 2], "a model config is a JSON object of fields, got a list"),
    "no model_type": ({k: v for k, v in TINY.items() if k != "model_type"}, "model_type must name"),
    "unknown model_type": ({**TINY, "model_type": "no-such-model"}, "got 'no-such-model'"),
    "not JSON": ("{'hidden_size': 64}", "not valid JSON at line 1 column 2"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_config_json_that_cannot_build_a_model_is_refused_naming_the_file_and_field(tmp_path, case) -> None:
    raw, words = HOSTILE[case]
    path = tmp_path / "config.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps({"model_type": "llama", **raw} if isinstance(
        raw, dict) and case != "no model_type" else raw))
    with pytest.raises(ValueError) as refused:
        plan_model(str(path), gpus=2, hardware="rtx4090", seq=64, microbatches=4)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message


def test_plan_model_with_the_state_sharded_over_servers_counts_server_0s_share(tmp_path, monkeypatch) -> None:
    import rpcompile.models.planning as planning
    shards = []

    def checked(*args, **kw):
        shards.append(kw["shard"])
        return check(*args, **kw)
    check = planning.check_host_memory
    monkeypatch.setattr(planning, "check_host_memory", checked)
    path = config(tmp_path, "llama", model_type="llama")
    run = dict(gpus=2, hardware="rtx4090", seq=64, microbatches=2, seq_limit=False)
    whole = plan_model(path, **run)
    share = plan_model(path, **run, servers=2, shard_state=True)
    assert shards == [None, None, (0, 2), (0, 2)]  # before and after planning: server 0's, the largest share
    state = whole.host.masters + whole.host.optimizer
    assert (share.servers, share.host.servers, share.state_whole, whole.state_whole) == (2, 2, state, state)
    assert state / 2 <= share.host.masters + share.host.optimizer < state  # server 0's: the larger share
    assert share.host.total == whole.host.total - state + share.host.masters + share.host.optimizer
    assert plan_model(path, **run, servers=2).host == whole.host  # unsharded: each server holds all of it
    room = (share.host.total + whole.host.total) // 2  # holds the share, not the whole
    assert plan_model(path, **run, servers=2, shard_state=True, host_memory=room).host == share.host
    with pytest.raises(ValueError, match="the run needs"):
        plan_model(path, **run, host_memory=room)
    with pytest.raises(ValueError, match="plan_model: shard_state needs servers > 1"):
        plan_model(path, **run, shard_state=True)
    with pytest.raises(ValueError, match="plan_model: servers must be a positive integer"):
        plan_model(path, **run, servers=0)


def _admits(path: str, hw: Hardware, seq: int) -> bool:
    """Whether `plan` admits the run at `seq` tokens (2 GPUs, 2 microbatches): the device and the host checks."""
    try:
        plan_model(path, gpus=2, hardware=hw, seq=seq, microbatches=2, seq_limit=False, parallel=False)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("host_mib, binds", [(20, "host"), (100_000, "device")])
def test_the_limit_is_where_plan_stops_admitting_found_by_bisection(tmp_path, host_mib, binds) -> None:
    # 20 MiB: whole decoder blocks fit a worker up to a length where cutting them into sub-blocks (what compile
    # does past it) needs more host memory than there is, so plan stops there, not where sub-blocks would stop
    # (what seq_len_limit assumed at every length); 100,000 MiB: the sub-blocks' own device limit, every stage
    # within the budget less the BLAS workspace
    path = config(tmp_path, "llama", model_type="llama")
    hw = Hardware.preset("rtx4090").replace(device_memory=64 * 2**20, host_memory=host_mib * 2**20)
    lim = seq_len_limit(path, hw, gpus=2, microbatches=2, host_memory=hw.host_memory)
    assert lim.binding.startswith(binds), lim
    lo, hi = 1, 4 * lim.length  # plan admits lo and refuses hi
    assert _admits(path, hw, lo) and not _admits(path, hw, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _admits(path, hw, mid) else (lo, mid)
    assert lim.length == lo, (lim, lo)
    if binds == "host":  # what stops it: the sub-blocks' host need, one token past the whole blocks' limit
        assert "with the decoder blocks cut into sub-blocks" in str(lim), lim
        sub = max_seq_len(long_sequence_graph(path), hw, gpus=2, microbatches=2)
        assert sub.length < lim.length, (sub, lim)


def test_the_host_term_prices_the_partitioners_plan_where_the_greedy_windows_are_not_the_widest(tmp_path,
                                                                                               monkeypatch) -> None:
    # 8 blocks in sub-blocks on 96 MiB workers: past 11,446 tokens the greedy backward windows (grown from the
    # last layer) need more than the 40 MiB host, while the partitioner's plan at that length, wider, still fits
    # up to 11,452; admission counts the partitioner's plan, so the limit is where that one stops fitting too
    path = config(tmp_path, "llama8", model_type="llama", num_hidden_layers=8)
    hw = Hardware.preset("rtx4090").replace(device_memory=96 * 2**20, host_memory=40 * 2**20)
    sc = seq_len_costs(long_sequence_graph(path), hw, batch=1)
    lim = max_seq_len(sc, hw, gpus=2, microbatches=2)
    state = sum(n for _, n in sc.host_state)

    def partitioned(s: int) -> int:  # host bytes of the partitioner's plan at length s (round_saved_bytes)
        c = sc.at(1, s)
        plan = partition(c, gpus=2, microbatches=2, memory_budget=hw.stage_budget(None, 0.9), staleness=1)
        return state + round_saved_bytes(list(c.saved_bytes), plan, 2, 2)[0]
    assert lim.binding.startswith("host"), lim
    assert partitioned(lim.length) <= hw.host_memory < partitioned(lim.length + 1), lim
    assert lim.bytes == partitioned(lim.length + 1) and "11 backward stages" in lim.binding, lim
    # the lengths the partitioner-priced search tries are predicted from the plans it sees; without a prediction
    # (a step doubled, then a bisection) it finds the same length
    monkeypatch.setattr(seqlen_model.SeqLenModel, "holds", lambda *args: False)
    assert max_seq_len(sc, hw, gpus=2, microbatches=2) == lim
    monkeypatch.undo()
    # a search limit between the two: the longer search stops there; one below the greedy windows' limit: the
    # first search stops there
    for limit in (lim.length - 3, 1000):
        capped = max_seq_len(sc, hw, gpus=2, microbatches=2, limit=limit)
        assert (capped.length, capped.binding, capped.bytes, capped.capacity) == (limit, f"the search limit {limit:,}",
                                                                                 0, 0), capped
