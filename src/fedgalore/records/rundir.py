"""The run directory: every file a run writes besides its checkpoints (docs/cli.md, "Run directories").

::

    <run>/config.yaml         the resolved config (what ran: the method's own options)
          identity.json       what shaped the run (fedgalore.records.identity): compared before reusing it
          partition.json      the split: per client its name, size and category histogram
          partition.png       the split drawn (fedgalore.job.partition_files)
          task.json           the task's description (sizes, labels, model)
          environment.json    versions, CPU and kernel set, the method as it ran (describe())
          metrics.jsonl       one record per round (losses, evaluation, bytes, times)
          clients.jsonl       one record per client per round (examples, losses, errors)
          ledger.jsonl        one record per message (bytes by entry kind)
          diagnostics.jsonl   one record per round (the two mismatches, sync diagnostics)
          metrics.csv         metrics.jsonl as a table, rewritten every round
          summary.json        status (running | complete | failed | interrupted), rounds done, pid and
                              heartbeat (kept current every round), final / best metrics, traffic, wall time
          run.lock            while a process runs it: that process (fedgalore.records.liveness)
          checkpoints/        fedgalore.federated.checkpoint

:func:`choose_run_dir` picks the directory (and refuses one that already holds this run: the same
identity, :mod:`fedgalore.records.identity`);
:class:`RunDirectory` writes the files; :func:`run_summary` is ``summary.json``;
:func:`extension_problem` says whether a stopped run can be continued to more rounds exactly.
"""
from __future__ import annotations

import csv
import json
import math
import platform
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fedgalore.job.config import ConfigError, FederatedConfig, load_config
from fedgalore.records.identity import (Difference, RunIdentity, compare_with_saved, run_identity, summarize, task_label,
                                       write_identity)
from fedgalore.records.liveness import LOCK_FILE, is_finished, run_state
from fedgalore.job.partition_files import partition_record, wait_for_partition_png, write_partition_files
from fedgalore.federated.checkpoint import atomic_write_text
from fedgalore.jsonl import append_jsonl, read_json, read_jsonl
from fedgalore.optim import cpu_kernels
from fedgalore.protocol.payload import Ledger
from fedgalore.tasks.base import Task

__all__ = ["RunDirectory", "choose_run_dir", "run_summary", "saved_summary", "extension_problem", "missing_dirs",
           "discard_unstarted"]


class RunDirectory:
    """The files of one run under ``path`` (module doc)."""

    LOG_FILES = ("metrics.jsonl", "clients.jsonl", "ledger.jsonl", "diagnostics.jsonl")

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        #: what the server may write about a site (fedgalore.privacy.view.ServerView; set by :meth:`write_static`)
        self.view: Any = None

    # ------------------------------------------------------------------ start / resume
    def start_fresh(self) -> None:
        """A run from round 0: drop the logs of an earlier attempt without a checkpoint."""
        self.path.mkdir(parents=True, exist_ok=True)
        for f in self.LOG_FILES:
            (self.path / f).unlink(missing_ok=True)

    def restore(self, rounds_done: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Resuming after ``rounds_done`` checkpointed rounds: keep only the log records of those
        rounds (later ones were written by rounds the checkpoint does not hold); returns the
        metrics history and the ledger records."""
        history = _jsonl_truncate(self.path / "metrics.jsonl", rounds_done)
        ledger: list[dict[str, Any]] = []
        for f in self.LOG_FILES[1:]:
            recs = _jsonl_truncate(self.path / f, rounds_done)
            if f == "ledger.jsonl":
                ledger = recs
        return history, ledger

    def write_static(self, cfg: FederatedConfig, runtime: Any, identity: RunIdentity | None = None) -> dict[str, Any]:
        """config.yaml, identity.json, partition.json and partition.png, task.json and
        environment.json. A task object passed in code is recorded in config.yaml as what it is
        (``task.object``: its class; its name and the options it reports), not as the config's task.
        Returns the partition record (its ``warnings``: what the run says before training)."""
        from omegaconf import OmegaConf

        task, method = runtime.task, runtime.method
        identity = identity or run_identity(cfg)
        saved = cfg.to_dict()
        if identity.task_object is not None:
            saved["task"] = {k: identity.task_object[k] for k in ("name", "options", "object")}
        atomic_write_text(self.path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(saved)))
        write_identity(self.path, identity)
        self.view = runtime.view
        partition = partition_record(cfg, task, runtime.clients)
        # partition.png on a thread of its own: round 1 need not wait for matplotlib (finish_static joins it)
        write_partition_files(public_partition(partition, self.view), self.path, background=True)
        atomic_write_text(self.path / "task.json", json.dumps(task.describe(), default=str))
        env = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            # the CPU and the kernel set torch dispatches to: results are bitwise reproducible on
            # one machine, but float kernels differ across CPUs (last digits, which chaotic runs amplify)
            "cpu": _cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            # whether GaLore steps on this machine may take the AVX2 kernels (fp32 rounding differs
            # from the torch path's); null reason = available
            "cpu_kernels": {"available": cpu_kernels.available(), "reason": cpu_kernels.reason()},
            "seed": cfg.seed,
            "method": method.describe(),
            "target_modules": runtime.target_modules,
            "head_params": runtime.head_params,
            "steps_per_round": runtime.steps_per_round,
        }
        from importlib import metadata

        for mod in ("transformers", "peft", "safetensors", "numpy"):  # the installed versions, without importing peft (~0.5 s)
            try:
                env[mod] = metadata.version(mod)
            except metadata.PackageNotFoundError:  # pragma: no cover
                pass
        atomic_write_text(self.path / "environment.json", json.dumps(env, indent=1, default=str))
        return partition

    # ------------------------------------------------------------------ per round
    def append_round(self, round_done: int, client_recs: Sequence[dict[str, Any]], ledger: Ledger,
                     diagnostics: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None) -> None:
        """The records of round ``round_done`` (1-based): its clients and messages, and — for a
        completed round — its diagnostics and metrics. A failed round leaves its clients' errors."""
        for r in client_recs:  # each site's record as the server view declares it
            append_jsonl(self.path / "clients.jsonl", self.view.record(r) if self.view is not None else r)
        for r in ledger.records:
            if r["round"] == round_done:
                append_jsonl(self.path / "ledger.jsonl", r)
        if diagnostics is not None:
            append_jsonl(self.path / "diagnostics.jsonl", diagnostics)
        if metrics is not None:
            append_jsonl(self.path / "metrics.jsonl", self.view.round_record(metrics) if self.view is not None else metrics)

    def write_csv(self, history: Sequence[dict[str, Any]]) -> None:
        keys: list[str] = []
        for h in history:
            keys += [kk for kk in h if kk not in keys and kk not in ("clients", "dropped", "client_eval")]
        with open(self.path / "metrics.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for h in history:
                w.writerow(h)

    def finish_static(self) -> None:
        """Wait for what :meth:`write_static` left drawing (``partition.png``); the round loop calls
        this when a run ends, however it ends."""
        wait_for_partition_png(self.path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json``, atomically (the round loop writes it through a
        :class:`~fedgalore.records.liveness.Heartbeat`: status, rounds, pid, heartbeat time)."""
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=1))


def public_partition(rec: dict[str, Any], view: Any) -> dict[str, Any]:
    """``partition.json`` as the server may write it: whole where the server view declares the sites'
    sizes and labels (fedgalore.privacy.view), else only the split's public description — its setting,
    seed, label and site names — with ``withheld`` saying what stays at the sites."""
    if view is None or (view.site_size and view.site_labels):
        return rec
    keep = ("setting", "kind", "options", "by", "seed", "label_names", "client_names", "validation_size")
    out = {k: rec[k] for k in keep if k in rec}
    if view.site_size:  # record-level DP: the sizes are public, the label counts are not
        out["sizes"] = rec["sizes"]
        out["clients"] = [{"id": c["id"], "name": c["name"], "size": c["size"]} for c in rec["clients"]]
        out["withheld"] = f"per-site label counts ({view.level}: fedgalore.privacy.view)"
    else:
        out["withheld"] = (f"per-site sizes and label counts ({view.level}: the server records nothing counted on a "
                           "site's data; fedgalore.privacy.view)")
    return out


def run_summary(cfg: FederatedConfig, task: Task, history: Sequence[dict[str, Any]], ledger: Ledger, status: str,
                wall: float, identity: RunIdentity | None = None) -> dict[str, Any]:
    """``summary.json``: the run's status, final and best evaluation, traffic and time. A task
    object passed in code is labelled so (``task``: ``"<name> (<Class> object)"``) and recorded
    (``task_object``: class, name, options, data fingerprints)."""
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    # a round with only per-client metrics (federation.client_eval_every) is not the pooled evaluation's
    evals = [h for h in evals if any(k.startswith("eval/") and not k.startswith("eval/client_") for k in h)] or evals
    final = {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval/") and not k.startswith("eval/val_")} if evals else {}
    final_val = {k[9:]: v for k, v in evals[-1].items() if k.startswith("eval/val_")} if evals else {}
    key = f"eval/{task.primary_metric}"
    best = {}
    if evals and key in evals[-1]:
        pick = max if task.higher_is_better else min
        b = pick(evals, key=lambda h: h.get(key, -math.inf if task.higher_is_better else math.inf))
        best = {k[5:]: v for k, v in b.items() if k.startswith("eval/")} | {"round": b["round"]}
    n_up = sum(1 for r in ledger.records if r["direction"] == "up")
    n_down = sum(1 for r in ledger.records if r["direction"] == "down")
    rounds_done = len(history)
    obj = identity.task_object if identity is not None else None
    return {
        "name": cfg.name,
        "task": task_label(cfg, identity),
        **({"task_object": {k: obj[k] for k in ("object", "name", "options", "data")}} if obj else {}),
        "method": cfg.method.name,
        "setting": cfg.setting_label(),
        "seed": cfg.seed,
        "rounds": cfg.federation.rounds,
        "rounds_completed": rounds_done,
        "status": status,
        "primary_metric": task.primary_metric,
        "higher_is_better": task.higher_is_better,
        "final": final,
        **({"final_validation": final_val} if final_val else {}),
        "best": best,
        "bytes_up_total": ledger.total("up"),
        "bytes_down_total": ledger.total("down"),
        "bytes_up_per_client_round": ledger.total("up") / max(n_up, 1),
        "bytes_down_per_client_round": ledger.total("down") / max(n_down, 1),
        "wall_time": wall,
        "time_checkpoint": sum(h.get("time_checkpoint", 0.0) for h in history),
        "time_per_round": (sum(h.get("time_round", 0.0) for h in history) / rounds_done) if rounds_done else 0.0,
        "server_time_fraction": (
            sum(h.get("time_server", 0.0) for h in history) / max(sum(h.get("time_round", 0.0) for h in history), 1e-12)
        ),
    }


# ----------------------------------------------------------------------------- choosing the directory
def choose_run_dir(cfg: FederatedConfig, run_dir: str | Path | None, resume: bool, say: Callable[[str], None],
                   identity: RunIdentity | None = None) -> Path:
    """The run directory: ``run_dir``, else ``<output.dir>/<output.run_name>``, else the default
    name ``<name>-<method>-<setting>-s<seed>``. A directory that already holds this very run
    (the same identity: :mod:`fedgalore.records.identity`; ``identity`` defaults to
    ``run_identity(cfg)``) is refused with what to do instead; under the default name, a
    directory holding another run (another config, e.g. other rounds, or other model or data
    files) is left alone and this run goes to the first free ``<default name>-2``, ``-3``, ...
    (announced through ``say``, never silent)."""
    default = run_dir is None and cfg.output.run_name is None
    name = cfg.output.run_name or f"{cfg.name}-{cfg.method.name}-{cfg.setting_label().replace(':', '')}-s{cfg.seed}"
    base = Path(run_dir) if run_dir is not None else Path(cfg.output.dir) / name
    if resume:
        return base
    identity = identity or run_identity(cfg)
    candidate, n, first = base, 1, None
    while (candidate / "summary.json").exists():
        diffs, note = compare_with_saved(candidate, identity)
        if not diffs:
            raise ConfigError(_holds_this_run(candidate) + (f" (note: {note})" if note else ""))
        if not default:
            raise ConfigError(f"run directory {candidate} already holds another run ({summarize(diffs)}); choose another "
                              f"output.run_name{_extend_hint(candidate, cfg, identity)}")
        first = first or _another(diffs)
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    if candidate != base:
        say(f"{base} holds {first}; this run goes to {candidate}{_extend_hint(base, cfg, identity)}")
    return candidate


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` and those of its parent folders that do not exist yet, deepest first ([] when
    ``path`` exists): the folders a run about to start in ``path`` creates, which
    :func:`discard_unstarted` removes again if the run fails before its first round."""
    out: list[Path] = []
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def discard_unstarted(created: Sequence[Path], release: Callable[[], None]) -> None:
    """A run that failed before its first round (its task, data or model did not build) leaves
    no folder behind: ``created`` (:func:`missing_dirs` of its run directory, taken before it
    was made: [] for a directory that existed, e.g. one being resumed) is removed — the run
    directory with what its setup wrote (never when it holds a ``summary.json`` or checkpoints:
    a run's results), then each new parent folder left empty. ``release`` gives up the run's
    lock; it is called in every case, after the files and before the folders go (a process
    that took the folder meanwhile keeps it)."""
    import shutil

    run = Path(created[0]) if created else None
    if run is None or not run.is_dir() or (run / "summary.json").exists() or (run / "checkpoints").exists():
        release()
        return
    for p in run.iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    release()
    for d in created:
        try:
            d.rmdir()  # only an empty folder: one another process wrote into meanwhile stays
        except OSError:
            break


def _another(diffs: Sequence[Difference]) -> str:
    """'a run with another config (...)', or 'a run with other inputs (...)' when only model or
    data files differ."""
    return f"a run with {'other inputs' if all(d.inputs for d in diffs) else 'another config'} ({summarize(diffs)})"


def saved_summary(run_dir: Path) -> dict[str, Any]:
    """The run directory's ``summary.json`` ({} when absent or unreadable)."""
    return read_json(run_dir / "summary.json") or {}


def extension_problem(cfg: FederatedConfig, rounds: int, completed: int) -> str | None:
    """Why a run configured as ``cfg`` (``completed`` rounds done) cannot be continued to
    ``rounds`` rounds with exactly the result of an uninterrupted ``rounds``-round run; None if it can.

    Only the learning-rate schedule depends on ``federation.rounds`` (sampling, round seeds and
    data order derive from (seed, round, client)). With ``train.schedule_scope=global`` the
    warm-up + decay spans all rounds, so the rounds already run used another schedule than a
    longer run would — unless the schedule is flat (``constant`` without warm-up).
    """
    t = cfg.train
    if rounds < completed:
        return f"it has already completed {completed} rounds (federation.rounds must be >= {completed})"
    record = cfg.privacy.record
    if record is not None and record.target_epsilon is not None and rounds != cfg.federation.rounds:
        return (f"privacy.record.target_epsilon calibrates each site's noise to federation.rounds={cfg.federation.rounds}, "
                f"so a {rounds}-round run would add other noise from round 1 on (and spend more ε)")
    if t.schedule_scope == "round" or (t.schedule == "constant" and t.warmup_ratio == 0):
        return None
    return (f"its learning-rate schedule (train.schedule={t.schedule}, train.warmup_ratio={t.warmup_ratio:g}, "
            f"train.schedule_scope=global) spans federation.rounds={cfg.federation.rounds}, so rounds 1-{completed} "
            f"differ from those of a {rounds}-round run")


def _holds_this_run(run_dir: Path) -> str:
    s = saved_summary(run_dir)
    done, total = s.get("rounds_completed", "?"), s.get("rounds", "?")
    state = run_state(run_dir)
    if state.live:
        return (f"{run_dir} already holds this run, and process {state.pid} is running it now ({done}/{total} rounds done); "
                f"watch it with `fedgalore status {run_dir}`, or set output.run_name=<new name> to start another")
    if is_finished(s.get("status")):
        final = " ".join(f"{k}={v:.4f}" for k, v in (s.get("final") or {}).items() if isinstance(v, float))
        return (f"{run_dir} already holds this run (complete, {done}/{total} rounds{': ' + final if final else ''}); "
                f"see it with `fedgalore report {run_dir}`, or set output.run_name=<new name> to run it again")
    how = {"failed": "failed", "interrupted": "interrupted", "running": "stopped (its process is gone)"}.get(s.get("status"), "stopped")
    return (f"{run_dir} already holds this run, {how} after round {done}/{total}; continue it with "
            f"`fedgalore run --resume {run_dir}`, or set output.run_name=<new name> to start over")


def _extend_hint(run_dir: Path, cfg: FederatedConfig, identity: RunIdentity) -> str:
    """'; to extend that run instead: ...' when ``run_dir`` holds the run of ``identity`` with
    fewer rounds and continuing it is exact (:func:`extension_problem`); else ''."""
    try:
        saved = load_config(run_dir / "config.yaml")
    except Exception:  # noqa: BLE001 - unreadable: no hint
        return ""
    rounds = cfg.federation.rounds
    done = int(saved_summary(run_dir).get("rounds_completed", 0) or 0)
    if saved.federation.rounds >= rounds or extension_problem(saved, rounds, done) is not None:
        return ""
    if compare_with_saved(run_dir, identity, ignore=("federation.rounds",))[0]:
        return ""
    return f"; to extend that run instead: fedgalore run --resume {run_dir} federation.rounds={rounds}"


def _jsonl_truncate(path: Path, max_round: int) -> list[dict[str, Any]]:
    """Keep only records of completed (checkpointed) rounds; returns them."""
    recs = [r for r in read_jsonl(path) if int(r.get("round", 0)) <= max_round]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    return recs


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
