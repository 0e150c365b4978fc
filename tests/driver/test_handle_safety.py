"""A handle under hostile but realistic use (issue 23): Ctrl-C, threads, failed loads, killed saves."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import models  # noqa: E402 - tests/ is on sys.path (pytest rootdir)
import rpcompile
from rpcompile import checkpoint
from rpcompile.models.zoo import LlamaConfig, TinyLlama
from tests.driver.test_api import batch, make


_MLP, _xy = models.LossMLP, models.xy


def _compile(model=None, **kw):
    return rpcompile.compile(model or _MLP(), gpus=2, example=_xy(0), microbatches=2, backend="host",
                             optimizer=rpcompile.AdamW(lr=1e-2, impl="foreach"), **kw)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("rpcompile")}


# -- interrupts stay interrupts ------------------------------------------------------------------------------
def _interrupted_second_step(hold_commit: bool):
    """Two steps; Ctrl-C arrives while the caller waits for step 1's losses. Returns (error, handle)."""
    c = _compile()
    c.step(_xy(0))
    c._runtime.flush()
    good = c.state_dict()["host"]
    gate = threading.Event()
    add, real = c.state.accumulate_grad, c._runtime.iterations.read_losses
    if hold_commit:  # iteration 1's gradients, and so its commit, wait until after the interrupt
        c.state.accumulate_grad = lambda name, part: (gate.wait(30), add(name, part))[1]
    timer: list = []

    def slow(t, ctx, give):  # the caller is waiting for the losses when Ctrl-C arrives
        if threading.current_thread() is threading.main_thread() and not timer:  # not the commit check's read
            timer.append(threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)))
            timer.append(threading.Timer(0.5, gate.set))  # the gradients arrive after the interrupt
            for tm in timer:
                tm.start()
            threading.Event().wait(5)  # interrupted by the signal's KeyboardInterrupt
        return real(t, ctx, give)

    c._runtime.iterations.read_losses = slow
    with pytest.raises(KeyboardInterrupt) as err:
        c.step(_xy(1))
    c._runtime.iterations.read_losses, c.state.accumulate_grad = real, add
    return err.value, c, good


def test_ctrl_c_before_the_commit_raises_keyboard_interrupt_with_the_step_undone():
    exc, c, good = _interrupted_second_step(hold_commit=True)
    with c:
        assert type(exc) is KeyboardInterrupt  # not wrapped into a RuntimeFailure
        assert c.steps == 1
        now = c.state.state_dict()
        for key in ("master", "compute"):
            assert all(torch.equal(now[key][n], good[key][n]) for n in good[key]), key
        c.step(_xy(1))  # iteration 1 again
        assert c.steps == 2


def test_ctrl_c_after_the_commit_raises_keyboard_interrupt_with_the_step_done():
    exc, c, _ = _interrupted_second_step(hold_commit=False)
    with c:
        assert type(exc) is KeyboardInterrupt
        assert c.steps == 2  # its update had started: the step completed, and counts
        got = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    with _compile() as ref:
        ref.step(_xy(0)), ref.step(_xy(1))
        want = dict(ref.model().named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)


# -- one handle, one caller at a time ----------------------------------------------------------------------
def test_two_threads_stepping_one_handle_are_serialised_and_equal_the_sequential_run():
    b = _xy(3)
    with _compile() as c:
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                for _ in range(50):
                    c.step(b)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        threads = [threading.Thread(target=loop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert c.steps == 100
        got = {n: p.detach().clone() for n, p in c.model().named_parameters()}
    with _compile() as ref:
        for _ in range(100):
            ref.step(b)
        want = dict(ref.model().named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)


# -- a failed load leaves no thread behind ------------------------------------------------------------------
def test_a_failed_load_leaves_no_thread_and_is_refused_before_workers_start(tmp_path):
    path = str(tmp_path / "run.ckpt")
    with _compile() as c:
        c.step(_xy(0))
        c.save(path)
    before = _threads()
    started = []
    real = rpcompile.runtime.executor.Runtime.__init__
    rpcompile.runtime.executor.Runtime.__init__ = lambda self, *a, **k: (started.append(1), real(self, *a, **k))[1]
    try:
        for _ in range(3):
            with pytest.raises(ValueError):
                rpcompile.load(path, _MLP(width=16))  # another shape: refused
    finally:
        rpcompile.runtime.executor.Runtime.__init__ = real
    assert started == [] and _threads() == before


def test_a_load_failing_after_its_workers_started_closes_them(tmp_path, monkeypatch):
    path = str(tmp_path / "run.ckpt")
    with _compile() as c:
        c.step(_xy(0))
        c.save(path)
    before = _threads()

    def broken(self, sd, slices=()):
        raise RuntimeError("disk went away")

    monkeypatch.setattr(rpcompile.api.Compiled, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="disk went away"):
        rpcompile.load(path, _MLP())
    assert _threads() == before


# -- a killed save's temporary file is removed by the next save or load of the path ------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("then", ["save", "load"])
def test_a_killed_saves_temporary_file_is_removed_next_time(tmp_path, then):
    path = str(tmp_path / "run.ckpt")
    checkpoint.save({"format": checkpoint.FORMAT, "steps": 1}, path)
    stale = tmp_path / f".run.ckpt.tmp-{_dead_pid()}-abc123.rp"  # what a SIGKILL mid-save leaves
    stale.write_bytes(b"\0" * 4096)
    alive = tmp_path / f".run.ckpt.tmp-{os.getppid()}-def456.rp"  # another process's save in progress
    alive.write_bytes(b"\0" * 16)
    other = tmp_path / f".other.ckpt.tmp-{_dead_pid()}-x.rp"  # another path's: not ours to remove
    other.write_bytes(b"\0")
    if then == "save":
        checkpoint.save({"format": checkpoint.FORMAT, "steps": 2}, path)
    else:
        assert checkpoint.load(path)["steps"] == 1
    assert not stale.exists() and alive.exists() and other.exists()


def test_a_save_killed_by_sigkill_leaves_a_temporary_file_the_next_load_removes(tmp_path):
    path = str(tmp_path / "run.ckpt")
    checkpoint.save({"format": checkpoint.FORMAT, "steps": 1}, path)
    script = (f"import os, signal, torch\nfrom rpcompile import checkpoint\n"
              f"real = torch.save\n"
              f"def dying(obj, f):\n    f.write(b'x' * 1000)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"torch.save = dying\n"
              f"checkpoint.save({{'format': checkpoint.FORMAT, 'steps': 2}}, {path!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # the killed save's leftover
    assert checkpoint.load(path)["steps"] == 1  # the previous checkpoint is intact
    assert [f for f in os.listdir(tmp_path) if ".tmp-" in f] == []


# -- a closed or failed handle: calls raise at once, never hang; a failure changes nothing ------------------
def _within(seconds: float, fn):
    """Run fn in a thread; fail if it neither returns nor raises within `seconds`. Returns its exception."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out["error"] = exc
    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"call did not return within {seconds} s (a hang)"
    return out.get("error")

# -- no hangs --------------------------------------------------------------------------------------------
def test_calls_on_a_closed_handle_raise_at_once():
    c = make()
    c.step(batch(0))
    c.close()
    for call in (lambda: c.step(batch(1)), lambda: c.evaluate(batch(1)), c.state_dict, c.model, c.stats,
                 lambda: c.step(batch(1, t=8))):
        err = _within(10, call)
        assert isinstance(err, RuntimeError) and "closed" in str(err)
    with make() as d:
        d.step(batch(0))
    assert isinstance(_within(10, lambda: d.step(batch(0))), RuntimeError)


def test_a_failed_replan_leaves_the_handle_working():
    with make() as c:
        c.step(batch(0))
        bad = batch(1, t=8)
        bad["labels"] = bad["labels"][:, :5]  # labels shorter than the inputs: planning the new shape fails
        assert _within(30, lambda: c.step(bad)) is not None
        assert _within(30, lambda: c.step(batch(2))) is None  # works as before


def test_a_failed_load_state_dict_changes_nothing_and_the_handle_works():
    with make() as c, make(model=TinyLlama(LlamaConfig(vocab=64, dim=32, layers=3, heads=4, kv_heads=2,
                                                               ffn=64, max_seq=32))) as other:
        c.step(batch(0))
        before = c.state_dict()["host"]["master"]  # flushes the pending update first
        err = _within(30, lambda: c.load_state_dict(other.state_dict()))
        assert isinstance(err, ValueError)
        assert all(torch.equal(before[n], v) for n, v in c.state.parameters_fp32().items())
        assert _within(30, lambda: c.step(batch(1))) is None


# -- a deadline shorter than the work -----------------------------------------------------------------------------
def _host_state(c) -> dict:
    """The handle's weights, optimizer state and step count, read as they are (no flush)."""
    sd = c.state.state_dict()
    return {k: sd[k] for k in ("master", "compute", "optim", "steps")}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_two_ms_deadline_on_a_busy_machine_fails_steps_cleanly_and_the_handle_trains_on():
    """compile(timeout=0.002) while a busy thread holds the GIL in 5 ms slices: each of 30 steps trains or fails
    with a RuntimeFailure from DeadlineExceeded that leaves the state of the last completed step (never the
    recovery's "did not drain"); with a normal deadline the run ends as the reference's, and close() is clean."""
    from rpcompile.runtime.streams.host import DeadlineExceeded
    from rpcompile.runtime.transfer import RuntimeFailure
    k = 5
    with _compile() as ref:
        want = [_host_state(ref)]
        for s in range(k):
            ref.step(_xy(s))
            ref.flush()
            want.append(_host_state(ref))
    c = _compile(timeout=0.002)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass
    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    failures = 0
    try:
        for _ in range(30):
            if c.steps == k:
                break
            try:
                c.step(_xy(c.steps))
            except RuntimeFailure as exc:
                failures += 1
                assert isinstance(exc.__cause__, DeadlineExceeded), str(exc)[:300]
                assert c.steps == exc.iteration and _equal(_host_state(c), want[c.steps])
    finally:
        stop.set()
        busy.join()
    c._runtime.timeout = 30  # the handle goes on under a normal deadline
    try:  # the last step's background work (its host lanes) began under the 2 ms deadline and may fail now
        c.flush()
    except RuntimeFailure as exc:
        failures += 1
        assert isinstance(exc.__cause__, DeadlineExceeded), str(exc)[:300]
        assert c.steps == exc.iteration and _equal(_host_state(c), want[c.steps])
    for s in range(c.steps, k):
        c.step(_xy(s))
    c.flush()
    assert _equal(_host_state(c), want[k])
    assert _within(30, c.close) is None
    assert failures
