"""Gantt charts of measured or simulated runs, several panels side by side.

Each panel is a list of records with `worker`, `lane`, `op`, `start`, `end`
(the simulator's `Timeline.records` and the runtime's `last_timeline` both
qualify). One row per worker: compute as tall bars, transfers as thin bars
underneath. matplotlib is imported only when drawing (the `plot` extra).
"""
from __future__ import annotations

from typing import Iterable, Sequence

COLORS = dict(F="tab:blue", X="tab:purple", R="tab:cyan", B="tab:green", U="tab:orange", P="tab:olive",
              D="tab:red", G="tab:brown", O="tab:gray", C="tab:pink", E="black")
_COMPUTE = frozenset("FXRB")


def compute_bubble(records: Iterable, gpus: int) -> float:
    """Idle share of the workers' compute lanes between the first start and the last end."""
    recs = [r for r in records if r.worker >= 0]
    if not recs:
        return 0.0
    t0, t1 = min(r.start for r in recs), max(r.end for r in recs)
    busy = sum(r.end - r.start for r in recs if _op(r) in _COMPUTE)
    return 1.0 - busy / (gpus * (t1 - t0)) if t1 > t0 else 0.0


def _op(r) -> str:
    """The op letter of a record (an Op enum value or a letter)."""
    op = r.op
    return getattr(op, "value", op)


def plot_panels(path: str, panels: Sequence[tuple[str, Sequence, int]], *, title: str = "") -> None:
    """Save one PNG with a Gantt chart per panel, side by side.

    Args:
        path: the PNG file to write.
        panels: (title, records, number of workers) per panel.
        title: a heading over all panels.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = max(n for _, _, n in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 0.45 * rows + 2), squeeze=False)
    for ax, (name, records, gpus) in zip(axes[0], panels):
        recs = [r for r in records if r.worker >= 0 and r.end > r.start]
        t0 = min((r.start for r in recs), default=0.0)
        scale, unit = (1e3, "ms") if max((r.end - t0 for r in recs), default=0) < 2 else (1.0, "s")
        for r in recs:
            op = _op(r)
            tall = op in _COMPUTE
            y = r.worker + (0.0 if tall else (0.3 if "up" in str(getattr(r.lane, "value", r.lane)) else 0.4))
            ax.barh(y, (r.end - r.start) * scale, left=(r.start - t0) * scale, height=0.55 if tall else 0.1,
                    color=COLORS.get(op, "k"), edgecolor="white" if tall else None, linewidth=0.2)
        ax.set_yticks(range(gpus))
        ax.set_yticklabels([f"GPU {w}" for w in range(gpus)])
        ax.set_ylim(gpus - 0.4, -0.6)
        ax.set_xlabel(unit)
        ax.set_title(f"{name}\nbubble {compute_bubble(recs, gpus):.1%}", fontsize=9)
    legend = [Patch(color=COLORS[k], label=v) for k, v in
              (("F", "forward"), ("X", "fused fwd+bwd"), ("R", "recompute"), ("B", "backward"),
               ("U", "activation up"), ("P", "params up"), ("D", "activation down"), ("G", "grads down"))]
    fig.legend(handles=legend, loc="lower center", ncol=8, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
