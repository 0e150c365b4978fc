"""Host memory accounting (issue 15): the bytes by category match what HostState allocates, the check refuses
a run that does not fit in one line, and compile() refuses it too."""
import pytest
import torch

import rpcompile
from rpcompile import CostTable, StagePlan, pipeline
from rpcompile.ir.hardware import Hardware
from rpcompile.hostmem import check_host_memory, host_bytes
from rpcompile.passes import emit, trace
from rpcompile.runtime import simulate
from rpcompile.runtime.host.assign import assign_buffers
from rpcompile.runtime.host.optimizer import HostState
from rpcompile.models.zoo import LlamaConfig, TinyLlama

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, max_seq=32)


def batch(b=4, t=16):
    ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def allocated(state: HostState) -> dict[str, int]:
    """Bytes of the buffers HostState really allocated, by category, after one step (views of them in the state)."""
    for name, m in state.master.items():
        state.accumulate_grad(name, torch.ones_like(m))
    for layer, names in enumerate(state.groups):
        if names:
            state.step(layer)
    flat = state.flat
    for n, m in state.master.items():  # the parameters' tensors and the optimizer's state are views of them
        m = flat.master.hi[n] if flat.split else m  # a split master's value is read from its halves' views
        assert m.data_ptr() - flat.masters[flat.group[n]].data_ptr() == m.element_size() * state.layout.master[n]
        assert all(t.untyped_storage().data_ptr() == flat.moments[flat.group[n]][k].data_ptr()
                   for k, t in flat.moment[n].items())
    assert all(t.untyped_storage().data_ptr() == state.blocks[state.where[n][0]].data_ptr()
               for n, t in state.compute.items())
    return dict(weights=sum(b.nbytes for b in state.blocks.values()),
                masters=sum(t.nbytes for t in flat.masters) + sum(t.nbytes for t in flat.lows if t is not None),
                grads=sum(t.nbytes for t in flat.grads),
                optimizer=sum(t.nbytes for m in flat.moments for t in m.values()))


@pytest.mark.parametrize("optimizer", [rpcompile.AdamW(lr=1e-3), rpcompile.AdamW(lr=1e-3, state_dtype=torch.bfloat16),
                                       rpcompile.AdamW(lr=1e-3, state_dtype=torch.bfloat16, master_dtype=torch.bfloat16,
                                                       grad_dtype=torch.bfloat16),
                                       rpcompile.SGD(lr=0.1), rpcompile.SGD(lr=0.1, momentum=0.9),
                                       rpcompile.SGD(lr=0.1, momentum=0.9, grad_dtype=torch.bfloat16)],
                         ids=["adamw", "adamw-bf16", "adamw-10B", "sgd", "momentum", "momentum-bf16-grad"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("frozen", [False, True])
def test_bytes_match_what_host_state_allocates(optimizer, dtype, frozen):
    model = TinyLlama(CFG)
    if frozen:  # LoRA-style: only the 1-D weights (norms) train
        for p in model.parameters():
            p.requires_grad_(p.dim() == 1)
    graph = trace(model, batch())
    need = host_bytes(graph, microbatches=2, staleness=1, optimizer=optimizer, dtype=dtype)
    state = HostState.from_graph(graph, optimizer=optimizer, dtype=dtype)
    assert allocated(state) == dict(weights=need.weights, masters=need.masters, grads=need.grads,
                                    optimizer=need.optimizer)
    assert need.activations == 0 and need.in_flight == 0  # no plan given
    assert host_bytes(model, microbatches=2, optimizer=optimizer, dtype=dtype).weights >= need.weights  # tied: once


@pytest.mark.parametrize("lean, per_param", [({}, 18.0), (dict(state_dtype=torch.bfloat16), 14.0),
                                             (dict(state_dtype=torch.bfloat16, master_dtype=torch.bfloat16), 12.0),
                                             (dict(grad_dtype=torch.bfloat16), 16.0),
                                             (dict(state_dtype=torch.bfloat16, master_dtype=torch.bfloat16,
                                                   grad_dtype=torch.bfloat16), 10.0)])
def test_parameter_state_per_trainable_parameter_follows_the_state_master_and_grad_dtypes(lean, per_param):
    model = torch.nn.Linear(1024, 1024)  # multiples of 16: no alignment gaps
    need = host_bytes(model, microbatches=1, optimizer=rpcompile.AdamW(**lean), dtype=torch.bfloat16)
    assert need.trainable == 1024 * 1024 + 1024 and need.state_per_param == per_param
    assert need.per_param_line().startswith(f"parameter state: {per_param:.1f} B per trainable parameter")
    frozen = host_bytes(model.requires_grad_(False), microbatches=1, dtype=torch.bfloat16)
    assert frozen.trainable == 0 and frozen.state_per_param == 0.0


def test_frozen_parameters_cost_only_their_copy():
    layer = torch.nn.Linear(8, 8).requires_grad_(False)
    need = host_bytes(layer, microbatches=4, dtype=torch.float16)
    assert (need.weights, need.masters, need.grads, need.optimizer) == (72 * 2, 0, 0, 0)


def test_saved_activations_of_the_microbatches_in_flight():
    # Backward stages start at layers 2 and 0 (execution order): a round of R microbatches holds both inputs,
    # and with 2 workers the previous round's last backward stage (layer 0's) still holds its own.
    costs = CostTable.from_lists([1.0] * 4, [2.0] * 4, saved_bytes=[100, 10, 20, 30])
    plan = StagePlan.from_str("2,1|1|1,2")
    for staleness in (0, 1):
        for rr in (2, 8):
            need = host_bytes(torch.nn.Linear(1, 1), costs, plan, microbatches=8, staleness=staleness, gpus=2,
                              round_size=rr)
            assert need.in_flight == rr and need.activations == rr * (20 + 100 + 100)
    one = host_bytes(torch.nn.Linear(1, 1), costs, plan, microbatches=8, gpus=1, round_size=8)
    assert one.activations == 8 * (20 + 100)  # one worker: no round overlaps the next
    with pytest.raises(ValueError, match="gpus is needed"):
        host_bytes(torch.nn.Linear(1, 1), costs, plan, microbatches=8)


def test_over_the_limit_is_one_line_naming_the_bytes():
    model = torch.nn.Linear(1024, 1024)
    costs = CostTable.from_lists([1.0] * 2, [2.0] * 2, saved_bytes=[2**20, 2**20])
    plan = StagePlan.from_str("1|1|1")  # the backward stage holds layer 0's input (1 MiB), twice with 2 workers
    run = dict(microbatches=4, gpus=2, round_size=4)
    need = host_bytes(model, costs, plan, **run)
    assert check_host_memory(model, costs, plan, limit=need.total, **run) == need
    with pytest.raises(ValueError) as err:
        check_host_memory(model, costs, plan, limit=need.total - 1, **run)
    msg = str(err.value)
    assert "\n" not in msg and f"{need.total} bytes" in msg and f"({need.total - 1} bytes)" in msg
    for part in ("weights 4.0 MiB", "fp32 masters 4.0 MiB", "gradients 4.0 MiB", "optimizer state 8.0 MiB",
                 "saved activations 8.0 MiB for 4 microbatches per round", "LoRA", "fewer microbatches in flight"):
        assert part in msg, part


def test_the_limit_is_the_hardware_or_this_machines_ram(monkeypatch):
    model = torch.nn.Linear(256, 256)
    small = Hardware.preset("cpu").replace(host_memory=2**20)
    with pytest.raises(ValueError, match=r"the cpu host memory is 1\.0 MiB .*state alone is over.*LoRA"):
        check_host_memory(model, microbatches=1, hardware=small)  # no plan yet: only the state counts
    check_host_memory(model, microbatches=1, hardware=small, limit=2**30)  # an explicit limit wins
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**20)
    with pytest.raises(ValueError, match="this machine's RAM is 1.0 MiB"):
        check_host_memory(model, microbatches=1)


def test_compile_refuses_a_run_that_does_not_fit_the_host():
    tiny_host = Hardware.preset("cpu").replace(host_memory=2**16)  # TinyLlama's AdamW state needs ~0.5 MiB
    with pytest.raises(ValueError, match=r"host memory: the run needs .* bytes: weights"):
        rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(), microbatches=2, hardware=tiny_host,
                          memory_budget=2**20, backend="host")


def test_compile_without_a_hardware_target_checks_this_machines_ram(monkeypatch):
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**16)
    with pytest.raises(ValueError, match=r"host memory: the run needs .* but this machine's RAM is 0\.1 MiB"):
        rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(), microbatches=2, backend="host")
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**34)
    rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(), microbatches=2, backend="host").close()


def test_one_worker_takes_one_round_of_all_microbatches_when_the_host_holds_it(monkeypatch):
    # Without a hardware target one worker runs R = M (each stage's parameters move once per iteration, not
    # M times); a round then holds all M microbatches' saved inputs on the host, so when only R = 1 fits
    # the host compile falls back to it. More workers keep the default round size.
    kw = dict(gpus=1, example=batch(), microbatches=4, memory_budget=2**18,  # a backward stage: saved inputs
              backend="host")
    with rpcompile.compile(TinyLlama(CFG), **kw) as c:
        assert c.program.round_size == 4
        run = dict(microbatches=4, gpus=1, optimizer=c.options.optimizer)
        whole, single = (host_bytes(c.graph, c.costs, c.plan, round_size=r, **run, program=emit(
            c.plan, gpus=1, microbatches=4, round_size=r, staleness=c.options.staleness, costs=c.costs)).total
                         for r in (4, 1))  # a round of one microbatch holds one's saved inputs in the arena
    # (emitted with the costs, as compile does: its chunks decide the gradient staging's units)
    assert single < whole
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: (single + whole) // 2)
    with rpcompile.compile(TinyLlama(CFG), **kw) as c:
        assert c.program.round_size == 1
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**34)
    with rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(), microbatches=4, backend="host") as c:
        assert c.program.round_size == 2


def test_load_checks_the_host_memory_of_the_checkpoints_run(tmp_path, monkeypatch):
    # A checkpoint rebuilds its saved plan without planning; on a machine whose RAM cannot hold the run,
    # load refuses it as compile would, instead of failing later in training.
    with rpcompile.compile(TinyLlama(CFG), gpus=2, example=batch(), microbatches=2, backend="host") as c:
        c.step(batch())
        c.save(tmp_path / "ckpt")
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**16)
    with pytest.raises(ValueError, match=r"host memory: the run needs .* but this machine's RAM is 0\.1 MiB"):
        rpcompile.load(tmp_path / "ckpt", TinyLlama(CFG))
    monkeypatch.setattr("rpcompile.ir.hardware._host_memory", lambda: 2**34)
    rpcompile.load(tmp_path / "ckpt", TinyLlama(CFG)).close()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_bytes_count_the_alignment_gaps_of_odd_shapes(dtype, state_dtype):
    cfg = LlamaConfig(vocab=37, dim=18, layers=1, heads=3, kv_heads=1, ffn=30, max_seq=32)  # 18: gaps
    model = TinyLlama(cfg)
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = trace(model, {"input_ids": ids, "labels": ids})
    opt = rpcompile.AdamW(lr=1e-3, state_dtype=state_dtype)
    need = host_bytes(graph, microbatches=2, optimizer=opt, dtype=dtype)
    state = HostState.from_graph(graph, optimizer=opt, dtype=dtype)
    assert need.optimizer == 2 * state_dtype.itemsize * need.masters // 4  # two moments of the state dtype
    views = sum(t.nbytes for t in state.master.values())
    assert allocated(state)["masters"] == need.masters > views  # the gaps are real and counted
    assert allocated(state) == dict(weights=need.weights, masters=need.masters, grads=need.grads,
                                    optimizer=need.optimizer)


@pytest.mark.parametrize("optimizer", [rpcompile.AdamW(lr=1e-3, master_dtype=torch.bfloat16),
                                       rpcompile.AdamW(lr=1e-3, state_dtype=torch.bfloat16, master_dtype=torch.bfloat16),
                                       rpcompile.SGD(lr=0.1, momentum=0.9, master_dtype=torch.bfloat16)],
                         ids=["adamw", "adamw-bf16-state", "sgd-momentum"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_bytes_of_a_bf16_master_match_what_host_state_allocates_odd_shapes_included(optimizer, dtype):
    cfg = LlamaConfig(vocab=37, dim=18, layers=1, heads=3, kv_heads=1, ffn=30, max_seq=32)  # 18: gaps
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = trace(TinyLlama(cfg), {"input_ids": ids, "labels": ids})
    need = host_bytes(graph, microbatches=2, optimizer=optimizer, dtype=dtype)
    state = HostState.from_graph(graph, optimizer=optimizer, dtype=dtype)
    assert all(t.dtype == torch.bfloat16 for t in state.flat.masters)
    assert need.masters * 2 == need.grads > 2 * sum(t.nbytes for t in state.master.values())  # 2 B, gaps counted
    assert allocated(state) == dict(weights=need.weights, masters=need.masters, grads=need.grads,
                                    optimizer=need.optimizer)
    assert "bf16 masters" in str(need) and "fp32 masters" not in str(need)


@pytest.mark.parametrize("state_dtype, per_param", [(torch.float32, 16.0), (torch.bfloat16, 12.0)])
def test_a_bf16_master_costs_two_bytes_per_trainable_parameter_instead_of_four(state_dtype, per_param):
    model = torch.nn.Linear(1024, 1024)  # multiples of 16: no alignment gaps
    opt = rpcompile.AdamW(state_dtype=state_dtype, master_dtype=torch.bfloat16)
    need = host_bytes(model, microbatches=1, optimizer=opt, dtype=torch.bfloat16)
    assert need.state_per_param == per_param and need.masters == 2 * need.trainable
    assert f"parameter state: {per_param:.1f} B per trainable parameter (compute copy 2.0, master 2.0, " \
           f"gradient 4.0, " in need.per_param_line()
    sgd = host_bytes(model, microbatches=1, optimizer=rpcompile.SGD(lr=0.1, master_dtype=torch.bfloat16),
                     dtype=torch.bfloat16)
    assert sgd.state_per_param == 8.0  # compute copy 2, bf16 master 2, gradient 4, no momentum


def test_with_a_hardware_target_the_round_size_is_chosen_among_those_the_host_holds():
    # Both round sizes are simulated and the faster wins; one round of all M microbatches holds all their
    # saved inputs on the host, so where only the default round fits the host memory the default is taken
    # instead of refusing the run (plan --seq at a long length did refuse)
    kw = dict(gpus=2, example=batch(), microbatches=4, memory_budget=2**18, backend="host")  # saved inputs
    roomy = Hardware.preset("cpu").replace(host_memory=2**34)
    with rpcompile.compile(TinyLlama(CFG), hardware=roomy, **kw) as c:
        assert c.program.round_size == 4  # faster when the host holds it: one upload of each stage per iteration
        run = dict(microbatches=4, gpus=2, optimizer=c.options.optimizer)
        whole = host_bytes(c.graph, c.costs, c.plan, round_size=4, program=c.program, **run).total
    with rpcompile.compile(TinyLlama(CFG), **kw) as c:  # no hardware target: the default round of 2
        assert c.program.round_size == 2
        half = host_bytes(c.graph, c.costs, c.plan, round_size=2, program=c.program,
                          microbatches=4, gpus=2, optimizer=c.options.optimizer).total
    assert half < whole
    tight = roomy.replace(host_memory=(half + whole) // 2)
    with rpcompile.compile(TinyLlama(CFG), hardware=tight, **kw) as c:
        assert c.program.round_size == 2
    with pytest.raises(ValueError, match=r"host memory: the run needs .* bytes"):
        rpcompile.compile(TinyLlama(CFG), hardware=roomy.replace(host_memory=half - 1), **kw)


def test_with_a_hardware_target_each_emitted_programs_host_memory_is_counted_once(monkeypatch):
    # both round sizes are checked before one is simulated; the chosen one is not counted again, and its
    # buffers are the only ones assigned
    seen = []
    real = pipeline.check_host_memory

    def counted(graph, costs, plan, *, round_size, program, **kw):
        seen.append(id(program))
        return real(graph, costs, plan, round_size=round_size, program=program, **kw)
    monkeypatch.setattr(pipeline, "check_host_memory", counted)
    assigned = []
    monkeypatch.setattr(pipeline, "assign_buffers", lambda *a, **kw: assigned.append(a[1]) or assign_buffers(*a, **kw))
    roomy = Hardware.preset("cpu").replace(host_memory=2**34)
    with rpcompile.compile(TinyLlama(CFG), hardware=roomy, gpus=2, example=batch(), microbatches=4,
                           memory_budget=2**18, backend="host") as c:
        assert len(seen) == 2 and len(set(seen)) == 2 and id(c.program) in seen
        assert assigned == [c.program]  # both fit with one buffer per value: only the chosen one is packed


def test_a_program_whose_host_check_packed_its_buffers_is_not_packed_again(monkeypatch):
    # where one buffer per value does not fit (here: the unshared arena made huge), choosing the round size
    # packs each program's buffers to check it; the chosen program's packing is the one compile keeps
    import dataclasses
    real_unshared = pipeline.unshared
    monkeypatch.setattr(pipeline, "unshared", lambda *a: dataclasses.replace(real_unshared(*a), arena=2**60))
    assigned = []
    monkeypatch.setattr(pipeline, "assign_buffers", lambda *a, **kw: assigned.append(a[1]) or assign_buffers(*a, **kw))
    simulated = []  # both fit once packed: both are simulated, and the faster one is chosen
    monkeypatch.setattr(pipeline, "simulate", lambda p, *a, **kw: simulated.append(p) or simulate(p, *a, **kw))
    roomy = Hardware.preset("cpu").replace(host_memory=2**34)
    with rpcompile.compile(TinyLlama(CFG), hardware=roomy, gpus=2, example=batch(), microbatches=4,
                           memory_budget=2**18, backend="host") as c:
        assert len(assigned) == 2 and len({id(p) for p in assigned}) == 2, assigned  # once each (was: 3)
        assert any(p is c.program for p in assigned)
        assert [p.round_size for p in simulated] == [2, 4] and any(p is c.program for p in simulated)


def test_the_host_line_names_the_saved_activations_only_where_no_arena_holds_them():
    """Without a buffer assignment the saved inputs are their own term; with one they are in the arena, which
    the line names instead (the total is the same sum either way)."""
    from rpcompile.passes.cost.host_bytes import HostBytes
    kw = dict(weights=2**30, masters=0, grads=0, optimizer=0, activations=2**29, in_flight=8)
    alone, arena = str(HostBytes(**kw, buffers=2**28)), str(HostBytes(**kw, buffers=2**28, arena=2**27))
    assert "saved activations 512.0 MiB for 8 microbatches" in alone and "arena" not in alone
    assert "saved activations" not in arena and "arena of 128.0 MiB" in arena


@pytest.mark.parametrize("optimizer", [rpcompile.AdamW(lr=1e-3),
                                       rpcompile.AdamW(lr=1e-3, state_dtype=torch.bfloat16, master_dtype=torch.bfloat16),
                                       rpcompile.SGD(lr=0.1, momentum=0.9)], ids=["adamw", "adamw-lean", "momentum"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_sharded_count_holds_the_ranks_slice_of_each_groups_masters_and_moments(optimizer, dtype):
    """With shard=(rank, W) the masters and moments are the rank's slice of each layer group's flat buffers
    (`shard_slices`, what the runtime allocates), the compute copies and gradients stay whole, and the W ranks'
    shares add up to the whole state; odd shapes (gaps, groups of sizes not a multiple of the slice unit)."""
    from rpcompile.ir.host_layout import shard_slices
    cfg = LlamaConfig(vocab=37, dim=18, layers=2, heads=3, kv_heads=1, ffn=30, max_seq=32)
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = trace(TinyLlama(cfg), {"input_ids": ids, "labels": ids})
    flat = HostState.from_graph(graph, optimizer=optimizer, dtype=dtype).layout.flat  # elements per group
    whole = host_bytes(graph, microbatches=2, optimizer=optimizer, dtype=dtype)
    master, moments = whole.master_size, whole.optimizer // sum(flat)  # bytes an element: of a master, all moments
    for world in (2, 3):
        shares = [host_bytes(graph, microbatches=2, optimizer=optimizer, dtype=dtype, shard=(r, world))
                  for r in range(world)]
        for r, need in enumerate(shares):
            own = sum(hi - lo for lo, hi in (shard_slices(n, world)[r] for n in flat))
            assert (need.masters, need.optimizer) == (own * master, own * moments), (world, r)
            assert (need.weights, need.grads, need.trainable, need.servers) == (whole.weights, whole.grads,
                                                                                  whole.trainable, world)
            # a sharded bf16 master keeps the undo copy (only whole ones alternate with their compute copies)
            assert need.total == (whole.total - (whole.masters + whole.optimizer) + need.masters + need.optimizer
                                  + need.undo - whole.undo)
            assert need.undo == whole.trainable_weights
            assert whole.undo == (0 if master == 2 and dtype is torch.bfloat16 else whole.trainable_weights)
            assert need.state_per_param == (need.trainable_weights + need.masters + need.grads
                                            + need.optimizer) / need.trainable < whole.state_per_param
        assert sum(s.masters + s.optimizer for s in shares) == whole.masters + whole.optimizer
        assert shares[0].masters == max(s.masters for s in shares) > shares[-1].masters  # rank 0: the largest
        assert f"masters {shares[0].masters / 2**20:.1f} MiB (1 of {world} shares)" in str(shares[0])
        assert shares[0].per_param_line().startswith(f"parameter state on one server of {world} ")
    assert host_bytes(graph, microbatches=2, optimizer=optimizer, dtype=dtype, shard=(0, 1)) == whole
    assert "shares" not in str(whole) and whole.per_param_line().startswith("parameter state: ")  # not sharded
    # the staleness-1 copy is named for what it is: the second buffer whole, the undo copy sharded
    if whole.undo:
        assert "second compute copies" in str(whole) and "undo copies" not in str(whole)
        assert whole.per_param_line().endswith("for the second compute copy)")
    sharded = host_bytes(graph, microbatches=2, optimizer=optimizer, dtype=dtype, shard=(0, 2))
    assert "undo copies" in str(sharded) and "second compute" not in str(sharded)
    assert sharded.per_param_line().endswith("for the undo copy)")


def test_a_sharded_module_count_slices_its_trainable_elements_and_a_bad_shard_is_refused():
    layer = torch.nn.Linear(5, 7)  # 42 trainable elements: slices of 16-element units, 32 + 10 or 16 + 16 + 10
    for world, owned in ((2, (32, 10)), (3, (16, 16, 10))):
        got = [host_bytes(layer, microbatches=1, shard=(r, world)) for r in range(world)]
        assert [g.masters for g in got] == [4 * n for n in owned] and all(g.grads == 4 * 42 for g in got)
        assert [g.optimizer for g in got] == [8 * n for n in owned]
    for bad in ((2, 2), (-1, 2), (0, 0), (0, True), [0, 2], (0.0, 2)):
        with pytest.raises(ValueError, match="shard must be \\(rank, world\\) with 0 <= rank < world"):
            host_bytes(layer, microbatches=1, shard=bad)


def test_a_sharded_run_is_admitted_on_one_servers_share_and_refused_naming_it():
    layer = torch.nn.Linear(1024, 1024)  # 1,049,600 trainable fp32 elements: 20 B each unsharded
    whole = host_bytes(layer, microbatches=1).total
    share = check_host_memory(layer, microbatches=1, shard=(0, 2), limit=whole - 1)  # the whole would not fit
    assert share.total < whole and share.servers == 2
    with pytest.raises(ValueError) as refused:
        check_host_memory(layer, microbatches=1, shard=(0, 2), limit=share.total - 1)
    msg = str(refused.value)
    assert msg.startswith("host memory: one server's share of the run (server 0 of 2, the masters and moments "
                          "sharded) needs ") and "(1 of 2 shares)" in msg and "over more servers" in msg, msg
    with pytest.raises(ValueError, match="the run needs .* or shard the masters and optimizer state over "
                                         "data-parallel servers"):
        check_host_memory(layer, microbatches=1, limit=whole - 1)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_staleness_1_keeps_a_second_copy_of_the_trainable_weights_allocated_once_and_counted(frozen, split):
    # at staleness 1 the next iteration reads the version before the update: the trainable parameters' compute
    # copies alternate between two buffers (a frozen base's never change), the second allocated before the first
    # step (runtime/host/layout.py `Alternation`), which host_bytes counts; no undo copy is kept. With bf16
    # moments the fp32 masters are split and their bf16 halves are that second buffer: none is allocated or counted
    model = TinyLlama(CFG)
    if frozen:  # LoRA-style: only the 1-D weights (norms) train
        for p in model.parameters():
            p.requires_grad_(p.dim() == 1)
    optimizer = rpcompile.AdamW(state_dtype=torch.bfloat16) if split else rpcompile.AdamW()
    with rpcompile.compile(model, gpus=2, example=batch(), backend="host", staleness=1,
                           dtype=torch.bfloat16, optimizer=optimizer) as c:
        alt = c.state.alt

        def second():
            return [b.data_ptr() for _, pairs in sorted(alt.pairs.items()) for _, b in pairs]
        before = second()
        for _ in range(3):
            c.step(batch())
        c.flush()
        masters = {m.untyped_storage().data_ptr() for m in c.state.flat.masters}
        kept = sum(b.nbytes for b in alt.buffers() if b.untyped_storage().data_ptr() not in masters)
        need = host_bytes(c.graph, microbatches=c.microbatches, staleness=1, optimizer=c.options.optimizer,
                          dtype=torch.bfloat16)
        assert c.state.flat.split == split and c._runtime.host._backup_bufs == {}
        assert kept == need.undo == (0 if split else need.trainable_weights) and need.trainable_weights > 0
        assert c.state.alt is alt and second() == before  # none added
        if not split:
            assert need.undo < need.weights if frozen else need.undo == need.weights
    assert host_bytes(c.graph, microbatches=c.microbatches, staleness=0, optimizer=c.options.optimizer,
                      dtype=torch.bfloat16).undo == 0
