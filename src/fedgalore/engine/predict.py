"""Predictions of an exported folder or a run on a file (``fedgalore predict``; docs/export.md).

::

    import fedgalore
    res = fedgalore.predict("exported/news", "new.csv", "predictions.csv")      # an export
    res = fedgalore.predict("runs/news-fedgalore-naturalsite-s0", "new.jsonl", "out.jsonl")  # a run's newest checkpoint

The model and its task are loaded as ``fedgalore evaluate`` loads them
(:func:`~fedgalore.engine.evaluate.load_for_inference`: a run directory's newest kept checkpoint —
said when a process is still running it —, or an exported folder with the config it carries; the
task is rebuilt from that config, so its data files must be readable here, as for ``evaluate``).
The file (``.csv``, ``.tsv``, ``.json``, ``.jsonl``, ``.parquet``, read like the task's own data)
needs the task's input columns only — no label or response column:

* text classification (``text_classification`` and the offline text tasks): the text column(s)
  (the task's ``text_column`` / ``text_columns``; ``text_column`` overrides, default ``text`` for a
  task without one), tokenised as the task tokenises → ``predicted_label``,
  ``predicted_probability`` and ``prob_<class>`` for every class (softmax of the logits); a
  regression: ``predicted_score``;
* ``image_classification``: the image column (paths relative to the file's folder) → the same
  columns as text classification;
* ``causal_lm``: the columns its format reads for the prompt (an instruction, a template's
  fields, or a conversation ending with the user's turn) → ``generation`` (greedy,
  ``max_new_tokens`` from the task or given).

The output (``.csv`` or ``.jsonl``, by ``out``'s extension) holds every input column, then the
predicted ones; it is written beside ``out`` and renamed into place. Batches of ``batch_size``
(default ``federation.eval_batch_size``); ``on_batch(k, n)`` is called after every batch with its
number of rows and the file's (a progress bar).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedgalore.engine.config import FederatedConfig
from fedgalore.engine.evaluate import load_for_inference
from fedgalore.engine.global_model import ExportError
from fedgalore.tasks.base import Task, TaskError

__all__ = ["predict", "Predictions", "OUT_FORMATS"]

OUT_FORMATS = (".csv", ".jsonl")


@dataclass
class Predictions:
    """What :func:`predict` wrote."""

    out: Path
    rows: int
    #: ``run <dir> round <n>`` or ``folder <dir>``
    source: str
    task: str
    #: the columns added to the input's
    columns: list[str] = field(default_factory=list)
    #: set when the run was live (a process running it) as it was read: which round this took
    live: str | None = None


def predict(path: str | Path, data: str | Path, out: str | Path, cfg: FederatedConfig | None = None, *,
            batch_size: int | None = None, device: str = "cpu", text_column: str | list[str] | None = None,
            max_new_tokens: int | None = None, on_batch: Callable[[int, int], None] | None = None,
            force: bool = False) -> Predictions:
    """Predict every row of the file ``data`` with the run or exported folder ``path`` and write
    the rows with their predictions to ``out`` (module doc). ``out`` must not exist unless
    ``force``. Bad input is one :class:`ExportError` line."""
    data, out = Path(data), Path(out)
    if out.suffix.lower() not in OUT_FORMATS:
        raise ExportError(f"--out {out}: write predictions to a {' or '.join(OUT_FORMATS)} file (the extension picks the format)")
    if out.exists() and not force:
        raise ExportError(f"--out {out} exists; choose another file, or add --force to replace it")
    if not data.is_file():
        raise ExportError(f"--data {data}: no such file (a .csv, .tsv, .json, .jsonl or .parquet file of the rows to predict)")
    rows = _read(data)
    loaded = load_for_inference(path, cfg, device=device)
    task, model = loaded.task, loaded.model
    size = int(batch_size or loaded.cfg.federation.eval_batch_size)
    kind = _kind(task)
    if kind == "causal":
        added = _generate(task, model, rows, size, max_new_tokens, on_batch)
    else:
        examples = _text_examples(task, rows, text_column) if kind == "text" else task.prediction_examples(rows)
        added = _classify(task, model, examples, size, on_batch)
    table = _table(rows)
    clash = [c for c in added if c in table]
    if clash:
        raise ExportError(f"{data.name} already has a column {clash[0]!r}, which predict adds; rename that column")
    for name, values in added.items():
        table[name] = values
    _write(table, out)
    return Predictions(out, len(rows), loaded.source, loaded.cfg.task.name, list(added), loaded.live)


# ----------------------------------------------------------------------------- inputs
def _read(path: Path) -> Any:
    """The rows of ``path`` (:class:`~fedgalore.tasks.generic.data.Rows`), read like a task's data file."""
    from fedgalore.tasks.generic.data import load_sources

    try:
        raw = load_sources(str(path))
    except TaskError as exc:
        raise ExportError(str(exc).replace("task.options.data: ", "--data: ")) from None
    if set(raw) != {"train"}:
        raise ExportError(f"--data {path} holds several splits ({', '.join(raw)}); give one file of rows")
    return raw["train"]


def _kind(task: Task) -> str:
    from fedgalore.tasks.text_classification.base import TextClassificationTask

    if isinstance(task, TextClassificationTask):
        return "text"
    if hasattr(task, "prediction_prompts"):
        return "causal"
    if hasattr(task, "prediction_examples"):
        return "image"
    raise ExportError(f"task {task.name!r} makes its own inputs (no columns to read from a file); predict works for "
                      "text_classification (and the offline text tasks), image_classification and causal_lm")


def _text_examples(task: Any, rows: Any, text_column: str | list[str] | None) -> Any:
    if text_column is not None:
        columns = [text_column] if isinstance(text_column, str) else list(text_column)
        option = "--text-column"
    else:
        columns = list(getattr(task, "text_columns", None) or ["text"])
        option = "text_column"
    if not 1 <= len(columns) <= 2:
        raise ExportError(f"--text-column names one column, or two of a sentence pair (got {columns})")
    for c in columns:
        if c not in rows.columns:
            raise ExportError(f"{rows.name} has no column {c!r} (the task's {option}); its columns: {', '.join(rows.columns)}"
                              + ("; name the text column with --text-column" if option == "text_column" else ""))
    texts = [["" if v is None else str(v) for v in rows.data[c]] for c in columns]
    return task.encode_texts(texts[0], texts[1] if len(texts) > 1 else None)


# ----------------------------------------------------------------------------- predicting
def _classify(task: Any, model: Any, examples: Any, batch_size: int, on_batch: Callable[[int, int], None] | None) -> dict[str, list]:
    """``predicted_label``, ``predicted_probability`` and ``prob_<class>`` (softmax), or
    ``predicted_score`` for a regression."""
    import torch

    from fedgalore.tasks.grouped import classifier_outputs

    regression = bool(getattr(task, "regression", False))
    outputs = classifier_outputs(model, examples, batch_size, regression=regression, collate=task.collate, on_batch=on_batch)
    logits = torch.as_tensor(outputs["logits"])
    if regression:
        return {"predicted_score": logits[:, 0].tolist()}
    names = [str(n) for n in task.label_names()]
    probs = torch.softmax(logits.double(), dim=-1).numpy()
    pred = probs.argmax(-1)
    added: dict[str, list] = {"predicted_label": [names[i] for i in pred],
                              "predicted_probability": probs[np.arange(len(pred)), pred].tolist()}
    for k, n in enumerate(names):
        added[f"prob_{n}"] = probs[:, k].tolist()
    return added


def _generate(task: Any, model: Any, rows: Any, batch_size: int, max_new_tokens: int | None,
              on_batch: Callable[[int, int], None] | None) -> dict[str, list]:
    """``generation``: the greedy continuation of every row's prompt."""
    prompts = task.prediction_prompts(rows)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            texts += task.generate(model, chunk, max_new_tokens)
            if on_batch is not None:
                on_batch(len(chunk), len(prompts))
    finally:
        model.train(was_training)
    return {"generation": texts}


# ----------------------------------------------------------------------------- output
def _table(rows: Any) -> Any:
    """The input rows as a pandas table; an image cell (``{bytes, path}``) becomes its path."""
    table = rows.data.to_pandas()
    for c in table.columns:
        if len(table) and isinstance(table[c].iloc[0], dict) and "bytes" in table[c].iloc[0]:
            table[c] = [v.get("path") if isinstance(v, dict) else v for v in table[c]]
    return table


def _write(table: Any, out: Path) -> None:
    """``table`` as ``out``'s format, written beside it and renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if out.suffix.lower() == ".csv":
            table.to_csv(tmp, index=False)
        else:
            table.to_json(tmp, orient="records", lines=True, force_ascii=False)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
