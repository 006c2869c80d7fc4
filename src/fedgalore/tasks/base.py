"""The task interface: a model, its data, its loss and its metrics.

A :class:`Task` is everything the federation needs to know about a domain (paper §6): it builds
the (pretrained) model deterministically, holds the pre-processed train and test sets, says which
categorical column the Dirichlet partition runs over, computes the training loss of a batch and
evaluates a model. Methods never look inside a task beyond this interface.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["Task", "TaskError", "TaskOptions", "task_option", "resolve_target_modules", "head_parameters",
           "subset_examples", "stratified_split", "quiet_transformers"]


class TaskError(ValueError):
    """A task could not be built (missing asset, bad option); the message says how to fix it."""


@dataclass(frozen=True)
class TaskOptions:
    """A task's options: a frozen dataclass registered with the task (:attr:`Task.options_class`),
    as methods declare theirs (:class:`fedgalore.methods.base.MethodOptions`). Every field has a
    default and a one-line doc (:func:`task_option`); ``task.options`` of a config is parsed into it
    (:func:`fedgalore.tasks.parse_task_options`: an unknown or mistyped option is one line that
    lists the task's options) and the task is built as ``TaskClass(**fields)``. Ranges and
    combinations may be checked in ``__post_init__`` (raise :class:`TaskError`)."""


def task_option(default: Any, doc: str) -> Any:
    """A field of a :class:`TaskOptions` dataclass: its default and its one-line doc. A mutable
    default (a list, a dict) is given as is and copied per instance."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


class Task(abc.ABC):
    #: registry name, e.g. "offline_text"
    name: str = "task"
    #: the metric reported in tables ("accuracy", "mse", "exact_match", ...)
    primary_metric: str = "accuracy"
    higher_is_better: bool = True
    #: module-name patterns (last name component) of the nn.Linear layers GaLore/LoRA adapt
    target_modules: Sequence[str] = ("query", "value", "dense")
    #: modules trained (fully) and averaged by every method, e.g. ("classifier",)
    head_modules: Sequence[str] = ("classifier",)
    #: PEFT task type for LoRA methods ("SEQ_CLS", "CAUSAL_LM", or None for a plain model)
    peft_task_type: str | None = "SEQ_CLS"
    #: the task's options (a :class:`TaskOptions` dataclass); ``None``: the constructor's keywords
    #: are passed through unchecked (a task written outside the package before options existed)
    options_class: ClassVar[type[TaskOptions] | None] = None
    #: the options this object was built with (:meth:`__new__` records them), ``None`` when unknown
    options: TaskOptions | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "Task":
        """A task that declares :attr:`options_class` records the options it is built with as
        :attr:`options`, whether :func:`fedgalore.tasks.get_task` builds it or code calls the
        constructor: the call's arguments, defaults filled in, are bound to the constructor's
        parameters, which must be the options' fields (the options' ``__post_init__`` checks run
        here). A subclass whose constructor takes other parameters records ``None``."""
        self = super().__new__(cls)
        opts = cls.options_class
        if opts is not None:
            try:
                bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
            except TypeError:  # __init__ raises its own error for a bad call
                return self
            bound.apply_defaults()
            values = dict(list(bound.arguments.items())[1:])  # without self
            if set(values) == {f.name for f in dataclasses.fields(opts)}:
                self.options = opts(**values)
        return self

    def reported_options(self) -> dict[str, Any]:
        """The options this task object runs with, as plain values (every option, defaults
        included, for a task with :attr:`options_class`; ``{}`` when unknown). A run records them
        for a task object passed in code (``config.yaml``, ``summary.json``, its identity)."""
        from fedgalore.typed import to_plain

        return to_plain(self.options) if isinstance(self.options, TaskOptions) else {}

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The files and folders the task reads that no option value names — a default model
        folder, a data set installed by ``make setup`` — by a short label (``"model"``,
        ``"data"``), for the task built with ``options``. A run's identity fingerprints them
        (:mod:`fedgalore.tasks.fingerprint`) besides every option whose value is an existing file
        or folder. Called before the task is built: it must be cheap and build nothing; an asset
        that is missing may raise its :class:`TaskError` (the build would). Default: none."""
        return {}

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model, identical on every call (pretrained weights; head init seeded)."""

    @abc.abstractmethod
    def train_set(self) -> Sequence[Any]:
        """Pre-processed training examples (indexable); clients hold subsets of indices."""

    @abc.abstractmethod
    def test_set(self) -> Sequence[Any]:
        """Pre-processed held-out examples."""

    @abc.abstractmethod
    def partition_labels(self) -> np.ndarray:
        """One categorical value per training example: the column the Dirichlet split runs over."""

    def validation_set(self) -> Sequence[Any] | None:
        """The task's own held-out examples for model selection (a generic task's ``validation``
        file), or ``None``: then ``federation.validation_fraction`` of the training examples is
        held out instead (:class:`fedgalore.engine.runtime.Runtime`)."""
        return None

    def partition_values(self, column: str | None = None) -> np.ndarray:
        """One value per training example of the column a partition runs over: ``None`` is
        :meth:`partition_labels` (the task's category: the label, the paper's MetaMathQA type);
        a task whose examples keep other columns (a site, a user) returns those by name and
        raises :class:`TaskError` naming the columns it has for any other name."""
        if column is None:
            return np.asarray(self.partition_labels())
        raise TaskError(f"task {self.name!r} has no column {column!r} to partition by; "
                        "it partitions by its labels only (leave the column out)")

    def label_names(self) -> list[str]:
        """Human-readable names of the partition categories (sorted category values by default)."""
        return [str(v) for v in np.unique(self.partition_labels())]

    def processor(self) -> Any | None:
        """What turns raw inputs into this task's model inputs — a tokenizer or an image processor
        (anything with ``save_pretrained``) — saved beside an exported model (``fedgalore
        export``); ``None`` when the task makes its inputs otherwise (``tiny_text``'s token ids)."""
        return None

    @abc.abstractmethod
    def collate(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Stack examples into a batch of tensors."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean training loss of the batch (scalar, differentiable)."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module, examples: Sequence[Any], batch_size: int) -> dict[str, float]:
        """Metrics of ``model`` on ``examples``; must include :attr:`primary_metric`."""

    def evaluate_groups(self, model: nn.Module, examples: Sequence[Any], groups: Sequence[Sequence[int]],
                        batch_size: int) -> list[dict[str, float]]:
        """The metrics of ``model`` on each group of ``examples`` (``groups``: index arrays into
        ``examples``), each equal to ``evaluate(model, subset_examples(examples, g), batch_size)``.
        A task that scores examples one by one (:meth:`example_outputs`) is run ONCE over the union
        of the groups, in full batches, and each group's metrics come from its slice
        (:mod:`fedgalore.tasks.grouped`); any other task — and a subclass that overrides
        :meth:`evaluate` without its own :meth:`metrics_of_outputs` — is evaluated group by group."""
        from fedgalore.tasks.grouped import slice_outputs

        groups = [np.asarray(g, dtype=np.int64) for g in groups]
        if any(len(g) == 0 for g in groups):
            raise TaskError("cannot evaluate an empty group of examples")
        union = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        # the records stand for evaluate() only where metrics_of_outputs is defined with (or below) it
        same = issubclass(_owner(type(self), "metrics_of_outputs"), _owner(type(self), "evaluate"))
        outputs = self.example_outputs(model, subset_examples(examples, union), batch_size) if len(union) and same else None
        if outputs is None:
            return [self.evaluate(model, subset_examples(examples, g), batch_size) for g in groups]
        out, start = [], 0
        for g in groups:
            out.append(self.metrics_of_outputs(slice_outputs(outputs, start, start + len(g))))
            start += len(g)
        return out

    def example_outputs(self, model: nn.Module, examples: Sequence[Any], batch_size: int) -> dict[str, np.ndarray] | None:
        """Per-example records of ``model`` on ``examples`` in one batched pass (one array per
        field, e.g. ``pred``, ``gold``, ``loss``), from which :meth:`metrics_of_outputs` computes
        :meth:`evaluate`'s metrics of any subset; ``None`` (the default): the task evaluates whole
        sets only, and :meth:`evaluate_groups` falls back to one :meth:`evaluate` per group."""
        return None

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics computed from the records of :meth:`example_outputs` (a slice
        of them: one group's examples)."""
        raise NotImplementedError(f"task {self.name!r} has example_outputs but no metrics_of_outputs")

    def describe(self) -> dict[str, Any]:
        """JSON-able summary saved with each run (sizes, label names, model id)."""
        return {
            "name": self.name,
            "primary_metric": self.primary_metric,
            "n_train": len(self.train_set()),
            "n_test": len(self.test_set()),
            "labels": self.label_names(),
        }


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines attribute ``name``."""
    return next(c for c in cls.__mro__ if name in c.__dict__)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and progress bars inside the block (restored after)."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def resolve_target_modules(
    model: nn.Module,
    patterns: Sequence[str],
    exclude: Sequence[str] = (),
) -> list[str]:
    """Full names of the ``nn.Linear`` modules whose last name component matches a pattern.

    A pattern matches the module name's last component exactly, or — if it contains a dot or
    regex metacharacters — the module name by ``re.fullmatch`` / suffix. Modules inside any
    ``exclude`` module (e.g. the classifier head, trained fully by every method) are skipped, so
    every method adapts exactly the same matrices. Raises :class:`TaskError` when nothing matches.
    """
    excluded = tuple(exclude)
    out: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        if any(e in parts or name.startswith(e + ".") or f".{e}." in f".{name}." for e in excluded):
            continue
        for pat in patterns:
            if "." in pat or any(c in pat for c in "*+?[]()|^$\\"):
                if name == pat or name.endswith("." + pat) or re.fullmatch(pat, name):
                    out.append(name)
                    break
            elif parts[-1] == pat:
                out.append(name)
                break
    if not out:
        raise TaskError(
            f"no nn.Linear module matches target_modules={list(patterns)}; "
            f"linear modules are e.g. {[n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:8]}"
        )
    return out


def head_parameters(model: nn.Module, head_modules: Sequence[str]) -> list[str]:
    """Full names of the parameters inside the ``head_modules`` (e.g. ``classifier``), which every
    method trains fully and averages: a parameter belongs to head ``h`` when its name starts with
    ``h.`` or contains ``.h.``."""
    heads = tuple(head_modules)
    return [n for n, _ in model.named_parameters() if any(n.startswith(h + ".") or f".{h}." in f".{n}" for h in heads)]


@dataclass
class ArrayDataset:
    """A minimal indexable dataset over dict-of-arrays (pre-tokenised features)."""

    columns: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {k: v[idx] for k, v in self.columns.items()}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {k: v[idx] for k, v in self.columns.items()}


def subset_examples(examples: Any, indices: Sequence[int]) -> Any:
    """The examples at ``indices`` in the container's own type: column datasets
    (:class:`ArrayDataset` and subclasses) slice every column; dataclass datasets (prompt lists,
    image file lists) slice every per-example field; plain sequences give a list."""
    import dataclasses

    idx = np.asarray(indices, dtype=np.int64)
    if hasattr(examples, "columns"):
        t = torch.as_tensor(idx)
        return type(examples)({k: v[t] for k, v in examples.columns.items()})
    if dataclasses.is_dataclass(examples):
        n = len(examples)
        changes = {}
        for f in dataclasses.fields(examples):
            value = getattr(examples, f.name)
            if isinstance(value, (list, np.ndarray, torch.Tensor)) and len(value) == n:
                changes[f.name] = [value[i] for i in idx] if isinstance(value, list) else value[idx]
        return dataclasses.replace(examples, **changes)
    return [examples[int(i)] for i in idx]


def stratified_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, held_out)`` sorted index arrays: per category ``c`` (in sorted order) a permutation
    of its indices drawn from ``rng``, whose first ``round(fraction · n_c)`` are held out — so the
    held-out set has the pool's label mix. The one stratified split of the package: train/test
    splits of the offline tasks and the validation hold-out (``federation.validation_fraction``)."""
    labels = np.asarray(labels)
    held, kept = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(fraction * len(idx)))
        held.append(idx[:k])
        kept.append(idx[k:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))
