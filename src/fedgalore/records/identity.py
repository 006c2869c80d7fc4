"""A run's identity: everything that shaped its result (docs/cli.md, "Run identity").

A finished run is returned (``fedgalore run``: "already holds this run"; ``compare``: a skipped
cell; ``--resume``: continued) only when its identity equals the one asked for. The identity,
written to ``<run>/identity.json``, is

* ``config`` — the fully resolved config: every option of the task
  (:func:`fedgalore.tasks.resolved_task_options`) and of the method (its options dataclass, as the
  method runs them: :func:`fedgalore.job.resolve.method_options`) with its default filled in,
  so an option left out and the same option written with its default value are the same run, and
  anything else differs. ``output`` (where the run is written, the display, the checkpoint
  cadence) does not count, nor ``federation.num_clients`` of a ``natural`` partition (inferred
  from the data, which counts). A task object passed in code (``fedgalore.run(cfg, task=...)``) is
  its class, name, the options it reports (:meth:`~fedgalore.tasks.Task.reported_options`), its
  ``describe()`` and fingerprints of its train, test and partition data
  (:func:`~fedgalore.tasks.fingerprint.data_fingerprint`); a method object, its class, name, rank
  and options. The method's behaviour version (:attr:`~fedgalore.methods.base.Method.behaviour_version`)
  counts too, so a run of a method whose rule was fixed since (FedGaLore before its
  second-moment fixes, CHANGELOG.md 2026-11-25) is not taken for this version's; a saved run that did not record it ran
  version 1;
* ``inputs`` — fingerprints (:func:`~fedgalore.tasks.fingerprint.fingerprint_path`: names, sizes,
  content hashes, sampled for big files) of what the task reads: every task option (at any depth)
  whose value names an existing file or folder, and what the task reads when no option names it
  (:meth:`~fedgalore.tasks.Task.input_paths`, e.g. the packaged MiniLM folder of ``offline_text``);
* ``schema`` — :data:`CONFIG_SCHEMA`, bumped when the meaning of a config value changes while the
  value does not.

A run directory written before identities existed (no ``identity.json``) is judged by its
``config.yaml`` resolved with this version's defaults; the files it read were not recorded, so
they are taken as unchanged (:func:`saved_identity` says so in :attr:`RunIdentity.note`). A saved
identity lacking a key this version resolves (an option added since) takes the key's value from
the saved ``config.yaml`` resolved now, i.e. the option's default, which is the old behaviour.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from fedgalore.job.config import ConfigError, FederatedConfig, load_config
from fedgalore.job.resolve import method_options
from fedgalore.federated.partitioners import infers_clients
from fedgalore.methods.base import Method, available_methods, method_behaviour
from fedgalore.tasks import Task, TaskError, parse_task_options, resolved_task_options, task_class
from fedgalore.tasks.fingerprint import data_fingerprint, fingerprint_path
from fedgalore.typed import to_plain

__all__ = ["CONFIG_SCHEMA", "IDENTITY_FILE", "RunIdentity", "Difference", "run_identity", "resolved_config", "saved_identity", "base_model_name_for", "base_model_local",
           "compare_with_saved", "write_identity", "with_recorded_paths", "task_label", "summarize"]

#: the config schema version of this code (bump when a config value's meaning changes, its value not)
CONFIG_SCHEMA = 1
IDENTITY_FILE = "identity.json"
_MISSING = object()


class Difference(NamedTuple):
    """One way two identities differ: ``text`` says it (``"train.lr: 0.001 -> 0.0005"``);
    ``inputs`` is true for a model or data file that changed (not a config value)."""

    text: str
    inputs: bool = False

    def __str__(self) -> str:
        return self.text


@dataclass
class RunIdentity:
    """What shaped a run (module doc). ``inputs`` is ``None`` when unknown (a run directory from
    before identities); ``note`` says what was unknown."""

    config: dict[str, Any]
    inputs: dict[str, dict[str, Any]] | None
    schema: int | None = CONFIG_SCHEMA
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "config": self.config, "inputs": self.inputs}

    @property
    def task_object(self) -> dict[str, Any] | None:
        """The task object's record (class, name, options, data fingerprints), ``None`` for a
        task built from the registry by name."""
        task = self.config.get("task", {})
        return task if task.get("object") else None

    def differences(self, new: "RunIdentity", ignore: Sequence[str] = ()) -> list[Difference]:
        """What differs from this (saved) identity to ``new``, one entry per key, e.g.
        ``"method.options.sync: 'ajive' -> 'mean'"`` or ``"task.options.model_path (/m):
        contents changed: model.safetensors"``; ``[]``: the same run. Keys under ``ignore`` do not
        count. Inputs count when both sides recorded them; an input read on one side only counts
        when the configs agree (otherwise it follows from the config's difference). A task
        object's data (``task.data.*``) counts as an input."""
        out = [] if self.schema in (None, new.schema) else [Difference(f"config schema: {self.schema} -> {new.schema}")]
        a, b = _flatten(self.config), _flatten(new.config)
        for key in sorted(set(a) | set(b)):
            if any(key == i or key.startswith(i + ".") for i in ignore):
                continue
            va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
            if va != vb:
                out.append(Difference(f"{key}: {_show(va)} -> {_show(vb)}", key.startswith("task.data.")))
        if self.inputs is None or new.inputs is None:
            return out
        config_equal = all(d.inputs for d in out)
        for label in sorted(set(self.inputs) | set(new.inputs)):
            old_fp, new_fp = self.inputs.get(label), new.inputs.get(label)
            if old_fp is None or new_fp is None:
                if config_equal:
                    out.append(Difference(f"{label}: not read before -> {new_fp['path']}" if old_fp is None
                                          else f"{label}: no longer read ({old_fp['path']})", True))
            elif (old_fp.get("kind"), old_fp.get("sha256")) != (new_fp.get("kind"), new_fp.get("sha256")):
                out.append(Difference(f"{label} ({new_fp['path']}): {_changes(old_fp, new_fp)}", True))
        return out


def run_identity(cfg: FederatedConfig, *, task: Task | None = None, method: Method | None = None) -> RunIdentity:
    """The identity of the run ``cfg`` describes (module doc); ``task`` / ``method``: objects
    passed in code instead of building them from the config. A config whose ``task.object`` names
    a task object (a saved run of one) and no ``task`` is a :class:`ConfigError` saying to pass it."""
    if task is None and cfg.task.object:
        raise ConfigError(f"the task of this run is an object passed in code ({cfg.task.object}), which the config "
                          "cannot rebuild; pass it again in Python: fedgalore.run(cfg, resume=RUN_DIR, task=<the object>)")
    config = resolved_config(cfg, task=task, method=method)
    reads: dict[str, Path] = {}
    if task is not None:
        cls, options = type(task), task.options
        scanned = {"options": config["task"]["options"], "describe": config["task"]["describe"]}
    else:
        cls, options = task_class(cfg.task.name), parse_task_options(cfg.task.name, cfg.task.options)
        scanned = {"options": config["task"]["options"]}
    for label, value in _path_values("task", scanned):
        reads.setdefault(label, Path(value).expanduser())
    named = {p.resolve() for p in reads.values()}
    for label, path in (cls.input_paths(options) if hasattr(cls, "input_paths") else {}).items():
        if Path(path).resolve() not in named:
            reads[f"task.reads.{label}"] = Path(path)
    inputs = {}
    for label, path in reads.items():
        fp = fingerprint_path(path)
        if fp is not None:
            inputs[label] = {"path": str(path.resolve()), **fp}
    return RunIdentity(config, inputs)


def resolved_config(cfg: FederatedConfig, *, task: Task | None = None, method: Method | None = None) -> dict[str, Any]:
    """``cfg`` as plain data with every task and method option resolved (defaults filled in), a
    task / method object described as what it is, and ``output`` left out (module doc)."""
    d = cfg.to_dict()
    d.pop("output", None)
    d.pop("export", None)  # what a run keeps for export, not what it computes
    if infers_clients(cfg.federation.partition.kind):
        # one client per value of the column: the count follows from the (fingerprinted) data, and a
        # run records it filled in (config.yaml) while its config may leave it out or give it
        d["federation"]["num_clients"] = None
    if task is not None:
        d["task"] = {
            "name": task.name,
            "object": f"{type(task).__module__}:{type(task).__qualname__}",
            "options": task.reported_options(),
            "describe": task.describe(),
            "data": {"train": data_fingerprint(task.train_set()), "test": data_fingerprint(task.test_set()),
                     "partition": data_fingerprint(np.asarray(task.partition_labels()))},
        }
    elif not cfg.task.object:
        d["task"]["options"] = resolved_task_options(cfg.task.name, cfg.task.options)
    if method is not None:
        d["method"] = {"name": method.name, "object": f"{type(method).__module__}:{type(method).__qualname__}",
                       "rank": method.rank, "options": to_plain(method.options), "behaviour": method.behaviour_version}
    elif cfg.method.name in available_methods():
        d["method"]["options"] = to_plain(method_options(cfg))
        d["method"]["behaviour"] = method_behaviour(cfg.method.name)
    return json.loads(json.dumps(d, default=str))


def saved_identity(run_dir: Path) -> RunIdentity:
    """The identity of the run in ``run_dir`` (module doc: ``identity.json`` over its
    ``config.yaml`` resolved now; without ``identity.json``, the latter alone and inputs unknown).
    A ``config.yaml`` that this version cannot load is a :class:`ConfigError` saying why."""
    try:
        cfg = load_config(run_dir / "config.yaml")
        now = resolved_config(cfg)
    except (ConfigError, TaskError) as exc:
        raise ConfigError(f"its config.yaml does not load with this version ({exc})") from None
    if "behaviour" in now.get("method", {}):
        now["method"]["behaviour"] = 1  # a run that did not record it ran a method's first version
    path = run_dir / IDENTITY_FILE
    if not path.is_file():
        note = (f"{run_dir} was written before run identities (no {IDENTITY_FILE}): its config.yaml is compared "
                "with this version's defaults filled in; the model and data files it read were not recorded")
        return RunIdentity(now, None, None, note)
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"its {IDENTITY_FILE} is unreadable ({exc})") from None
    return RunIdentity(_overlay(now, stored.get("config") or {}), stored.get("inputs"), stored.get("schema"))


def compare_with_saved(run_dir: Path, identity: RunIdentity, ignore: Sequence[str] = ()) -> tuple[list[Difference], str | None]:
    """``(differences, note)`` between the run saved in ``run_dir`` and ``identity``
    (:meth:`RunIdentity.differences`); an unloadable saved run differs with the reason;
    ``note``: what was unknown about the saved run (see :func:`saved_identity`)."""
    try:
        saved = saved_identity(run_dir)
    except ConfigError as exc:
        return [Difference(str(exc))], None
    return saved.differences(identity, ignore), saved.note


def write_identity(run_dir: Path, identity: RunIdentity) -> None:
    """``<run_dir>/identity.json`` (atomically)."""
    from fedgalore.federated.checkpoint import atomic_write_text

    atomic_write_text(run_dir / IDENTITY_FILE, json.dumps(identity.to_json(), indent=1, sort_keys=True))


def with_recorded_paths(cfg: FederatedConfig, identity_file: Path) -> FederatedConfig:
    """``cfg`` (a run's saved config) with every relative path among its task options replaced by
    the absolute path the run read it from (the ``inputs`` of its ``identity_file``: the run's
    ``identity.json``, or the copy an export carries), so the run's task rebuilds from any working
    directory (``fedgalore export`` / ``evaluate`` of a run started elsewhere); a recorded path that
    no longer exists (a moved project) leaves the relative one. ``cfg`` itself when the file is
    missing or recorded no inputs."""
    try:
        inputs = json.loads(Path(identity_file).read_text()).get("inputs") or {}
    except (OSError, json.JSONDecodeError):
        return cfg
    out = FederatedConfig.from_dict(cfg.to_dict())
    for label, fp in inputs.items():
        keys = label.split(".")
        if keys[:2] != ["task", "options"] or len(keys) < 3:
            continue
        try:
            holder: Any = out.task.options
            for k in keys[2:-1]:
                holder = holder[int(k) if isinstance(holder, list) else k]
            last: Any = int(keys[-1]) if isinstance(holder, list) else keys[-1]
            value = holder[last]
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() and Path(fp["path"]).exists():
            holder[last] = fp["path"]
    return out


def task_label(cfg: FederatedConfig, identity: RunIdentity | None) -> str:
    """The task's name in ``summary.json`` and reports: the registered name, or for a task object
    passed in code ``"<name> (<Class> object)"``."""
    obj = identity.task_object if identity is not None else None
    if obj is None:
        return cfg.task.name
    return f"{obj['name']} ({obj['object'].rsplit(':', 1)[-1].rsplit('.', 1)[-1]} object)"


def summarize(differences: Sequence[Difference], limit: int = 3) -> str:
    """The first ``limit`` differences joined, with how many more there are."""
    more = len(differences) - limit
    return "; ".join(map(str, differences[:limit])) + (f"; and {more} more" if more > 0 else "")


# ----------------------------------------------------------------------------- helpers
def _path_values(prefix: str, value: Any) -> Iterator[tuple[str, str]]:
    """``(dotted key, value)`` of every string at any depth of ``value`` that names an existing
    file or folder."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _path_values(f"{prefix}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _path_values(f"{prefix}.{i}", v)
    elif isinstance(value, str) and value.strip() and "\n" not in value:
        try:
            if Path(value).expanduser().exists():
                yield prefix, value
        except (OSError, ValueError):  # a name too long or with a NUL byte: not a path
            return


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}`` (lists are values; an empty mapping has no keys)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _overlay(base: Any, top: Any) -> Any:
    """``top`` with the keys it lacks taken from ``base`` (recursively)."""
    if not isinstance(base, dict) or not isinstance(top, dict):
        return top
    return {**base, **{k: _overlay(base.get(k), v) if k in base else v for k, v in top.items()}}


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed between two fingerprints of one input, in words."""
    if old.get("kind") != new.get("kind"):
        return f"was a {old.get('kind')}, now a {new.get('kind')}"
    if new.get("kind") == "file":
        return "contents changed" + (f" (size {old['size']} -> {new['size']})" if old.get("size") != new.get("size") else "")
    a, b = old.get("listing"), new.get("listing")
    if a is None or b is None:
        return f"contents changed ({old.get('files')} -> {new.get('files')} files)"
    parts = []
    for what, names in (("changed", [n for n in b if n in a and a[n] != b[n]]), ("added", [n for n in b if n not in a]),
                        ("removed", [n for n in a if n not in b])):
        if names:
            parts.append(", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "") + f" {what}")
    return ", ".join(parts) or "contents changed"


def base_model_name_for(task: Any, run_dir: Path) -> tuple[str | None, str | None]:
    """:func:`base_model_name` of ``task`` run in ``run_dir`` (whose ``config.yaml`` says what the user gave)."""
    from fedgalore.tasks.assets import folder_hub_id, hub_id

    desc = task.describe()
    local = desc.get("model") or desc.get("checkpoint")
    try:
        given = dict(load_config(Path(run_dir) / "config.yaml").task.options)
    except (OSError, ConfigError):
        given = {}
    adapter = getattr(task, "adapter", None)
    if adapter is not None:
        local = adapter.base
    found = folder_hub_id(local) if local else None  # a local copy of a hub model: named by its hub id
    if found is not None:
        name = found[0]
    elif adapter is not None:
        name = str(given.get("base_model") or adapter.base_name)
    elif given.get("model"):
        name = str(given["model"])
    elif local:
        name = hub_id(local) or str(local)
    else:
        return None, None
    notes = []
    if local and str(local) != name:
        notes.append(f"this run read {local}")
    if found is not None:
        notes.append(found[1])
    return name, "; ".join(notes) or None


def base_model_local(task: Any) -> str | None:
    from fedgalore.tasks.assets import folder_hub_id

    """The local folder the run's base model was read from, when :func:`base_model_name` names it
    by a hub id (:func:`fedgalore.tasks.assets.folder_hub_id`): the offline fallback a model card names
    beside that id; None otherwise."""
    adapter = getattr(task, "adapter", None)
    desc = task.describe()
    local = adapter.base if adapter is not None else (desc.get("model") or desc.get("checkpoint"))
    return str(local) if local and folder_hub_id(local) is not None else None
