"""Deadlines shorter than the work: the wait that ran past its deadline fails the step cleanly (a RuntimeFailure
from DeadlineExceeded, the state of the last completed step), never the recovery, and the run trains on."""
from __future__ import annotations

import re
import time

import pytest

import models  # noqa: E402
from rpcompile import AdamW, StagePlan  # noqa: E402
from rpcompile.passes import emit, trace  # noqa: E402
from rpcompile.ir.program import Op  # noqa: E402
from rpcompile.runtime.executor import Runtime, RuntimeFailure  # noqa: E402
from rpcompile.runtime.host.optimizer import HostState  # noqa: E402
from test_faults import _same, _snapshot  # noqa: E402 - the state comparisons of the fault tests


def _mlp_runtime(staleness: int, **kw):
    """LossMLP, one layer per stage, 2 workers, 2 microbatches (a few ms a step), deadline 20 s."""
    graph = trace(models.LossMLP(), models.xy(0))
    n = len(graph.layers)
    prog = emit(StagePlan.from_sizes([1] * (n - 1), 1, [1] * (n - 1)), gpus=2, microbatches=2, staleness=staleness)
    state = HostState.from_graph(graph, optimizer=AdamW(lr=1e-2))
    return Runtime(graph, prog, state, backend="host", timeout=20, **kw), state


def _reference(staleness: int, steps: int) -> list[dict]:
    """The state after 0, 1, ..., `steps` iterations of a run with the default deadline (flushed each time)."""
    rt, state = _mlp_runtime(staleness)
    with rt:
        snaps = [_snapshot(state)]
        for s in range(steps):
            rt.step(models.xy(s))
            rt.flush()
            snaps.append(_snapshot(state))
    return snaps


def _check_undone(rt: Runtime, state: HostState, err: RuntimeFailure, ref: list[dict]) -> None:
    """A clean deadline failure: names its wait, rewinds to the iteration that failed, keeps the state before it."""
    assert isinstance(err.__cause__, TimeoutError) and "waited" in str(err.__cause__), str(err)[:300]
    assert rt.t == err.iteration
    _same(_snapshot(state), ref[rt.t])


def _slow_download(rt, seconds: float):
    """Iteration 1's activation download of stage 0, microbatch 1 takes `seconds`, under a 0.05 s deadline;
    returns the real handler."""
    orig = rt.handlers[Op.ACT_DOWN]

    def slow(t, ins, w):
        if t == 1 and ins.stage == 0 and ins.mb == 1:
            time.sleep(seconds)
        return orig(t, ins, w)
    rt.handlers[Op.ACT_DOWN], rt.timeout = slow, 0.05
    return orig


def test_a_deadline_shorter_than_running_work_fails_the_step_and_the_drain_waits_for_that_work():
    """Under a 0.05 s deadline an activation download takes 0.4 s: a wait for it fails the step with a
    RuntimeFailure from DeadlineExceeded, while the drain waits for the download (not "did not drain"); the
    state is the last completed step's, a normal deadline trains on to the reference's weights, close is clean."""
    ref = _reference(1, 3)
    rt, state = _mlp_runtime(1)
    with rt:
        rt.step(models.xy(0))
        rt.flush()
        orig = _slow_download(rt, 0.4)
        with pytest.raises(RuntimeFailure) as err:
            rt.step(models.xy(1))
            rt.flush()
        _check_undone(rt, state, err.value, ref)
        rt.handlers[Op.ACT_DOWN], rt.timeout = orig, 20
        for s in range(rt.t, 3):
            rt.step(models.xy(s))
        rt.flush()
        _same(_snapshot(state), ref[3])


def test_a_deadline_past_the_commit_point_never_leaves_half_an_update():
    """Staleness 0, each optimizer step 0.2 s under a 0.05 s deadline: the copy that waits for its layer's step
    after the iteration committed must not fail it (its steps could not be undone). The failure that does come
    is a later iteration's, undone; the state is exactly a completed step's, and the run trains on to the
    reference's weights."""
    ref = _reference(0, 3)
    rt, state = _mlp_runtime(0)
    with rt:
        rt.step(models.xy(0))
        rt.flush()
        orig = state.step
        state.step = lambda layer, **kw: (time.sleep(0.2), orig(layer, **kw))[1]
        rt.timeout = 0.05
        with pytest.raises(RuntimeFailure) as err:
            rt.step(models.xy(1)), rt.step(models.xy(2))
            rt.flush()
        _check_undone(rt, state, err.value, ref)
        state.step, rt.timeout = orig, 20
        for s in range(rt.t, 3):
            rt.step(models.xy(s))
        rt.flush()
        _same(_snapshot(state), ref[3])


def test_work_that_outlasts_the_drain_is_a_runtime_failure_naming_its_thread_and_the_next_call_recovers(tmp_path):
    """An activation download still running past the drain's bound (drain_timeout 0.2 s, deadline 0.05 s, the
    download 1 s): the step raises a RuntimeFailure naming the issuing thread that did not drain (finetune's one
    line, exit 1), not a bare RuntimeError; once the download ends, the next call undoes the iteration and raises
    its deadline failure, and the run trains on to the reference's weights."""
    from rpcompile.finetune.loop import step_failure
    ref = _reference(1, 2)
    rt, state = _mlp_runtime(1, drain_timeout=0.2)
    with rt:
        rt.step(models.xy(0))
        rt.flush()
        orig = _slow_download(rt, 1.0)
        with pytest.raises(RuntimeFailure, match=r"w\d/issue did not drain .*a hang") as err:
            rt.step(models.xy(1))
        line = str(step_failure(err.value, 2, None, str(tmp_path)))
        assert re.match(r"step 2 failed: the issue stream of worker \d waited 0.2 s for w\d/issue to drain", line)
        rt.handlers[Op.ACT_DOWN], rt.timeout = orig, 20
        with pytest.raises(RuntimeFailure) as err:
            rt.step(models.xy(1))
        _check_undone(rt, state, err.value, ref)
        rt.step(models.xy(1))
        rt.flush()
        _same(_snapshot(state), ref[2])


@pytest.mark.parametrize("staleness", [0, 1])
def test_steps_under_a_one_ms_deadline_and_random_stream_delays_fail_cleanly_or_train(staleness):
    """40 steps under a 1 ms deadline while every host-stream item sleeps 0-2 ms: each step trains or fails with a
    clean RuntimeFailure (a DeadlineExceeded, the state of the last completed step); a normal deadline then
    finishes the run with the reference's weights, and close is clean."""
    k = 6
    ref = _reference(staleness, k)
    rt, state = _mlp_runtime(staleness, lane_delay=7)
    failures = 0
    with rt:
        rt.timeout = 0.001
        for _ in range(40):
            if rt.t == k:
                break
            try:
                rt.step(models.xy(rt.t))
            except RuntimeFailure as exc:
                failures += 1
                _check_undone(rt, state, exc, ref)
        rt.timeout = 20
        for s in range(rt.t, k):
            rt.step(models.xy(s))
        rt.flush()
        _same(_snapshot(state), ref[k])
    assert failures
