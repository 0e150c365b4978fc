"""Assemble docs/BENCHMARKS.md from the reports the bench scripts wrote under docs/bench/.

Each bench script prints its table and writes `docs/bench/<name>.md` with the
exact command, date and machine; this script only concatenates them, in a
fixed order, under one index. Run it after any bench script:

    python bench/collect.py
"""
from __future__ import annotations

import os

ORDER = ("trace", "costs", "long_seq", "partition", "partition_qwen3-235b-a22b", "plan_stability", "compile_zoo",
         "schedules_sim", "schedules", "plan_cli", "runtime_cpu", "runtime_cpu_compare", "optimizer", "optimizer_passes", "dispatch_mode", "checkpoint_memory",
         "data_memory", "token_cache_checks", "finetune_startup", "distributed", "gpu")
TITLES = {
    "trace": "Trace time (issue 2)", "costs": "Cost model: predicted vs measured (issue 3)",
    "partition": "Partition: planning time and plan quality (issues 4, 15, 31)",
    "partition_qwen3-235b-a22b": "Partition: qwen3-235b-a22b against the old search (issue 15)",
    "long_seq": "Long sequences: max_seq_len of the paper models, eager vs SDPA pricing (issue 13)",
    "plan_stability": "Plan stability: fresh-process compiles on a loaded machine (issues 14, 26, 31)",
    "compile_zoo": "compile() of the tests' transformers models, now and before (issue 31)",
    "schedules_sim": "Simulated bubble vs bound-stage baselines (issue 5)",
    "schedules": "The five paper models on 8x RTX 4090, simulated; both recipes against the paper (issues 8, 33)",
    "runtime_cpu": "Runtime on this CPU: compiled vs eager, host waits, allocations (issues 6, 12)",
    "runtime_cpu_compare": "Runtime on this CPU: compiled / eager now and before the host optimizer's kernels (issue 32)",
    "optimizer": "The host optimizer at memory speed (issues 6, 32)",
    "optimizer_passes": "The host side pass by pass, against the tree before the streamed compute copies (issue 48)",
    "dispatch_mode": "The RNG dispatch mode's cost on a layer with dropout (issue 22)",
    "checkpoint_memory": "Checkpoint memory: peak extra RSS of save and load (issue 23)", "distributed": "Data parallelism across processes (issue 9)",
    "data_memory": "Fine-tuning data: peak RSS of tokenizing and packing (issue 25)",
    "token_cache_checks": "Token cache checks: the digest at open, the size check per batch (issue 34)",
    "finetune_startup": "Fine-tuning start-up: where a tiny finetune run's time goes, now and before (issue 35)",
    "gpu": "GPU run (bench/gpu.sh, issue 12)",
    "plan_cli": "The plan command on the paper models (issues 7, 31)",
}


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(root, "docs", "bench")
    found = [n for n in ORDER if os.path.exists(os.path.join(folder, n + ".md"))]
    extra = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".md") and f[:-3] not in ORDER)
    parts = ["# Benchmarks\n",
             "Every table below is the real output of the script named in its section, with the command, "
             "date and machine. Comparisons are ratios taken in the same run; the CPU machine is a shared "
             "2-core VM, so absolute times are noisy. Regenerate a section by running its script, then "
             "`python bench/collect.py`.\n"]
    parts += [f"- [{TITLES.get(n, n)}](#{n.replace('_', '-')})" for n in found + extra]
    for n in found + extra:
        with open(os.path.join(folder, n + ".md")) as f:
            body = f.read().strip()
        parts.append(f'\n<a id="{n.replace("_", "-")}"></a>\n\n{_demote(body)}\n')
    with open(os.path.join(root, "docs", "BENCHMARKS.md"), "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote docs/BENCHMARKS.md from {len(found + extra)} reports")


def _demote(text: str) -> str:
    """Turn each report's top-level headings into second-level ones."""
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


if __name__ == "__main__":
    main()
