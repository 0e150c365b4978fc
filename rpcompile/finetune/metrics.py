"""Training metrics on disk: `OUT/metrics.jsonl`, and TensorBoard scalars with `report_to="tensorboard"`.

    >>> log = MetricsLog("out/", report_to=None, resume_at=0)          # doctest: +SKIP
    >>> log.write({"step": 1, "loss": 2.31, "lr": 2e-5})                # doctest: +SKIP
    >>> log.close()                                                      # doctest: +SKIP

One JSON object per line, one line per logged step (`python -m rpcompile finetune`
writes: step, loss, lr, grad_norm, tokens (real, no padding), trained_tokens, step_s,
tokens_per_s and trained_tokens_per_s (those over step_s), padded_tokens_per_s (every
position of the batch), peak_host_bytes, the runtime's counters of that step, eval_loss
and eval_token_accuracy on eval steps; with `--dtype fp16`, every line also has loss_scale, the
factor that step's loss was multiplied by, and skipped, true where an inf/nan gradient made the
dynamic loss scale skip its update (`scale_figures`; `skip_line` is what is printed for it)). A resumed run
(`resume_at=k`, the checkpoint's step) first drops every line of a step after k:
those steps run again, so no step is written twice (`read_records`: a torn last line is dropped, any
other line that is not a record refused, naming the file and the line). Lines are flushed as they are
written, so `tail -f OUT/metrics.jsonl` follows a run.

TensorBoard (`pip install "rpcompile[tensorboard]"`): the same numbers as
scalars in `OUT/tensorboard`, `train/<name>` per step, `eval/loss` and `eval/token_accuracy`, through
`torch.utils.tensorboard.SummaryWriter` (`tensorboard --logdir OUT/tensorboard`).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any

__all__ = ["MetricsLog", "METRICS_FILE", "TENSORBOARD_DIR", "check_report_to", "read_metrics", "read_records",
           "scale_figures", "skip_line"]

METRICS_FILE = "metrics.jsonl"  # in OUT
TENSORBOARD_DIR = "tensorboard"  # in OUT: the event files of report_to="tensorboard"


def check_report_to(report_to: str | None) -> None:
    """Raise ImportError in one line if `report_to` needs a package that is not installed."""
    if report_to != "tensorboard":
        return
    if importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard needs it
        raise ImportError('--report-to tensorboard needs tensorboard: pip install "rpcompile[tensorboard]" '
                          '(or pip install tensorboard)')


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a torn last line, from a killed run, is left out)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file a resumed run continues: a torn last line (a kill mid-write) is left out,
    and any other line that is not a JSON object with an integer "step" is a ValueError naming the file and the line.
    """
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if not raw.endswith(b"\n"):  # the last line, torn by a kill
                    break
                why = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"not JSON: {exc.msg}"
            else:
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and not isinstance(step, bool):
                    out.append(record)
                    continue
                why = (f'its "step" is {step!r}, not an integer' if isinstance(record, dict) else
                       f"a JSON {type(record).__name__}, not an object")
            raise ValueError(f"the metrics file {path!r} line {n} is not a metrics record ({why}): delete that line, "
                             f"or start the run over with --overwrite")
    return out


def scale_figures(verdict: Any) -> dict[str, Any]:
    """A step's dynamic loss scale figures from its check (`HostState.verdicts`): the scale its loss was multiplied by,
    and whether its update was skipped for an inf/nan gradient."""
    return {"loss_scale": verdict.used, "skipped": verdict.skipped}


def skip_line(step: int, verdict: Any) -> str:
    """The line printed for a skipped 1-based `step`.

    Example:
        >>> skip_line(3, SimpleNamespace(used=32768.0, skipped=True, after=16384.0))   # doctest: +SKIP
        'step 3: skipped (fp16 overflow), loss scale 32768 -> 16384'
    """
    return f"step {step}: skipped (fp16 overflow), loss scale {verdict.used:.10g} -> {verdict.after:.10g}"


class MetricsLog:
    """Appends records to `out/metrics.jsonl` (and TensorBoard); see the module docstring.

    Args:
        out: the run's folder.
        report_to: None, or "tensorboard" (also writes scalars to `out/tensorboard`).
        resume_at: the step the run continues from (0 for a new run); lines of later steps are dropped.
    """

    def __init__(self, out: str, *, report_to: str | None = None, resume_at: int = 0) -> None:
        check_report_to(report_to)
        self.path = os.path.join(out, METRICS_FILE)
        self._keep_until(resume_at)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(out, TENSORBOARD_DIR), purge_step=resume_at + 1)

    def _keep_until(self, step: int) -> None:
        """Rewrite the file without the lines of steps after `step` (atomically; a new run starts it empty)."""
        if not os.path.exists(self.path):
            return
        kept = [r for r in read_records(self.path) if r["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append one step's record (it has "step"); numbers also go to TensorBoard."""
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb is None:
            return
        step = record["step"]
        for key, value in _scalars(record):
            self._tb.add_scalar(f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}", value, step)
        self._tb.flush()

    def close(self) -> None:
        """Close the file and the TensorBoard writer."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(v: Any) -> Any:
    """A JSON-safe value: NaN and inf become null (JSON has no such numbers)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _scalars(record: dict[str, Any], prefix: str = ""):
    """(name, number) of every number in `record` but "step", nested dicts as "outer/inner"."""
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and math.isfinite(value):
            yield f"{prefix}{key}", value
