"""`finetune` across servers (issue 25, item 6): 2 gloo processes launched as torchrun would == 1 process with
the same global batch; only rank 0 writes; --resume from rank 0's checkpoint; a world that does not divide
--microbatches is refused."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from rpcompile.finetune.dist import Ranks  # noqa: E402
from rpcompile.finetune.metrics import read_metrics  # noqa: E402
import dist_launch  # noqa: E402
import hf_fixtures as fx  # noqa: E402

WORLD = 2
FLAGS = ["--seq", "32", "--micro-batch-size", "2", "--microbatches", "4", "--gpus", "2", "--lr", "3e-3",
         "--warmup", "1", "--memory-gib", str(2**19 / 2**30), "--lm-head-shards", "1", "--no-progress",
         "--steps", "4", "--save-every", "2"]


def worker(argv: list[str], stop_at: int) -> None:
    """One process: `python -m rpcompile finetune ARGV`; with stop_at, killed by an error after that step."""
    from rpcompile.finetune.run import finetune
    from rpcompile.cli.finetune import config_from_args
    from rpcompile.cli.main import main, parser
    if not stop_at:
        sys.exit(main(["finetune", *argv]))

    def on_step(step: int, loss: float) -> None:
        if step == stop_at:
            os._exit(7)  # dies after the step's checkpoint, as a crash would
    finetune(config_from_args(parser().parse_args(["finetune", *argv])), on_step=on_step)


def launch(argv_of_rank, stop_at: int = 0, timeout: float = 150):
    """`worker` as WORLD processes with torchrun's environment."""
    return dist_launch.launch([f"from tests.finetune.test_finetune_dist import worker; worker({argv_of_rank(r)!r}, {stop_at})"
                               for r in range(WORLD)], timeout)


def weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process in this one; two processes that die after step 2's checkpoint, then resume to step 4."""
    d = tmp_path_factory.mktemp("ft_dist")
    rows = fx.text_rows()
    model, data = fx.model_folder(d / "tiny"), fx.write_jsonl(d / "train.jsonl", rows[:40])
    base = ["--model", model, "--data", data, *FLAGS]
    single = d / "single"
    from rpcompile.cli.main import main
    assert main(["finetune", *base, "--out", str(single)]) == 0
    stopped = launch(lambda r: [*base, "--out", str(d / f"rank{r}")], stop_at=2)
    resumed = launch(lambda r: [*base, "--out", str(d / f"rank{r}"), "--resume"])
    return SimpleNamespace(d=d, single=str(single), stopped=stopped, resumed=resumed)


def test_two_processes_train_as_one_with_the_same_global_batch_and_resume(runs):
    assert [r.returncode for r in runs.stopped] == [7, 7], runs.stopped[0].stderr[-3000:]
    for r in runs.resumed:
        assert r.returncode == 0, r.stderr[-3000:]
    one = [r["loss"] for r in read_metrics(os.path.join(runs.single, "metrics.jsonl"))]
    two = read_metrics(os.path.join(runs.d, "rank0", "metrics.jsonl"))
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # steps 1-2 before the crash, 3-4 after the resume
    assert len(one) == 4 and [r["loss"] for r in two] == pytest.approx(one, rel=1e-5)
    a, b = weights(runs.single), weights(str(runs.d / "rank0"))
    for n, v in a.items():
        assert torch.allclose(b[n], v, rtol=1e-5, atol=1e-5 * v.abs().max().item()), n
    assert not (runs.d / "rank1").exists()  # rank 1 wrote nothing: no folder, no cache, no checkpoint
    assert "4 steps of 8 sequences (4 microbatches x 2)" in runs.stopped[0].stdout
    assert "on each of 2 processes" in runs.resumed[1].stdout and "resumed at step 2" in runs.resumed[1].stdout


def test_a_world_that_does_not_divide_the_microbatches_is_refused():
    assert Ranks(rank=1, world=2).microbatches(4) == 2
    with pytest.raises(ValueError, match="--microbatches 3 counts the microbatches of all 2 processes"):
        Ranks(rank=0, world=2).microbatches(3)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stray_rank_and_world_size_end_within_the_dist_deadline_in_one_line(rank, tmp_path, monkeypatch, capsys):
    """RANK/WORLD_SIZE left in the environment and no other rank: a line saying what it waits for, at which
    address and from where the values come; then, within --dist-timeout, one line of error (exit 2)."""
    import socket
    import time
    from rpcompile.cli.main import main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    rc = main(["finetune", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--out",
               str(tmp_path / "o"), "--dist-timeout", "2"])
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    what = "1 more rank(s) to join" if rank == 0 else "rank 0"
    assert out.splitlines() == [f"rank {rank} of 2: waiting up to 2 s (--dist-timeout) for {what} at "
                                f"127.0.0.1:{port} (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the "
                                f"environment)"]
    (line,) = err.strip().splitlines()
    assert rc == 2 and line.startswith(f"python -m rpcompile finetune: error: distributed start: rank {rank} of 2 "
                                       f"gave up at 127.0.0.1:{port} after --dist-timeout 2 s (")
    assert line.endswith("start every rank, raise --dist-timeout, or unset WORLD_SIZE (it comes from the "
                         "environment) to train alone")
    assert 2 <= took < 2 + 15, took


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, runs):
    """Two processes with --shard-state that die after step 2's checkpoint, then resume to step 4; the same
    checkpoint resumed by one process alone, its rank-1 slice copied into its out."""
    import shutil
    d = runs.d
    base = ["--model", str(d / "tiny"), "--data", str(d / "train.jsonl"), *FLAGS]
    stopped = launch(lambda r: [*base, "--out", str(d / f"shard{r}"), "--shard-state"], stop_at=2)
    alone = d / "alone"
    shutil.copytree(d / "shard0", alone)
    shutil.copy(d / "shard1" / "rpcompile-checkpoint.rp.shard1-of-2", alone)
    resumed = launch(lambda r: [*base, "--out", str(d / f"shard{r}"), "--shard-state", "--resume"])
    from rpcompile.cli.main import main
    rc = main(["finetune", *base, "--out", str(alone), "--resume"])
    return SimpleNamespace(stopped=stopped, resumed=resumed, alone=str(alone), rc=rc)


def test_two_processes_with_sharded_state_train_as_one_and_resume_on_two_or_one(runs, sharded):
    assert [r.returncode for r in sharded.stopped] == [7, 7], sharded.stopped[0].stderr[-3000:]
    for r in sharded.resumed:
        assert r.returncode == 0, r.stderr[-3000:]
    assert sharded.rc == 0
    one = [r["loss"] for r in read_metrics(os.path.join(runs.single, "metrics.jsonl"))]
    a = weights(runs.single)
    for out in (runs.d / "shard0", sharded.alone):
        got = read_metrics(os.path.join(out, "metrics.jsonl"))
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        assert [r["loss"] for r in got] == pytest.approx(one, rel=1e-5)
        b = weights(str(out))
        for n, v in a.items():
            assert torch.allclose(b[n], v, rtol=1e-5, atol=1e-5 * v.abs().max().item()), (out, n)
    assert (runs.d / "shard1" / "rpcompile-checkpoint.rp.shard1-of-2").exists()  # rank 1 wrote its slice only
    assert not (runs.d / "shard1" / "rpcompile-checkpoint.rp").exists()


def test_shard_state_alone_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    from rpcompile.cli.main import main
    rc = main(["finetune", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--out",
               str(tmp_path / "o"), "--shard-state"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "--shard-state splits the optimizer state over the servers of a torchrun run" in line
    assert not (tmp_path / "o").exists()
