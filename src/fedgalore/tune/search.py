"""The search of ``fedgalore tune``: one Optuna study per row, each trial a federated run on the
validation split, pruned along the round axis, stored so that a killed search resumes.

**Objective.** A trial is a run of the row's config with the trial's values set (:func:`fedgalore.
tune.space.apply_params`) at the config's seed and rounds. After every evaluated round it reports
the validation metric (``val_<task's primary metric>``, the ``federation.validation_fraction``
hold-out or the task's own validation set) to Optuna; its value is the mean over the last
``last`` evaluated rounds (default 2: a choice at the horizon, less noisy than the last round
alone). The direction is the task's (``higher_is_better``).

**Pruning.** After each report the pruner decides (default ``median``: Optuna's MedianPruner with
one finished trial as the start, i.e. a trial is stopped when its best validation so far is below
the median of the finished trials at the same round; ``hyperband``; ``none``). A pruned trial's
run ends there; its rounds count in the tuning cost.

**Storage and resume.** The studies live in ``<out>/tune.db`` (SQLite, embedded; ``--storage URL``
any database Optuna's RDBStorage takes, e.g. ``postgresql://...``, shared by workers on several
machines). Each trial's run directory is named by a hash of its config, so a trial retried with the
same values resumes its run from the last checkpoint, re-reporting the rounds it had done. A trial
left ``RUNNING`` by a killed process of this machine is failed and re-queued with its values when
``tune`` starts again; on other machines Optuna's heartbeat does the same after its grace period
(:class:`optuna.storages.RetryFailedTrialCallback`). The row's trial budget counts finished and
pruned trials over all workers (:class:`optuna.study.MaxTrialsCallback`).

**What a study ran on.** A study records the identity of its row (the resolved config without the
searched keys and seed, and the hashes of the model and data files: :mod:`fedgalore.records.
identity`) when it is created; a later ``tune`` on the same storage with another config, another
model or other data is refused, naming what differs, instead of mixing trials of two backbones.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fedgalore.compare import cell_status, check_rows, row_config
from fedgalore.engine.events import ProgressSink
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.tune.space import Param, apply_params, at_edge, default_rate, row_space, widened

__all__ = ["TuneSpec", "Row", "build_rows", "storage_url", "open_study", "search_row", "search", "trial_config",
           "objective_key", "row_identity", "stored_space", "grid_points", "PRUNERS", "SAMPLERS"]

log = logging.getLogger("fedgalore")

PRUNERS = ("median", "hyperband", "none")
SAMPLERS = ("tpe", "random", "grid")
DB_FILE = "tune.db"


@dataclass
class TuneSpec:
    """Everything a ``tune`` needs (the CLI's options, resolved)."""

    base: FederatedConfig
    labels: list[str]
    out: Path
    method_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    space: dict[str, dict[str, Param]] = field(default_factory=dict)  # per row: the --space items
    trials: int = 8  # per row, finished + pruned
    storage: str | None = None
    workers: int = 1
    sampler: str = "tpe"
    pruner: str = "median"
    last: int = 2  # objective: mean validation metric over the last `last` evaluated rounds
    heldout_seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    confirm_rounds: list[int] = field(default_factory=list)  # default: the config's rounds
    close: float = 0.01  # a runner-up within this of the best (metric units) is confirmed too
    widen: bool = True
    sampler_seed: int = 0
    worker: int = 0  # this process's index among the workers (its sampler's seed is sampler_seed + 1000 · worker)


@dataclass
class Row:
    """One row of the search: its label, method, config (a plain dict) and space."""

    label: str
    method: str
    config: dict[str, Any]
    space: dict[str, Param]


def build_rows(spec: TuneSpec) -> list[Row]:
    """Each row's config (:func:`fedgalore.compare.row_config`) and space (the ``--space`` items
    plus the default learning-rate range around :func:`~fedgalore.tune.space.default_rate`)."""
    check_rows(spec.labels, spec.method_options)
    rows = []
    for label in spec.labels:
        method, cfg = row_config(spec.base, label, spec.method_options)
        row_lr = (spec.method_options.get(label, {}).get("train") or {}).get("lr")
        centre = default_rate(method, row_lr, spec.base.train.lr)
        space = row_space(spec.space.get(label, {}), centre)
        for key in space:  # a typo in a key fails before any trial runs
            apply_params(json.loads(json.dumps(cfg)), {key: _initial(space[key], cfg)})
        rows.append(Row(label, method, cfg, space))
    return rows


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _initial(param: Param, cfg: Mapping[str, Any]) -> Any:
    """The first trial's value: the config's own when it lies in the space, else the middle."""
    value = _get(cfg, param.key)
    if param.kind == "choice":
        return value if value in param.choices else param.choices[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and param.low <= value <= param.high:
        return int(value) if param.kind == "int" else float(value)
    if param.kind == "log":
        return math.sqrt(param.low * param.high)
    mid = (param.low + param.high) / 2
    return int(round(mid)) if param.kind == "int" else mid


def first_values(row: Row) -> dict[str, Any]:
    """The values of a row's first trial: the learning rate at the range's centre (the row's default
    rate), every other key at the config's value when it is in the space."""
    out = {key: _initial(p, row.config) for key, p in row.space.items()}
    if "train.lr" in row.space and row.space["train.lr"].kind == "log":
        p = row.space["train.lr"]
        out["train.lr"] = math.sqrt(p.low * p.high)
    return out


def trial_config(row: Row, params: Mapping[str, Any], seed: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    """The row's config with ``params`` set (and ``seed`` / ``rounds`` when given)."""
    d = apply_params(json.loads(json.dumps(row.config)), params)
    if seed is not None:
        d["seed"] = int(seed)
    if rounds is not None:
        d["federation"]["rounds"] = int(rounds)
    return d


def config_hash(d: Mapping[str, Any]) -> str:
    """A short hash of a config dict (without its output section): a run directory's name."""
    plain = {k: v for k, v in d.items() if k != "output"}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


def objective_key(cfg: FederatedConfig) -> tuple[str, bool]:
    """The history key of the validation metric (``eval/val_<primary>``) and whether higher is better."""
    from fedgalore.tasks import get_task

    key = json.dumps({"name": cfg.task.name, "options": dict(cfg.task.options or {})}, sort_keys=True, default=str)
    if key not in _TASK_METRIC:
        task = get_task(cfg.task.name, **dict(cfg.task.options or {}))
        _TASK_METRIC[key] = (str(task.primary_metric), bool(task.higher_is_better))
    primary, higher = _TASK_METRIC[key]
    return f"eval/val_{primary}", higher


#: (primary metric, higher is better) per task section, built once per process
_TASK_METRIC: dict[str, tuple[str, bool]] = {}


def storage_url(spec: TuneSpec) -> str:
    """``--storage`` or the embedded SQLite file in the output folder."""
    if spec.storage:
        return spec.storage
    spec.out.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(spec.out / DB_FILE).resolve()}"


def _storage(url: str) -> Any:
    """Optuna's RDBStorage on ``url`` with a heartbeat: a trial whose process stopped beating for
    the grace period is failed and retried with its values (its run resumes)."""
    import warnings

    from optuna.storages import RDBStorage

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):  # several processes on one file: wait for the lock instead of failing
        kwargs = {"connect_args": {"timeout": 60}}
    with warnings.catch_warnings():  # the heartbeat API is marked experimental / renamed across Optuna 4.x
        warnings.simplefilter("ignore")
        try:
            from optuna.storages import RetryHeartbeatStaleTrialCallback  # Optuna >= 4.9

            retry = {"heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=3)}
        except ImportError:
            from optuna.storages import RetryFailedTrialCallback

            retry = {"failed_trial_callback": RetryFailedTrialCallback(max_retry=3)}
        return RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=60, grace_period=300, **retry)


def grid_points(row: Row) -> list[dict[str, Any]]:
    """Every point of a grid search (every key ``choice:``), the row's own values first, then in
    the order the choices were written."""
    import itertools

    bad = [p.key for p in row.space.values() if p.kind != "choice"]
    if bad:
        raise ConfigError(f"--sampler grid needs every searched key as choice:...; {bad[0]} is {row.space[bad[0]].kind} "
                          f"(e.g. --space {bad[0]}=choice:1e-3,3e-3,1e-2)")
    keys = list(row.space)
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(row.space[k].choices for k in keys))]
    first = first_values(row)
    return sorted(points, key=lambda pt: pt != first)


def _sampler(spec: TuneSpec, row: Row) -> Any:
    """TPE (seeded; a third of the trials, 2 to 5, drawn at random first), random, or — for a grid,
    whose points are queued in order (:func:`grid_points`) — random for anything past the queue."""
    import optuna

    if spec.sampler in ("random", "grid"):
        return optuna.samplers.RandomSampler(seed=spec.sampler_seed + 1000 * spec.worker)
    return optuna.samplers.TPESampler(seed=spec.sampler_seed + 1000 * spec.worker, n_startup_trials=max(2, min(5, spec.trials // 3)))


def _pruner(spec: TuneSpec, cfg: FederatedConfig) -> Any:
    import optuna

    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    if spec.pruner == "hyperband":
        first = max(1, min(cfg.federation.eval_every, cfg.federation.rounds))
        return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=cfg.federation.rounds, reduction_factor=3)
    return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)


def row_identity(row: Row) -> dict[str, Any]:
    """What a row's study ran on: the resolved config without the searched keys, seed and output,
    and the model and data files' hashes (:func:`fedgalore.records.identity.run_identity`)."""
    from fedgalore.records.identity import run_identity

    cfg = FederatedConfig.from_dict(trial_config(row, first_values(row)))
    ident = run_identity(cfg)
    conf = json.loads(json.dumps(ident.config, default=str))
    for key in list(row.space) + ["seed", "output", "name"]:
        parts = key.split(".")
        node = conf
        for part in parts[:-1]:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return {"config": conf, "inputs": ident.inputs}


def _identity_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The first difference between two row identities, in words (None: the same)."""
    oi, ni = old.get("inputs") or {}, new.get("inputs") or {}
    for name in sorted(set(oi) | set(ni)):
        if oi.get(name) != ni.get(name):
            return f"input {name!r} changed (another model or data file: {_short(oi.get(name))} -> {_short(ni.get(name))})"
    of, nf = _flat(old.get("config") or {}), _flat(new.get("config") or {})
    for key in sorted(set(of) | set(nf)):
        if of.get(key) != nf.get(key):
            return f"{key}: {of.get(key)!r} -> {nf.get(key)!r}"
    return None


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(entry: Any) -> str:
    text = json.dumps(entry, sort_keys=True, default=str) if entry is not None else "none"
    return hashlib.sha256(text.encode()).hexdigest()[:10] if entry is not None else "none"


def open_study(spec: TuneSpec, row: Row, url: str, *, check: bool = True) -> Any:
    """The row's study (created with its identity, space and settings on first use); another
    config or other inputs than the stored study's are a :class:`ConfigError` naming the change."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = FederatedConfig.from_dict(row.config)
    _, higher = objective_key(base)
    study = optuna.create_study(study_name=row.label, storage=_storage(url), load_if_exists=True,
                                direction="maximize" if higher else "minimize", sampler=_sampler(spec, row),
                                pruner=_pruner(spec, base))
    ident = row_identity(row) if check else None
    attrs = study.user_attrs
    if "identity" not in attrs:
        if ident is None:
            ident = row_identity(row)
        study.set_user_attr("identity", json.loads(json.dumps(ident, default=str)))
        study.set_user_attr("method", row.method)
        study.set_user_attr("space", [p.spec() for p in row.space.values()])
        study.set_user_attr("last", spec.last)
    else:
        _check_space(study, row, url)
    if ident is not None and "identity" in attrs:
        diff = _identity_difference(attrs["identity"], json.loads(json.dumps(ident, default=str)))
        if diff and not _has_results(study):  # nothing learned under the old setup: start the row afresh
            optuna.delete_study(study_name=row.label, storage=_storage(url))
            return open_study(spec, row, url, check=check)
        if diff:
            raise ConfigError(f"the study {row.label!r} in {url} was searched with another config or inputs ({diff}); "
                              "its trials would mix two setups: use another --out (or --storage), or delete "
                              f"{url.replace('sqlite:///', '')} to start afresh")
    return study


def _has_results(study: Any) -> bool:
    """Whether a study holds a finished, pruned or running trial (else only queued or failed ones)."""
    from optuna.trial import TrialState

    return bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))


def _check_space(study: Any, row: Row, url: str) -> None:
    """A stored study searched each key with one kind (log, float, int or choice) and, for a
    choice, one set of values: Optuna cannot mix two on one key. A range may move (widened)."""
    from fedgalore.tune.space import parse_param

    old = {}
    for text in study.user_attrs.get("space", []):
        key, _, sp = text.partition("=")
        old[key] = parse_param(key, sp)
    for key, p in row.space.items():
        o = old.get(key)
        if o is not None and (o.kind != p.kind or (p.kind == "choice" and set(map(repr, o.choices)) != set(map(repr, p.choices)))):
            raise ConfigError(f"the study {row.label!r} in {url} searched {o.spec()}; this search asks {p.spec()}: one key "
                              "cannot be searched two ways in one study: keep the stored space, or use another --out")


class _Reporter(ProgressSink):
    """Reports the validation metric to the trial after every evaluated round; raises
    :class:`optuna.TrialPruned` when the pruner says so (the run ends there)."""

    def __init__(self, trial: Any, key: str, inner: ProgressSink | None = None) -> None:
        self.trial, self.key, self.inner = trial, key, inner or ProgressSink()
        self.pruned_at: int | None = None

    def report(self, round_1: int, value: float) -> None:
        import optuna

        if not math.isfinite(value):
            return
        self.trial.report(float(value), step=int(round_1))
        if self.trial.should_prune():
            self.pruned_at = int(round_1)
            raise optuna.TrialPruned(f"pruned after round {round_1}: validation {value:.4f}")

    def round_end(self, round: int, record: dict[str, Any]) -> None:
        self.inner.round_end(round, record)
        if self.key in record:
            self.report(round + 1, float(record[self.key]))

    def message(self, text: str) -> None:
        self.inner.message(text)


def _history(run_dir: Path) -> list[dict[str, Any]]:
    from fedgalore.jsonl import read_jsonl

    path = run_dir / "metrics.jsonl"
    return list(read_jsonl(path)) if path.is_file() else []


def requeue_dead(study: Any) -> int:
    """Fail and re-queue (with the same values) the trials left RUNNING by a dead process of this
    machine; returns how many."""
    from optuna.trial import TrialState

    from fedgalore.records.liveness import pid_alive

    host, n = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker") or {}
        if worker.get("host") != host or not worker.get("pid") or pid_alive(int(worker["pid"])) and int(worker["pid"]) != os.getpid():
            continue
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number})
        n += 1
    return n


def _counted(study: Any) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def _objective(spec: TuneSpec, row: Row, say: Callable[[str], None]) -> Callable[[Any], float]:
    import fedgalore
    import optuna

    key, _ = objective_key(FederatedConfig.from_dict(row.config))

    def objective(trial: Any) -> float:
        params = {k: p.suggest(trial) for k, p in row.space.items()}
        d = trial_config(row, params)
        name = f"{row.label}-{config_hash(d)}"
        run_root = spec.out / "trials" / row.label
        d["output"]["dir"] = str(run_root)
        d["output"]["run_name"] = name
        d["output"]["progress"] = "quiet"
        cfg = FederatedConfig.from_dict(d)
        run_dir = run_root / name
        trial.set_user_attr("worker", {"host": socket.gethostname(), "pid": os.getpid()})
        trial.set_user_attr("run_dir", str(run_dir.relative_to(spec.out)) if run_dir.is_relative_to(spec.out) else str(run_dir))
        trial.set_user_attr("clients_per_round", int(cfg.federation.clients_per_round or cfg.federation.num_clients or 0))
        reporter = _Reporter(trial, key)
        _wait_free(run_dir, say)  # the same values drawn by another worker: its result is this trial's
        status = cell_status(run_dir)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
        t0 = time.perf_counter()
        try:
            if status in ("running", "complete"):  # a retried trial: its run's rounds so far count again
                from fedgalore.federated.checkpoint import kept_rounds

                prior = _history(run_dir)
                upto = len(prior) if status == "complete" else max(kept_rounds(run_dir), default=0)
                for rec in prior:  # a resumed run repeats the rounds after its last checkpoint
                    if key in rec and int(rec["round"]) <= upto:
                        reporter.report(int(rec["round"]), float(rec[key]))
            if status == "complete":
                history = prior
                say(f"[{row.label} trial {trial.number}] {shown}: finished before, reused ({run_dir})")
            else:
                say(f"[{row.label} trial {trial.number}] {shown}: {'resuming' if status == 'running' else 'running'} -> {run_dir}")
                fedgalore.run(cfg, resume=run_dir if status == "running" else None, progress=reporter)
                history = _history(run_dir)  # every round, the resumed run's earlier ones included
        except optuna.TrialPruned:
            _record_cost(trial, run_dir, time.perf_counter() - t0)
            say(f"[{row.label} trial {trial.number}] {shown}: pruned after round {reporter.pruned_at}")
            raise
        except (FloatingPointError, RuntimeError) as exc:  # a rate that diverges is a result: the worst value
            _record_cost(trial, run_dir, time.perf_counter() - t0)
            trial.set_user_attr("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
            say(f"[{row.label} trial {trial.number}] {shown}: failed ({type(exc).__name__}); counted as pruned")
            raise optuna.TrialPruned(f"failed: {type(exc).__name__}") from None
        _record_cost(trial, run_dir, time.perf_counter() - t0, history)
        values = [float(h[key]) for h in history if key in h and math.isfinite(float(h[key]))]
        if not values:
            raise ConfigError(f"the run of {row.label} reported no validation metric ({key}): give the config "
                              "federation.validation_fraction (e.g. 0.1) or a task with its own validation set")
        value = sum(values[-spec.last:]) / len(values[-spec.last:])
        say(f"[{row.label} trial {trial.number}] {shown}: validation {value:.4f}")
        return value

    return objective


def _wait_free(run_dir: Path, say: Callable[[str], None]) -> None:
    """Wait while another live process runs ``run_dir`` (a trial of the same values)."""
    from fedgalore.records.liveness import RunLock, pid_alive

    def holder() -> int | None:
        h = RunLock(run_dir).holder()
        pid = h.get("pid")
        if not pid or h.get("host") != socket.gethostname() or pid == os.getpid() or not pid_alive(int(pid), h.get("proc_start")):
            return None
        return int(pid)

    told = False
    while (holder := holder()) is not None:
        if not told:
            say(f"{run_dir.name}: the same values are being run by process {holder}; waiting for its result")
            told = True
        time.sleep(1.0)


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _record_cost(trial: Any, run_dir: Path, seconds: float, history: list[dict[str, Any]] | None = None) -> None:
    """What the trial cost: rounds and client-rounds its run did, its wall time, its bytes
    (``history``: the run's metrics.jsonl when the caller has read it)."""
    history = _history(run_dir) if history is None else history
    trial.set_user_attr("rounds_run", len(history))
    trial.set_user_attr("client_rounds", int(sum(len(h.get("clients") or []) for h in history)))
    trial.set_user_attr("wall_s", round(float(sum(h.get("time_round", 0.0) for h in history)), 2))
    trial.set_user_attr("bytes_up", int(history[-1].get("cum_bytes_up", 0)) if history else 0)
    trial.set_user_attr("bytes_down", int(history[-1].get("cum_bytes_down", 0)) if history else 0)
    eps = [h["dp_epsilon"] for h in history if isinstance(h.get("dp_epsilon"), (int, float))]
    if eps:
        trial.set_user_attr("dp_epsilon", float(eps[-1]))
    try:
        ident = json.loads((run_dir / "identity.json").read_text())
        trial.set_user_attr("inputs", ident.get("inputs"))
    except (OSError, ValueError):
        pass


def _run_trials(study: Any, objective: Callable, target: int) -> None:
    import optuna
    from optuna.trial import TrialState

    if _counted(study) >= target:
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, callbacks=[optuna.study.MaxTrialsCallback(target, states=(TrialState.COMPLETE, TrialState.PRUNED))],
                   catch=())


def best_trial(study: Any) -> Any | None:
    """The study's best finished trial (None before any)."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return None
    return study.best_trial


def search_row(spec: TuneSpec, row: Row, url: str, say: Callable[[str], None]) -> None:
    """:func:`_search_row`; a user error in a trial (a config the data cannot take, e.g. a batch
    larger than a site) before any trial finished removes the row's empty study, so the command
    runs again with the corrected config on the same ``--out``."""
    from fedgalore.federated.partition import PartitionError
    from fedgalore.methods.base import MethodError
    from fedgalore.tasks.base import TaskError

    try:
        _search_row(spec, row, url, say)
    except (ConfigError, TaskError, MethodError, PartitionError):
        import optuna

        study = optuna.load_study(study_name=row.label, storage=_storage(url))
        if _counted(study) == 0:
            optuna.delete_study(study_name=row.label, storage=_storage(url))
        raise


def _search_row(spec: TuneSpec, row: Row, url: str, say: Callable[[str], None]) -> None:
    """Run the row's trials until ``spec.trials`` have finished or been pruned (over all workers);
    then, when ``spec.widen`` and the best value of a numeric key lies at the edge of its range,
    widen that range (once per key) and run half as many trials again."""
    study = open_study(spec, row, url)
    if requeue_dead(study):
        say(f"[{row.label}] re-queued trial(s) a killed tune left running; their runs resume from their checkpoints")
    grid = grid_points(row) if spec.sampler == "grid" else None
    if not study.trials:  # the first trial at the row's own values; a grid's points in order
        for point in grid or [first_values(row)]:
            study.enqueue_trial(point, skip_if_exists=True)
    space = stored_space(study, row)
    stages = study.user_attrs.get("widened_stages", 0)
    target = spec.trials + stages * max(1, math.ceil(spec.trials / 2))
    if grid is not None:  # a grid is searched once, point by point (its trials: at most its points)
        _run_trials(study, _objective(spec, Row(row.label, row.method, row.config, space), say), min(target, len(grid)))
        return
    _run_trials(study, _objective(spec, Row(row.label, row.method, row.config, space), say), target)
    if not spec.widen or stages:
        return
    best = best_trial(study)
    if best is None:
        return
    new, flagged = dict(space), []
    for key, p in space.items():
        side = at_edge(p, best.params.get(key))
        if side:
            w = widened(p, side)
            if (w.low, w.high) != (p.low, p.high):
                new[key] = w
                flagged.append(f"{key} {side}: {p.spec().split('=', 1)[1]} -> {w.spec().split('=', 1)[1]}")
    if not flagged:
        return
    say(f"[{row.label}] best at the edge of its range ({'; '.join(flagged)}): widened, {math.ceil(spec.trials / 2)} more trial(s)")
    study.set_user_attr("widened", flagged)
    study.set_user_attr("space_widened", [p.spec() for p in new.values()])
    study.set_user_attr("widened_stages", 1)
    _run_trials(study, _objective(spec, Row(row.label, row.method, row.config, new), say),
                spec.trials + max(1, math.ceil(spec.trials / 2)))


def stored_space(study: Any, row: Row) -> dict[str, Param]:
    """The row's space as the study last searched it (a widened range survives a resume)."""
    from fedgalore.tune.space import parse_param

    specs = study.user_attrs.get("space_widened")
    if not specs:
        return dict(row.space)
    out = dict(row.space)
    for text in specs:
        key, _, sp = text.partition("=")
        out[key] = parse_param(key, sp)
    return out


def search(spec: TuneSpec, rows: Sequence[Row], say: Callable[[str], None]) -> None:
    """Search every row in turn (this process; :func:`fedgalore.tune.run.tune` starts workers)."""
    url = storage_url(spec)
    for row in rows:
        search_row(spec, row, url, say)
