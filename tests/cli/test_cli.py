"""The command line: train (with resume), plan --save-program, simulate from the saved files."""
import json
import os
import subprocess
import sys

import pytest

import rpcompile
from paths import ROOT  # noqa: E402 - tests/ is on sys.path (tests/conftest.py)

ROOT = ROOT


def cli(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "rpcompile", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_train_saves_and_resumes(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(open(os.path.join(ROOT, "README.md"), "rb").read() * 4)
    cfg = dict(text="corpus.txt", steps=2, gpus=2, microbatches=2, batch=4, seq=32, dim=32, layers=2,
               save="run.ckpt")
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    out = cli("train", "--config", "run.json", cwd=tmp_path)
    assert "step 2: loss" in out and (tmp_path / "run.ckpt").exists()
    (tmp_path / "run.json").write_text(json.dumps({**cfg, "steps": 3, "resume": True}))
    out = cli("train", "--config", "run.json", cwd=tmp_path)
    assert "resumed run.ckpt at step 2" in out and "step 3: loss" in out and "step 2:" not in out


def test_plan_then_simulate_the_saved_program(tmp_path):
    pytest.importorskip("transformers")
    # LoRA-style (--frozen-base): the frozen matrices keep only their bf16 copies (1.7B x 2 B), which fit 8 GiB
    out = cli("plan", "--model", "qwen3-1.7b", "--gpus", "4", "--seq", "256", "--microbatches", "4",
              "--frozen-base", "--host-memory", "8", "--save-program", "p.csv", "--servers", "2", cwd=tmp_path)
    assert "rpcompile (RoundPipe)" in out and "GPipe" in out
    assert "\n2 data-parallel servers without --shard-state: each holds the whole parameter state" in out, out
    limit = next(line for line in out.splitlines() if line.startswith("max_seq_len"))
    assert limit.startswith("max_seq_len on 4x rtx4090, 1 sequence per microbatch: ") and " tokens; at " in limit
    assert "the host: " in limit or "the device: " in limit, limit  # the binding term is named
    host = next(line for line in out.splitlines() if line.startswith("host memory:"))
    assert "the saved inputs and values crossing cuts in an arena of" in host, host  # the packed activations
    assert "needed on each server of 8.0 GiB (--host-memory): fits" in host, host
    out = cli("simulate", "--program", "p.csv", "--iterations", "2", "--trace", "t.json", cwd=tmp_path)
    assert out.startswith("Timeline(gpus=4, iterations=2)")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_unknown_model_lists_the_presets(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rpcompile", "plan", "--model", "gpt-5"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and "qwen3-1.7b" in r.stderr and "gpt-5" in r.stderr and "Traceback" not in r.stderr


def run_plan(capsys, *args):
    """`python -m rpcompile plan ...` in this process -> (exit status, stdout, stderr)."""
    from rpcompile.cli.main import main
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_refuses_a_run_over_the_host_memory(capsys):
    pytest.importorskip("transformers")
    # Qwen3-32B full fine-tuning: ~549 GiB of parameter state alone against the preset's 512 GiB.
    rc, out, err = run_plan(capsys, "--model", "qwen3-32b", "--gpus", "8", "--hardware", "rtx4090")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and not out, err
    for part in ("host memory: the run needs", "bytes: weights", "fp32 masters", "gradients", "optimizer state",
                 "rtx4090 host memory is 512.0 GiB", "LoRA"):
        assert part in err, part


def test_plan_with_the_state_sharded_over_servers_counts_one_servers_share(capsys):
    # Qwen3-32B (610 GiB unsharded on one 512 GiB server): each of 4 servers holds 1/4 of the masters and moments
    pytest.importorskip("transformers")
    run = ("--model", "qwen3-32b", "--gpus", "8", "--hardware", "rtx4090", "--seq", "2048", "--microbatches", "16")
    rc, out, err = run_plan(capsys, *run, "--servers", "4", "--shard-state")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("host memory:"))
    assert rc == 0 and lines[at].endswith("needed on each server of 512.0 GiB (rtx4090 preset): fits"), err
    assert "fp32 masters 30.5 GiB (1 of 4 shares), gradients 122.0 GiB, optimizer state 61.0 GiB (1 of 4 shares)" \
        in lines[at]
    assert lines[at + 1] == ("sharded optimizer state over 4 servers: each holds 1/4 of the masters and moments "
                             "(91.5 GiB of 366.1 GiB; the largest share, server 0's, is counted)")
    assert lines[at + 2].startswith("parameter state on one server of 4 (its share of the masters and moments): "
                                    "9.0 B per trainable parameter (compute copy 2.0, master 1.0, gradient 4.0, "
                                    "optimizer state 2.0; staleness 1 adds 2.0 for the undo copy)")
    limit = next(line for line in lines if line.startswith("max_seq_len"))
    assert "fp32 masters (1 of 4 shares) 30.5 GiB" in limit, limit  # the longest sequence counts the same share
    rc, out, err = run_plan(capsys, *run, "--servers", "4")  # each server holds all of it: refused, as one is
    assert rc == 2 and not out and err.count("\n") == 1 and "the run needs 610.2 GiB" in err, err
    assert "or shard the masters and optimizer state over data-parallel servers" in err
    for flags, says in ((("--shard-state",), "--shard-state needs --servers W with W > 1"),
                        (("--shard-state", "--servers", "1"), "--shard-state needs --servers W with W > 1"),
                        (("--servers", "0"), "argument --servers: must be a positive integer")):
        rc, out, err = run_plan(capsys, *run, *flags)
        assert rc == 2 and not out and err.count("\n") == 1 and says in err, (flags, err)


def test_plan_prints_the_parameter_state_per_trainable_parameter_beside_the_host_memory_line(capsys):
    pytest.importorskip("transformers")
    small = ("--model", "qwen3-1.7b", "--gpus", "4", "--seq", "256", "--microbatches", "4")
    outs = {}
    for dtype, per in (("fp32", "18.0"), ("bf16", "14.0")):
        rc, out, err = run_plan(capsys, *small, *(("--state-dtype", dtype) if dtype == "bf16" else ()))
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("host memory:"))
        assert rc == 0 and lines[at + 1] == (
            f"parameter state: {per} B per trainable parameter (compute copy 2.0, master 4.0, gradient 4.0, "
            f"optimizer state {'8.0' if dtype == 'fp32' else '4.0'}"
            f"{'; staleness 1 adds 2.0 for the second compute copy' if dtype == 'fp32' else ''}), "  # split: none
            f"{dtype} moments (--state-dtype)"), out
        assert ("fp32 masters 6.4 GiB (split: bf16 halves and low halves)" in lines[at]) == (dtype == "bf16")
        assert lines[at].endswith(" needed of 512.0 GiB (rtx4090 preset): fits"), lines[at]  # one server: not "each"
        outs[dtype] = [line for i, line in enumerate(lines) if i not in (at, at + 1) and "planned in" not in line]
    longest = {d: next(k for k, line in enumerate(out) if line.startswith("max_seq_len")) for d, out in outs.items()}
    tokens = {d: int(outs[d].pop(k).split(": ")[1].split(" tokens")[0].replace(",", "")) for d, k in longest.items()}
    assert tokens["bf16"] > tokens["fp32"]  # the host binds the longest sequence: 4 bytes less a parameter
    assert outs["fp32"] == outs["bf16"]  # the rest of the output is the same
    rc, _, err = run_plan(capsys, *small, "--state-dtype", "fp16")
    assert rc == 2 and "--state-dtype" in err and len(err.strip().splitlines()) == 1, err
    rc, out, err = run_plan(capsys, *small, "--state-dtype", "bf16", "--master-dtype", "bf16")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("host memory:"))
    assert rc == 0 and lines[at + 1] == (
        "parameter state: 12.0 B per trainable parameter (compute copy 2.0, master 2.0, gradient 4.0, optimizer "
        "state 4.0), bf16 moments (--state-dtype), bf16 master (--master-dtype)"), out  # the master is the second copy
    assert "bf16 masters" in lines[at]
    rc, _, err = run_plan(capsys, *small, "--master-dtype", "fp16")
    assert rc == 2 and "--master-dtype" in err and len(err.strip().splitlines()) == 1, err
    rc, out, err = run_plan(capsys, *small, "--state-dtype", "bf16", "--master-dtype", "bf16", "--grad-dtype", "bf16")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("host memory:"))
    assert rc == 0 and lines[at + 1] == (
        "parameter state: 10.0 B per trainable parameter (compute copy 2.0, master 2.0, gradient 2.0, optimizer "
        "state 4.0), bf16 moments (--state-dtype), bf16 master (--master-dtype), bf16 gradients "
        "(--grad-dtype)"), out
    rc, _, err = run_plan(capsys, *small, "--grad-dtype", "fp16")
    assert rc == 2 and "--grad-dtype" in err and len(err.strip().splitlines()) == 1, err


def test_plan_plans_with_the_lean_state_it_is_given(capsys):
    # 30 GiB holds the lean run (21 GiB) but not the default one (30.6 GiB): each plan counts its own state,
    # the round-size choice and the final check included (before, the planner counted an fp32 AdamW's)
    pytest.importorskip("transformers")
    small = ("--model", "qwen3-1.7b", "--gpus", "4", "--seq", "256", "--microbatches", "4", "--host-memory", "30")
    rc, _, err = run_plan(capsys, *small)
    assert rc == 2 and "fp32 masters" in err and len(err.strip().splitlines()) == 1, err
    rc, out, err = run_plan(capsys, *small, "--state-dtype", "bf16", "--master-dtype", "bf16")
    assert rc == 0 and "bf16 masters" in out and "GiB (--host-memory): fits" in out, err


def test_plan_host_memory_overrides_the_preset(capsys):
    pytest.importorskip("transformers")
    small = ("--model", "qwen3-1.7b", "--gpus", "4", "--seq", "256", "--microbatches", "4")
    rc, _, err = run_plan(capsys, *small, "--host-memory", "1")  # 28.8 GiB of state: refused before planning
    assert rc == 2 and "the host memory limit is 1.0 GiB" in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = run_plan(capsys, *small, "--host-memory", "-1")
    assert rc == 2 and "--host-memory must be a positive number of GiB" in err, err


def test_plan_ends_with_its_output_written_and_without_the_interpreters_teardown():
    # the process ends once its output is flushed (os._exit): an atexit handler, as the teardown, never runs
    pytest.importorskip("transformers")
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
            "sys.argv = ['rpcompile', 'plan', '--model', 'qwen3-1.7b', '--gpus', '4', '--seq', '256',"
            " '--microbatches', '4']\n"
            "runpy.run_module('rpcompile', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout.rstrip().splitlines()[-1].startswith("planned in"), r.stderr[-2000:]
    assert "teardown ran" not in r.stderr


@pytest.mark.parametrize("command, collects", [("plan", False), ("simulate", False), ("train", True),
                                               ("finetune", True)])
def test_only_the_short_commands_run_without_cyclic_garbage_collection(command, collects):
    # plan and simulate skip the collector's sweeps over the imports' objects; training keeps it
    code = ("import gc, runpy, sys\n"
            f"sys.argv = ['rpcompile', {command!r}, '--help']\n"
            "try:\n    runpy.run_module('rpcompile', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('collects', gc.isenabled())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.stdout.strip().endswith(f"collects {collects}"), r.stdout[-500:] + r.stderr[-2000:]


@pytest.mark.parametrize("command, collects", [("plan", False), ("simulate", False), ("train", True)])
def test_python_dash_m_imports_torch_already_without_the_collector_for_the_short_commands(tmp_path, command,
                                                                                         collects):
    # `python -m rpcompile` imports the package (and torch) before __main__ runs: the package decides, from the
    # interpreter's own command line, so torch's import is not swept (~0.3 s of plan); other commands collect
    (tmp_path / "sitecustomize.py").write_text(
        "import gc, sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print('torch imported, collects', gc.isenabled(), file=sys.stderr)\n"
        "            sys.meta_path.remove(self)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Spy())\n")
    r = subprocess.run([sys.executable, "-m", "rpcompile", command, "--help"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"torch imported, collects {collects}" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv, short", [
    (["python", "-m", "rpcompile", "plan", "--model", "m"], True),
    (["python", "-X", "importtime", "-m", "rpcompile", "simulate"], True),
    (["python", "-I", "-mrpcompile", "plan"], True),
    (["python", "-m", "rpcompile", "finetune"], False),
    (["python", "-m", "rpcompile"], False),
    (["python", "-m", "pytest", "plan"], False),
    (["python", "-c", "import rpcompile", "-m", "rpcompile", "plan"], False),
    (["python", "run.py", "-m", "rpcompile", "plan"], False),
    (["python"], False)])
def test_the_short_command_is_read_from_the_interpreters_command_line(argv, short):
    # a library user's `import rpcompile` never turns the collector off: only `python -m rpcompile plan|simulate`
    assert rpcompile._short_command(argv) is short
