"""Task registry. Entries are imported lazily so optional dependencies load only when used.

``get_task(name, **options)`` builds a task; ``available_tasks()`` lists the names.
"""
from __future__ import annotations

import importlib
from typing import Any

import dataclasses

from fedgalore.tasks.base import ArrayDataset, Task, TaskError, TaskOptions, resolve_target_modules, task_option
from fedgalore.typed import ConfigError, from_plain, to_plain

__all__ = ["Task", "TaskError", "TaskOptions", "task_option", "ArrayDataset", "resolve_target_modules", "get_task",
           "task_class", "parse_task_options", "resolved_task_options", "available_tasks", "TASKS", "TASK_NEEDS",
           "HUB_TASKS"]

#: name -> "module:Class" (paper-scale hub tasks and their offline CPU counterparts: modules paper_text,
#: paper_vision, paper_math; the generic tasks named text_classification / causal_lm / image_classification: generic/)
TASKS: dict[str, str] = {
    # tiny random-weight task for tests and smoke runs (seconds)
    "tiny_text": "fedgalore.tasks.synthetic:TinyTextTask",
    # text classification (paper: RoBERTa-base x GLUE)
    "offline_text": "fedgalore.tasks.paper_text.bbc:OfflineBBCNewsTask",
    "offline_text_amazon": "fedgalore.tasks.paper_text.amazon:OfflineAmazonReviewsTask",
    "glue": "fedgalore.tasks.paper_text.glue:GlueTask",
    # image classification (paper: ViT-base x DomainNet)
    "offline_vision": "fedgalore.tasks.paper_vision:OfflineFashionMnistTask",
    "offline_vision_mnist": "fedgalore.tasks.paper_vision:OfflineMnistTask",
    # feature skew (paper: DomainNet's domains): Fashion-MNIST drawn in visual styles
    "offline_vision_domains": "fedgalore.tasks.domains:OfflineVisionDomainsTask",
    "domainnet": "fedgalore.tasks.paper_vision:DomainNetTask",
    # causal LM for math (paper: Llama-2-7B x MetaMathQA -> GSM8K / MATH)
    "offline_math": "fedgalore.tasks.paper_math.gsm_symbolic:OfflineGsmSymbolicTask",
    "metamath": "fedgalore.tasks.paper_math.metamath:MetaMathQATask",
    # generic tasks: your model and your files, configured by task.options (docs/data.md)
    "text_classification": "fedgalore.tasks.generic.text:GenericTextClassificationTask",
    "causal_lm": "fedgalore.tasks.generic.causal:GenericCausalLMTask",
    "image_classification": "fedgalore.tasks.generic.image:GenericImageClassificationTask",
}


#: tasks that download their model or data from the Hugging Face hub unless given local paths
#: (the generic tasks do when task.options.model or data is a hub id)
HUB_TASKS = frozenset({"glue", "domainnet", "metamath", "text_classification", "causal_lm", "image_classification"})

#: what each task needs to run (``fedgalore tasks``); "offline assets" = installed by ``make setup``
TASK_NEEDS: dict[str, str] = {
    "tiny_text": "CPU, nothing to download (random weights; smoke tests)",
    "offline_text": "CPU, offline assets",
    "offline_text_amazon": "CPU, offline assets",
    "offline_vision": "CPU, offline assets",
    "offline_vision_mnist": "CPU, offline assets",
    "offline_vision_domains": "CPU, offline assets (feature skew: partition @domain)",
    "offline_math": "CPU (about 15 min a run), offline assets",
    "glue": "GPU; hub (roberta-base, GLUE) or task.options.model / data_dir",
    "domainnet": "GPU; hub ViT (or task.options.model) + DomainNet images on disk (task.options.root)",
    "metamath": "GPU (7B model); hub (Llama-2, MetaMathQA, GSM8K, MATH) or local paths in task.options",
    "text_classification": "your files + a model folder or hub id (default: offline MiniLM); docs/data.md",
    "causal_lm": "your files + a model folder or hub id (default: offline SmolLM2); docs/data.md",
    "image_classification": "your images + a model folder or hub id (default: offline tiny ViT); docs/data.md",
}


def available_tasks() -> list[str]:
    return sorted(TASKS)


def task_class(name: str) -> type[Task]:
    """The registered task class ``name`` (imported on first use; TaskError with a fix otherwise)."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(available_tasks())}")
    module, cls = TASKS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise TaskError(f"task {name!r} needs a package that is not installed ({exc.name}); run `make setup`") from None


def parse_task_options(name: str, options: dict[str, Any] | None) -> TaskOptions | None:
    """``task.options`` of task ``name`` as its typed :class:`TaskOptions` (``None`` for a task
    that declares none). An unknown option, or a value of the wrong type, is one
    :class:`TaskError` line naming the task and listing its options."""
    cls = getattr(task_class(name), "options_class", None)  # a registered class outside Task may declare none
    if cls is None:
        return None
    try:
        return from_plain(cls, dict(options or {}), "task.options")
    except ConfigError as exc:
        valid = ", ".join(f.name for f in dataclasses.fields(cls))
        msg = str(exc)
        if "valid keys here" in msg:  # from_plain's unknown-key line: say which task, list its options
            key = msg.split(";")[0].rsplit(".", 1)[-1]
            msg = f"task {name!r} has no option {key!r}"
        else:
            msg = f"task {name!r}: " + msg.removeprefix("task.options: ")
        raise TaskError(f"{msg}; its options are: {valid} (`fedgalore tasks` lists them with defaults)") from None


def resolved_task_options(name: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """Every option of task ``name`` with its default filled in (plain values): two configs whose
    options differ only by a default written out resolve equal. A task without declared options
    gives its options as given."""
    parsed = parse_task_options(name, options)
    return dict(options or {}) if parsed is None else to_plain(parsed)


def get_task(name: str, **options: Any) -> Task:
    """Build the task ``name`` with its options (raises TaskError with a fix on bad input)."""
    task_cls = task_class(name)
    parsed = parse_task_options(name, options)
    kwargs = options if parsed is None else {f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)}
    try:
        return task_cls(**kwargs)
    except TypeError as exc:
        raise TaskError(f"bad option for task {name!r}: {exc}") from None
