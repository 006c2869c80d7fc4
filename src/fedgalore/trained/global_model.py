"""A run's global model at one of its checkpoints, built as the round loop evaluates it.

The round loop evaluates the global model as ``method.load_global(runtime.model, state)`` on the
:class:`~fedgalore.engine.runtime.Runtime` its config builds (:meth:`Federation._evaluate`).
:func:`load_global_model` does the same from a run directory: the saved ``config.yaml`` (its
relative file paths read as the absolute ones its ``identity.json`` recorded), the
checkpoint of the chosen round (:func:`choose_round`: a kept round, the newest, or the best
validation round), the task and the method rebuilt from the config. It works on a finished, a
stopped (checkpointed but not complete) and a resumed run alike: all three keep the same files —
and on a live run (a process running it now): :attr:`GlobalModel.live` then says so and which
round was taken (:func:`~fedgalore.records.liveness.live_note`).

:func:`merged_model` turns the prepared model (PEFT-wrapped for the LoRA baselines) into the
plain model with every adapter merged into its weights; :func:`probe_logits` is the check every
export is judged by (the logits of a few test examples).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedgalore.job.config import ConfigError, FederatedConfig, load_config
from fedgalore.records.identity import IDENTITY_FILE, with_recorded_paths
from fedgalore.job.resolve import check_device, config_for_method
from fedgalore.records.liveness import live_note, run_state
from fedgalore.records.rundir import saved_summary
from fedgalore.engine.runtime import Runtime
from fedgalore.federated.checkpoint import CheckpointError, kept_rounds, load_checkpoint
from fedgalore.jsonl import read_jsonl
from fedgalore.methods.base import Method
from fedgalore.protocol.state import ServerState
from fedgalore.tasks.base import Task

__all__ = ["ExportError", "GlobalModel", "run_config", "choose_round", "load_global_model", "merged_model",
           "probe_batch", "probe_logits", "format_rounds"]


class ExportError(ConfigError):
    """A run cannot be exported or evaluated as asked (one line that says what to change)."""


@dataclass
class GlobalModel:
    """The global model of ``run_dir`` after ``round`` completed rounds: ``runtime.model`` holds
    it, prepared by the method (PEFT-wrapped for the LoRA baselines) with the checkpoint's state
    loaded by ``method.load_global`` — the model the round loop evaluates."""

    run_dir: Path
    round: int
    cfg: FederatedConfig
    runtime: Runtime
    state: ServerState
    #: set when a process was running the run as it was read: which round this took (fedgalore.records.liveness.live_note)
    live: str | None = None

    @property
    def task(self) -> Task:
        return self.runtime.task

    @property
    def method(self) -> Method:
        return self.runtime.method

    @property
    def model(self) -> nn.Module:
        return self.runtime.model

    def record(self) -> dict[str, Any]:
        """The run's ``metrics.jsonl`` record of this round ({} when absent)."""
        return next((r for r in read_jsonl(self.run_dir / "metrics.jsonl") if int(r.get("round", -1)) == self.round), {})


def format_rounds(rounds: list[int]) -> str:
    return ", ".join(map(str, rounds)) if rounds else "none"


def run_config(run_dir: str | Path) -> FederatedConfig:
    """The saved config of the run in ``run_dir``; :class:`ExportError` when it is not a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} does not exist; pass the run directory `fedgalore run` printed after 'run dir:'")
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml); pass the directory `fedgalore run` "
                          "printed after 'run dir:'")
    return load_config(run_dir / "config.yaml")


def choose_round(run_dir: str | Path, round: int | None = None, best: bool = False) -> int:  # noqa: A002
    """The round to export: ``round`` (it must have a kept checkpoint), the best validation round
    (``best``), else the newest kept checkpoint. The best round is the one whose
    ``eval/val_<primary metric>`` is best in ``metrics.jsonl`` (the earliest on a tie); it needs
    a validation split (``federation.validation_fraction > 0``): choosing on the test set would
    make the exported test metric a biased estimate, so without one it is an error."""
    run_dir = Path(run_dir)
    if round is not None and best:
        raise ExportError("--round and --best exclude each other; give one of them")
    kept = kept_rounds(run_dir)
    if not kept:
        state = run_state(run_dir)
        if state.live:
            raise ExportError(f"{run_dir} is live (process {state.pid} is running it, {state.rounds_completed or 0}/"
                              f"{state.rounds or '?'} rounds done) and has no checkpoint yet; try again once its first "
                              f"round is checkpointed (watch it: fedgalore status {run_dir})")
        raise ExportError(f"{run_dir} has no checkpoint yet (the run stopped before its first one); nothing to export — "
                          f"continue the run with `fedgalore run --resume {run_dir}`")
    if round is not None:
        if int(round) not in kept:
            raise ExportError(f"{run_dir} keeps no checkpoint of round {round}; kept rounds: {format_rounds(kept)} "
                              "(a run keeps its newest output.keep_checkpoints checkpoints)")
        return int(round)
    if not best:
        return kept[-1]
    summary = saved_summary(run_dir)
    metric, higher = summary.get("primary_metric"), bool(summary.get("higher_is_better", True))
    key = f"eval/val_{metric}"
    scored = [(int(r["round"]), float(r[key])) for r in read_jsonl(run_dir / "metrics.jsonl")
              if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    if not scored:
        raise ExportError(f"--best chooses by the validation metric and {run_dir} has no validation split "
                          "(federation.validation_fraction=0; choosing on the test set would bias the test metric): "
                          "run with federation.validation_fraction=0.1 (and output.keep_checkpoints=<rounds> to keep "
                          f"every round), or export a kept round with --round N (kept: {format_rounds(kept)})")
    best_round, value = scored[0]
    for r, v in scored[1:]:
        if (v > value) if higher else (v < value):
            best_round, value = r, v
    if best_round not in kept:
        raise ExportError(f"the best validation round of {run_dir} is {best_round} (val_{metric}={value:.4f}) but its "
                          f"checkpoint was not kept (kept rounds: {format_rounds(kept)}); rerun with "
                          "output.keep_checkpoints=<rounds> to keep every round, or export one with --round N")
    return best_round


def load_global_model(run_dir: str | Path, *, round: int | None = None, best: bool = False,  # noqa: A002
                      task: Task | None = None, method: Method | None = None, device: str = "cpu") -> GlobalModel:
    """The global model of the run in ``run_dir`` at the round :func:`choose_round` picks, on
    ``device``. ``task`` / ``method``: the objects the run was given instead of built from its
    config (``fedgalore.run(cfg, task=...)``), as for :func:`fedgalore.run`."""
    run_dir = Path(run_dir)
    saved = with_recorded_paths(run_config(run_dir), run_dir / IDENTITY_FILE)  # its data files, from any working directory
    chosen = choose_round(run_dir, round, best)
    check_device(device)
    data = saved.to_dict()
    data["device"] = device
    cfg = FederatedConfig.from_dict(data)
    cfg = config_for_method(cfg.validate()) if method is None else cfg.validate()
    try:
        state, _ = load_checkpoint(run_dir, chosen)
    except CheckpointError as exc:
        raise ExportError(f"{exc}; export another kept round with --round N (kept: {format_rounds(kept_rounds(run_dir))})") from None
    runtime = Runtime(cfg, task=task, method=method)
    runtime.method.load_global(runtime.model, state)
    runtime.model.eval()
    return GlobalModel(run_dir, chosen, cfg, runtime, state, live_note(run_dir, chosen))


def merged_model(model: nn.Module) -> nn.Module:
    """The plain model of a prepared one: a PEFT-wrapped model with its adapters merged into the
    base weights (``W ← W + s·BA``, PEFT's ``merge_and_unload``; the wrapped model is consumed),
    any other model as it is (FedAvg-Full and FedGaLore train the weights themselves)."""
    merge = getattr(model, "merge_and_unload", None)
    return merge() if callable(merge) else model


def probe_batch(task: Task, n: int = 8) -> dict[str, torch.Tensor]:
    """The first ``n`` test examples of ``task`` as one batch (what an export is checked on)."""
    examples = task.test_set()
    idx = list(range(min(int(n), len(examples))))
    if not idx:
        raise ExportError(f"task {task.name!r} has an empty test set: nothing to check the export on")
    return examples.batch(idx) if hasattr(examples, "batch") else task.collate([examples[i] for i in idx])


@torch.no_grad()
def probe_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(**batch).logits`` in fp32 on the CPU (eval mode)."""
    model.eval()
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
