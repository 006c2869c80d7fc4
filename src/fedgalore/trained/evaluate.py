"""Evaluate an exported folder or a run with a task's metrics (``fedgalore evaluate``; docs/export.md).

::

    import fedgalore
    ev = fedgalore.evaluate("exported/tiny")                       # the export's own task and test split
    ev = fedgalore.evaluate("runs/tiny-fedit-dirichlet0.5-s0")     # a run's newest checkpoint
    ev = fedgalore.evaluate("exported/tiny", cfg, data="new.csv")  # a file-based task on another test file

The model: a run directory's global model at its newest kept checkpoint
(:func:`~fedgalore.trained.global_model.load_global_model`), or a folder written by
``fedgalore export`` — any Hugging Face model folder, or a PEFT adapter folder on the task's
pretrained model (:func:`load_exported`). The task: ``cfg``'s, else the run's saved config (an
export carries it as ``fedgalore_config.yaml``). ``data`` replaces the task's test data by a file
through the task's ``data`` option (:func:`with_test_data`): it works for the tasks that read
data files and is one error line for the others. ``by="site"`` adds the metrics of every group of
test rows sharing a value of that column, from one batched pass, whether each group took part in
training (:func:`group_training`: a client of the run whose update was aggregated, a site
``min_client_size`` dropped, a client never aggregated, or no client at all), and names the worst
group among those of at least ``min_group`` rows (:attr:`Evaluation.groups`,
:attr:`Evaluation.training`, :attr:`Evaluation.worst`). Evaluating a run that a process is running
now takes its newest kept checkpoint and says so (:attr:`Evaluation.live`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedgalore.job.config import FederatedConfig, load_config
from fedgalore.trained.global_model import ExportError, load_global_model
from fedgalore.records.identity import with_recorded_paths
from fedgalore.trained.model_card import EXPORT_BASE, EXPORT_CONFIG, EXPORT_IDENTITY
from fedgalore.job.resolve import check_device
from fedgalore.tasks import get_task, task_class
from fedgalore.tasks.base import Task, TaskError, quiet_transformers

__all__ = ["evaluate", "Evaluation", "LoadedModel", "load_for_inference", "groups_by_column", "group_training", "load_exported",
           "with_test_data", "class_names", "MIN_GROUP", "TRAINING_STATES"]

#: ``evaluate --by``: the worst group is named among the groups of at least this many test rows
MIN_GROUP = 20
#: ``evaluate --by``: whether a group took part in training (:func:`group_training`), and what each value means
TRAINING_STATES = {
    "yes": "a client of the run, its update aggregated in at least one round up to the evaluated one",
    "dropped": "a site federation.partition.min_client_size dropped: trained by no client",
    "not aggregated": "a client of the run, but no update of it was aggregated up to the evaluated round",
    "no": "not a client of the run: none of its rows was trained on",
}


@dataclass
class Evaluation:
    """The task's metrics of one model on one test set."""

    metrics: dict[str, float]
    #: what was evaluated: ``run <dir> round <n>`` or ``folder <dir>``
    source: str
    task: str
    examples: int
    #: set when the run was live (a process running it) as it was read: which round this took
    live: str | None = None
    #: ``--by``: the column grouped by, each group's ``{"n": rows, metric: value}``, and the worst group
    #: among those of at least ``min_group`` rows (None when no group has that many)
    by: str | None = None
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    worst: str | None = None
    min_group: int | None = None
    #: ``--by``: each group's part in training (a :data:`TRAINING_STATES` key); empty when unknown,
    #: and then ``training_note`` says why
    training: dict[str, str] = field(default_factory=dict)
    training_note: str | None = None


def load_exported(path: str | Path, task: Task) -> nn.Module:
    """The model in ``path`` (eval mode): a PEFT adapter folder (``adapter_config.json``) with
    ``PeftModel.from_pretrained`` on the base it ships (``base/``, loaded by ``transformers`` alone,
    as its model card says) or else on ``task.build_model()``; a Hugging Face folder with the class
    its ``config.json`` names (``architectures``: what ``AutoModelFor…`` resolves to)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        base = _load_hf_folder(path / EXPORT_BASE) if (path / EXPORT_BASE / "config.json").is_file() else None
        # PEFT's layer initialisation draws from the global RNG: forked, so callers see no change
        with torch.random.fork_rng(devices=[]), quiet_transformers():
            model = PeftModel.from_pretrained(base if base is not None else task.build_model(), str(path))
    elif (path / "config.json").is_file():
        model = _load_hf_folder(path)
    else:
        raise ExportError(f"{path} is neither a run directory nor a model folder (no config.json or adapter_config.json)")
    return model.eval()


def _load_hf_folder(path: Path) -> nn.Module:
    """The Hugging Face folder ``path`` loaded with the class its ``config.json`` names."""
    import transformers

    archs = transformers.AutoConfig.from_pretrained(str(path)).architectures or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise ExportError(f"{path}/config.json names no model class this transformers has (architectures={archs})")
    with quiet_transformers():
        return cls.from_pretrained(str(path))


def with_test_data(cfg: FederatedConfig, data: str | Path, labels: list[str] | None = None) -> FederatedConfig:
    """``cfg`` with its task's test split read from the file ``data`` (or, for an image classifier,
    a folder of one sub-folder of images per class; a flat folder of images has no labels: one
    :class:`ExportError` line saying so): the task option ``data``
    becomes ``{train: <its training data>, test: data}`` (a mapping keeps its other splits; a
    single file loses its ``test_fraction``, since the file is now all training data). Per-site
    data (``{sites: ...}``) has no one training source: the task reads the test file alone
    (``{test: data}``, the no-training-rows path) with the run's classes ``labels`` in id order
    (:func:`class_names`); a per-site regression cannot. A task without a
    ``data`` option reads no files: :class:`ExportError`."""
    cls = task_class(cfg.task.name).options_class
    names = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    if "data" not in names:
        raise ExportError(f"task {cfg.task.name!r} reads no data files (it has no `data` option), so --data cannot "
                          "replace its test set; --data works for the tasks that read files (text_classification, "
                          "causal_lm, image_classification)")
    if Path(data).is_dir() and "image_column" in names:  # an image folder: its classes are its sub-folders
        from fedgalore.tasks.generic.data import read_image_folder

        try:
            held = read_image_folder(data).columns
        except TaskError as exc:
            raise ExportError(f"--data {exc}") from None
        if "label" not in held:
            raise ExportError(f"--data {data} holds images without class sub-folders, so there are no labels to score; "
                              "sort them into one sub-folder per class, or get their predictions with fedgalore predict")
    options = dict(cfg.task.options)
    current = options.get("data")
    if isinstance(current, dict) and "sites" in current:
        if "labels" in names and not labels:
            raise ExportError(f"--data on a per-site run needs the run's classes, and this {cfg.task.name} run has none "
                              "recorded (a regression, or an export written before they were recorded): evaluate the "
                              "run directory itself, or export it again")
        options["data"] = {"test": str(data)}
        if "labels" in names:
            options["labels"] = list(labels)
    elif isinstance(current, dict):
        options["data"] = {**current, "test": str(data)}
    else:
        options["data"] = {"train": current, "test": str(data)}
        options.pop("test_fraction", None)
    out = FederatedConfig.from_dict(cfg.to_dict())
    out.task.options = options
    return out


@dataclass
class LoadedModel:
    """A model to evaluate or predict with, and the task that makes its inputs."""

    model: nn.Module
    task: Task
    cfg: FederatedConfig
    #: ``run <dir> round <n>`` or ``folder <dir>``
    source: str
    #: set when the run was live (a process running it) as it was read (fedgalore.records.liveness.live_note)
    live: str | None = None
    #: the run directory that trained the model and the round it was taken at, when known (an export
    #: names them in ``fedgalore_export.json``): where :func:`group_training` reads who trained
    run_dir: Path | None = None
    round: int | None = None


def load_for_inference(path: str | Path, cfg: FederatedConfig | None = None, *, data: str | Path | None = None,
                       device: str = "cpu") -> LoadedModel:
    """The model of the run or exported folder ``path`` (a run directory's newest kept checkpoint,
    :func:`~fedgalore.trained.global_model.load_global_model`; a folder by :func:`load_exported`)
    on ``device``, and the task of ``cfg`` (default: the run's saved config, which an export
    carries), its test split read from the file ``data`` when given (:func:`with_test_data`)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path} does not exist; pass a run directory or a folder written by fedgalore export")
    check_device(device)
    is_run = (path / "config.yaml").is_file()  # a run directory (an export carries fedgalore_config.yaml)
    live, run_dir, rnd = None, None, None
    if is_run:
        g = load_global_model(path, device=device)
        model, source, own, live = g.model, f"run {path} round {g.round}", g.cfg, g.live
        run_dir, rnd = path, int(g.round)
    else:
        info = path / "fedgalore_export.json"
        recorded = json.loads(info.read_text()) if info.is_file() else {}
        if recorded.get("run_dir") and recorded.get("round") is not None:
            run_dir, rnd = Path(recorded["run_dir"]), int(recorded["round"])
        own = with_recorded_paths(load_config(path / EXPORT_CONFIG), path / EXPORT_IDENTITY) \
            if (path / EXPORT_CONFIG).is_file() else None
        model, source = None, f"folder {path}"
    cfg = cfg if cfg is not None else own
    if cfg is None:
        raise ExportError(f"{path} carries no {EXPORT_CONFIG}: pass --config CONFIG naming the task to evaluate on")
    if data is not None:
        cfg = with_test_data(cfg, data, _recorded_classes(path, g.task if is_run else None))
    task = g.task if is_run and cfg is own else get_task(cfg.task.name, **cfg.task.options)
    if model is None:
        model = load_exported(path, task).to(device)
    _check_labels(model, task)
    return LoadedModel(model, task, cfg, source, live, run_dir, rnd)


def evaluate(path: str | Path, cfg: FederatedConfig | None = None, *, data: str | Path | None = None,
             device: str = "cpu", batch_size: int | None = None, by: str | None = None,
             min_group: int = MIN_GROUP) -> Evaluation:
    """The metrics (``task.evaluate``) of the run or exported folder ``path`` on the test split of
    ``cfg``'s task (default: the run's saved config), or on the file ``data``
    (:func:`with_test_data`). Batches of ``batch_size`` (default ``federation.eval_batch_size``).
    ``by``: also the metrics of every group of test rows sharing a value of that column (a site),
    in one pass (:meth:`~fedgalore.tasks.base.Task.evaluate_groups`), each group's part in
    training (:func:`group_training`), and the worst group by the task's primary metric among the
    groups of at least ``min_group`` test rows (none named when no group has that many)."""
    if isinstance(min_group, bool) or not isinstance(min_group, int) or min_group < 1:
        raise ExportError(f"--min-group {min_group!r} must be a whole number >= 1 (the fewest test rows a group needs "
                          f"to be named the worst; default {MIN_GROUP})")
    loaded = load_for_inference(path, cfg, data=data, device=device)
    task, model, cfg = loaded.task, loaded.model, loaded.cfg
    examples = task.test_set()
    size = int(batch_size or cfg.federation.eval_batch_size)
    metrics = task.evaluate(model, examples, size)
    out = Evaluation(metrics, loaded.source, cfg.task.name, len(examples), live=loaded.live)
    if by is not None:
        names, groups = groups_by_column(task, by)
        per = task.evaluate_groups(model, examples, groups, size)
        out.by, out.min_group = by, min_group
        out.groups = {n: {"n": int(len(g)), **{k: float(v) for k, v in m.items()}} for n, g, m in zip(names, groups, per)}
        large = [n for n in names if out.groups[n]["n"] >= min_group]
        if large:
            values = [out.groups[n][task.primary_metric] for n in large]
            out.worst = large[int(np.argmin(values) if task.higher_is_better else np.argmax(values))]
        out.training, out.training_note = group_training(loaded.run_dir, loaded.round, by, names)
    return out


def group_training(run_dir: Path | None, at_round: int | None, column: str, names: list[str]) -> tuple[dict[str, str], str | None]:
    """Whether each group ``names`` of ``evaluate --by column`` took part in training the model of
    ``run_dir`` at ``round``: a :data:`TRAINING_STATES` key per group, read from the run's
    ``partition.json`` (its clients and the sites ``min_client_size`` dropped) and
    ``clients.jsonl`` (whose updates were aggregated up to ``at_round``). Known only when the run's
    clients are the values of ``column`` (a ``natural`` partition by it; per-site files and
    ``site``) and the run directory is here: else ``({}, why)``."""
    from fedgalore.jsonl import read_jsonl
    from fedgalore.tasks.generic.data import SITE_COLUMN

    record = (Path(run_dir) / "partition.json") if run_dir is not None else None
    if record is None or not record.is_file():
        return {}, ("not known: the model names no run directory here with a partition.json" if run_dir is None
                    else f"not known: {record} is not here")
    part = json.loads(record.read_text())
    clients_by = part.get("options", {}).get("column") if part.get("kind") == "natural" else (
        SITE_COLUMN if part.get("kind") == "files" else None)
    if clients_by != column:
        return {}, (f"not known by {column}: the run's clients are not the values of a column ({part.get('setting')})"
                    if clients_by is None else f"not known by {column}: the run's clients are its {clients_by!r} values")
    clients = [str(c) for c in part.get("client_names") or []]
    dropped = {str(d["name"]) for d in part.get("dropped") or []}
    # a round's aggregated clients: its last attempt's (a retried round's earlier attempts were discarded), less the
    # uploads rejected (error) or excluded by federation.robust
    recs = [r for r in read_jsonl(Path(run_dir) / "clients.jsonl") if "client" in r and 1 <= int(r.get("round", 0)) <= int(at_round or 0)]
    last = {}
    for r in recs:
        last[int(r["round"])] = max(last.get(int(r["round"]), 0), int(r.get("attempt", 0)))
    aggregated = {int(r["client"]) for r in recs if int(r.get("attempt", 0)) == last[int(r["round"])]
                  and "error" not in r and "robust_excluded" not in r}
    out = {}
    for n in names:
        if n in clients:
            out[n] = "yes" if clients.index(n) in aggregated else "not aggregated"
        else:
            out[n] = "dropped" if n in dropped else "no"
    return out, None


def groups_by_column(task: Task, column: str) -> tuple[list[str], list[np.ndarray]]:
    """The groups of the task's test rows by their value of ``column`` (``evaluate --by``): names
    (sorted) and each one's row indices. The generic tasks keep their files' columns (per-site
    data: ``site``); other tasks have none, which is one :class:`ExportError` line."""
    try:
        values = task.partition_values(column, split="test")
    except TypeError:
        raise ExportError(f"--by {column}: task {task.name!r} keeps no columns of its test rows; --by works for the tasks "
                          "that read your files (text_classification, causal_lm, image_classification)") from None
    except TaskError as exc:
        raise ExportError(f"--by {column}: {str(exc).replace(' to partition by', '')}") from None
    keys = np.asarray([str(v) for v in values])
    names = sorted(set(keys.tolist()))
    return names, [np.flatnonzero(keys == n) for n in names]


def class_names(task: Task) -> list[str] | None:
    """The classes of a task that names them in a ``labels`` option (text and image
    classification), in id order; None for a regression or a task without classes. Recorded in
    ``fedgalore_export.json`` so that ``fedgalore evaluate --data`` builds the task on a test file
    alone with the model's own label ids (:func:`with_test_data`)."""
    options = getattr(task, "options", None)
    if options is None or not hasattr(options, "labels") or getattr(task, "regression", False):
        return None
    return [str(n) for n in task.label_names()]


def _recorded_classes(path: Path, task: Task | None) -> list[str] | None:
    """The classes of the run (``task``) or export (``path``) in id order: the run's task, else the
    export's ``fedgalore_export.json``, else its ``config.json`` ``id2label``; None when unknown."""
    import json

    if task is not None:
        return class_names(task)
    info = path / "fedgalore_export.json"
    if info.is_file() and json.loads(info.read_text()).get("labels"):
        return [str(n) for n in json.loads(info.read_text())["labels"]]
    config = path / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        if c.get("id2label") and c.get("problem_type") != "regression":
            return [str(c["id2label"][k]) for k in sorted(c["id2label"], key=int)]
    return None


def _check_labels(model: nn.Module, task: Task) -> None:
    config = getattr(model, "config", None)
    inner = getattr(model, "get_base_model", lambda: model)()
    if config is None or getattr(config, "problem_type", None) == "regression" or not type(inner).__name__.endswith(
            ("ForSequenceClassification", "ForImageClassification")):
        return
    names = task.label_names()
    if int(config.num_labels) != len(names):
        raise ExportError(f"the model classifies into {config.num_labels} labels but task {task.name!r} has "
                          f"{len(names)} ({', '.join(map(str, names[:6]))}{', …' if len(names) > 6 else ''}); "
                          "evaluate it with the config it was trained with")
