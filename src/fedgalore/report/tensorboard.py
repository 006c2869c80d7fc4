"""Optional TensorBoard export of run records (``pip install 'fedgalore[tensorboard]'``).

Reads the same files as the tables and plots — ``metrics.jsonl`` (train loss, eval metrics,
bytes, timings) and ``diagnostics.jsonl`` — and writes TensorBoard event files, one sub-folder
per run, with the communication round as the step. Reachable as
``fedgalore report RUN_OR_COMPARISON_DIR --tensorboard LOGDIR``; then ``tensorboard --logdir LOGDIR``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from fedgalore.report import ReportError, RunRecord, find_runs

__all__ = ["TensorBoardUnavailable", "write_tensorboard"]


class TensorBoardUnavailable(ReportError):
    """The ``tensorboard`` package is not installed."""


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TensorBoardUnavailable(
            "TensorBoard export needs the 'tensorboard' package, which is not installed; "
            "install it with: pip install 'fedgalore[tensorboard]'"
        ) from None
    return SummaryWriter


def _scalars(record: dict[str, Any], prefix: str) -> dict[str, float]:
    out = {}
    for k, v in record.items():
        if k == "round" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        tag = k if "/" in k else f"{prefix}/{k}"
        out[tag] = float(v)
    return out


def write_tensorboard(path: str | Path, log_dir: str | Path, runs: Sequence[RunRecord] | None = None) -> list[Path]:
    """Write event files for every run under ``path`` into ``log_dir/<run name>``; returns the folders."""
    SummaryWriter = _summary_writer()
    runs = list(runs) if runs is not None else find_runs(path)
    out = []
    for run in runs:
        target = Path(log_dir) / run.path.name
        writer = SummaryWriter(log_dir=str(target))
        try:
            for rec in run.history:
                step = int(rec.get("round", 0))
                for tag, v in _scalars(rec, "train").items():
                    writer.add_scalar(_metric_tag(tag), v, step)
            for rec in run.diagnostics:
                step = int(rec.get("round", 0))
                for tag, v in _scalars(rec, "diagnostics").items():
                    writer.add_scalar(tag, v, step)
            writer.add_text("summary", "\n".join(f"    {k}: {v}" for k, v in run.summary.items()))
        finally:
            writer.close()
        out.append(target)
    return out


def _metric_tag(tag: str) -> str:
    """Group metrics.jsonl keys: losses under train/, bytes under comm/, times under time/."""
    if not tag.startswith("train/"):
        return tag  # eval/<metric> and other namespaced keys keep their tag
    key = tag.split("/", 1)[1]
    if "bytes" in key:
        return f"comm/{key}"
    if key.startswith("time"):
        return f"time/{key}"
    return tag
