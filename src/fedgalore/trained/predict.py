"""Predictions of an exported folder or a run on a file (``fedgalore predict``; docs/export.md).

::

    import fedgalore
    res = fedgalore.predict("exported/news", "new.csv", "predictions.csv")      # an export
    res = fedgalore.predict("runs/news-fedgalore-naturalsite-s0", "new.jsonl", "out.jsonl")  # a run's newest checkpoint

The model and its task are loaded as ``fedgalore evaluate`` loads them
(:func:`~fedgalore.trained.evaluate.load_for_inference`: a run directory's newest kept checkpoint —
said when a process is still running it —, or an exported folder with the config it carries; the
task is rebuilt from that config, so its data files must be readable here, as for ``evaluate``).
The file (``.csv``, ``.tsv``, ``.json``, ``.jsonl``, ``.parquet``, read like the task's own data)
needs the task's input columns only — no label or response column. A ``.csv`` / ``.tsv`` file is
read with the run's ``task.options.csv`` (delimiter, encoding, quote character; a field it leaves
out is sniffed from the file: :mod:`~fedgalore.tasks.generic.csvfiles`), each field overridable by
``csv`` (``--csv KEY=VALUE``: :func:`parse_csv_options`); a UTF-8 file with a byte-order mark is
read as ``utf-8-sig`` even where ``utf-8`` is given. A file whose header line is one column name
(no ``,`` ``;`` tab or ``|`` in it) and whose delimiter is not given is read as one column: each
line is one value, commas and all (a quoted value is unquoted).

* text classification (``text_classification`` and the offline text tasks): the text column(s)
  (the task's ``text_column`` / ``text_columns``; ``text_column`` overrides, default ``text`` for a
  task without one), tokenised as the task tokenises → ``predicted_label``,
  ``predicted_probability`` and ``prob_<class>`` for every class (softmax of the logits); a
  regression: ``predicted_score``;
* ``image_classification``: the image column (paths relative to the file's folder) → the same
  columns as text classification. ``data`` may also be a folder of images — flat, or one
  sub-folder per class as training reads one (:func:`~fedgalore.tasks.generic.data.read_image_folder`)
  —: its rows are the images (sorted; the column named as the task's ``image_column``, and ``label``
  with the class folder's name), written to a UTF-8 ``,`` CSV;
* ``causal_lm``: the columns its format reads for the prompt (an instruction, a template's
  fields, or a conversation ending with the user's turn) → ``generation`` (greedy,
  ``max_new_tokens`` from the task or given), batched and with the key/value cache of
  ``transformers``' ``generate``; a LoRA run's adapters are merged into the weights first (the
  same greedy text, without the adapters' extra matmuls at every token).

The output (``.csv`` or ``.jsonl``, by ``out``'s extension) holds every input column, then the
predicted ones; it is written beside ``out`` and renamed into place. A ``.csv`` output of a
``.csv`` / ``.tsv`` input is written as the input is: its delimiter (``,`` for a one-column
input), encoding (a byte-order mark when it had one), quote character and line ends (``\r\n``
when its first line ends so); of another input, UTF-8 with ``,`` and ``\n``. A list or dict cell
(a chat's ``messages``) is written to a CSV as JSON text, an empty cell stays empty, and an
integer column with empty cells keeps its integers. Batches of ``batch_size``
(default ``federation.eval_batch_size``); ``on_batch(k, n)`` is called after every batch with its
number of rows and the file's (a progress bar).
"""
from __future__ import annotations

import codecs
import csv as csvlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fedgalore.job.config import FederatedConfig
from fedgalore.trained.evaluate import load_for_inference
from fedgalore.trained.global_model import ExportError
from fedgalore.tasks.base import Task, TaskError

__all__ = ["predict", "Predictions", "OUT_FORMATS", "CSV_KEYS", "CsvStyle", "parse_csv_options"]

OUT_FORMATS = (".csv", ".jsonl")
#: the fields ``--csv KEY=VALUE`` sets (those of ``task.options.csv``)
CSV_KEYS = ("delimiter", "encoding", "quotechar")
#: delimiters a one-column file is read with (the first its text does not hold): no line is split
_ONE_COLUMN = ("\x1f", "\x1e", "\x1d", "\x1c")


@dataclass(frozen=True)
class CsvStyle:
    """How a delimited input file is written, so that the predictions are written the same way."""

    delimiter: str
    encoding: str
    quotechar: str
    #: ``"\r\n"`` when the file's first line ends so, else ``"\n"``
    lineterminator: str


def parse_csv_options(items: Sequence[str] | None) -> dict[str, str]:
    """``--csv KEY=VALUE`` arguments as a mapping (KEY one of :data:`CSV_KEYS`); ``tab`` or ``\\t``
    is a tab. A malformed item is one :class:`ExportError` line."""
    out: dict[str, str] = {}
    for item in items or ():
        key, eq, value = str(item).partition("=")
        key = key.strip()
        if not eq or key not in CSV_KEYS or not value:
            raise ExportError(f"--csv {item}: give KEY=VALUE with KEY one of {', '.join(CSV_KEYS)}, e.g. --csv "
                              "delimiter=';' --csv encoding=cp1252 (delimiter=tab for a tab)")
        out[key] = "\t" if key == "delimiter" and value in ("tab", "\\t") else value
    return out


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
            force: bool = False, csv: Mapping[str, str] | None = None) -> Predictions:
    """Predict every row of the file ``data`` with the run or exported folder ``path`` and write
    the rows with their predictions to ``out`` (module doc). ``out`` must not exist unless
    ``force``. ``csv``: fields of ``task.options.csv`` (:data:`CSV_KEYS`) that replace the run's
    for reading ``data``. Bad input is one :class:`ExportError` line."""
    data, out = Path(data), Path(out)
    if out.suffix.lower() not in OUT_FORMATS:
        raise ExportError(f"--out {out}: write predictions to a {' or '.join(OUT_FORMATS)} file (the extension picks the format)")
    if out.exists() and not force:
        raise ExportError(f"--out {out} exists; choose another file, or add --force to replace it")
    if not data.is_file() and not data.is_dir():
        raise ExportError(f"--data {data}: no such file or folder (a .csv, .tsv, .json, .jsonl or .parquet file of the rows "
                          "to predict, or a folder of images)")
    unknown = sorted(set(csv or {}) - set(CSV_KEYS))
    if unknown:
        raise ExportError(f"--csv {unknown[0]}: not a CSV option; give {', '.join(CSV_KEYS)}")
    loaded = load_for_inference(path, cfg, device=device)
    task, model = loaded.task, loaded.model
    rows, style = _image_folder(task, data) if data.is_dir() else _read(data, _csv_options(task, csv, data))
    size = int(batch_size or loaded.cfg.federation.eval_batch_size)
    kind = _kind(task)
    if kind == "causal":
        if hasattr(model, "merge_and_unload"):  # a PEFT model: generate with W + BA folded in (7× faster on a CPU, same text)
            model = model.merge_and_unload()
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
    _write(table, out, style)
    return Predictions(out, len(rows), loaded.source, loaded.cfg.task.name, list(added), loaded.live)


# ----------------------------------------------------------------------------- inputs
def _csv_options(task: Task, given: Mapping[str, str] | None, path: Path) -> Any:
    """The ``CsvOptions`` ``path`` is read with: the task's ``csv`` option, its fields replaced by
    ``given``'s; ``utf-8`` becomes ``utf-8-sig`` for a file that starts with a UTF-8 byte-order mark."""
    from fedgalore.tasks.generic.csvfiles import CsvOptions

    base = getattr(getattr(task, "options", None), "csv", None)
    fields = {k: getattr(base, k) for k in CSV_KEYS} if base is not None else {}
    fields.update({k: v for k, v in (given or {}).items() if v is not None})
    if str(fields.get("encoding") or "").lower().replace("_", "-") in ("utf-8", "utf8") and path.is_file():
        with open(path, "rb") as fh:
            if fh.read(3) == codecs.BOM_UTF8:
                fields["encoding"] = "utf-8-sig"
    try:
        return CsvOptions(**{k: v for k, v in fields.items() if v is not None})
    except TaskError as exc:
        raise ExportError(str(exc).replace("task.options.csv.", "--csv ")) from None


def _read(path: Path, options: Any = None) -> tuple[Any, CsvStyle | None]:
    """The rows of ``path`` (:class:`~fedgalore.tasks.generic.data.Rows`), read like a task's data
    file with the CSV ``options``, and how the file is written when it is a ``.csv`` / ``.tsv``."""
    from fedgalore.tasks.generic.csvfiles import CsvOptions, csv_reader_options
    from fedgalore.tasks.generic.data import load_sources

    style, read_with = None, options
    try:
        if path.suffix.lower() in (".csv", ".tsv"):
            choice = csv_reader_options(path, options)
            style = CsvStyle(choice.delimiter, choice.encoding, choice.quotechar, _line_end(path, choice.encoding))
            if "delimiter" in choice.sniffed and _one_column(path, choice.encoding, choice.quotechar):
                # sniffed "," for a header no delimiter splits: read every line whole (a sentence keeps its commas)
                with open(path, encoding=choice.encoding, errors="replace") as fh:
                    text = fh.read()
                free = next((d for d in _ONE_COLUMN if d not in text and d != choice.quotechar), None)
                if free is not None:
                    read_with = CsvOptions(free, options.encoding if options is not None else None, choice.quotechar)
        raw = load_sources(str(path), csv_options=read_with)
    except TaskError as exc:
        raise ExportError(str(exc).replace("task.options.data: ", "--data: ").replace(
            "set task.options.csv: {delimiter, encoding, quotechar}", "pass --csv delimiter=X (or encoding=, quotechar=)")) from None
    if set(raw) != {"train"}:
        raise ExportError(f"--data {path} holds several splits ({', '.join(raw)}); give one file of rows")
    return raw["train"], style


def _image_folder(task: Task, path: Path) -> tuple[Any, None]:
    """The images of the folder ``path`` as rows (:func:`~fedgalore.tasks.generic.data.read_image_folder`:
    flat, or one sub-folder per class), the image column named as the task's ``image_column``."""
    from fedgalore.tasks.generic.data import Rows, read_image_folder

    column = getattr(getattr(task, "options", None), "image_column", None)
    if _kind(task) != "image" or column is None:
        raise ExportError(f"--data {path} is a folder; a folder of images is read for image_classification, and task "
                          f"{task.name!r} reads a file (.csv, .tsv, .json, .jsonl or .parquet)")
    try:
        rows = read_image_folder(path)
    except TaskError as exc:
        raise ExportError(f"--data {exc}") from None
    if column != "image":
        rows = Rows(rows.data.rename_column("image", column), rows.name, rows.folder, rows.index, rows.origins)
    return rows, None


def _one_column(path: Path, encoding: str, quotechar: str) -> bool:
    """Whether ``path``'s header line is one field under every candidate delimiter."""
    from fedgalore.tasks.generic.csvfiles import DELIMITERS

    with open(path, encoding=encoding, errors="replace", newline="") as fh:
        header = fh.readline(1 << 16).rstrip("\r\n")
    return all(len(next(csvlib.reader([header], delimiter=d, quotechar=quotechar), [])) <= 1 for d in DELIMITERS)


def _line_end(path: Path, encoding: str) -> str:
    """``"\r\n"`` when ``path``'s first line ends with a carriage return, else ``"\n"``."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    text = codecs.getincrementaldecoder(encoding)(errors="replace").decode(head)
    i = text.find("\n")
    return "\r\n" if i > 0 and text[i - 1] == "\r" else "\n"


def _kind(task: Task) -> str:
    from fedgalore.tasks.paper_text.base import TextClassificationTask

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
    """The input rows as a pandas table; an image cell (``{bytes, path}``) becomes its path; a
    column of whole numbers with empty cells (read as floats: ``7``, ``""`` → ``7.0``, NaN) is
    integer again (pandas' ``Int64``), so ``7`` is written back as ``7``."""
    table = rows.data.to_pandas()
    for c in table.columns:
        if len(table) and isinstance(table[c].iloc[0], dict) and "bytes" in table[c].iloc[0]:
            table[c] = [v.get("path") if isinstance(v, dict) else v for v in table[c]]
        col = table[c]
        if col.dtype.kind == "f" and col.isna().any() and col.notna().any():
            known = col[col.notna()].to_numpy()
            if np.all(np.isfinite(known)) and np.all(known == np.round(known)) and np.all(np.abs(known) < 2**53):
                table[c] = col.astype("Int64")
    return table


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as Python lists and numbers, NaN as None (JSON-ready)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _json_cells(table: Any) -> Any:
    """``table`` with every list or dict cell as its JSON text (what a CSV cell can hold and be read back from)."""
    for c in table.columns:
        if table[c].dtype == object and any(isinstance(v, (list, tuple, dict, np.ndarray)) for v in table[c]):
            table[c] = [json.dumps(_plain(v), ensure_ascii=False) if isinstance(v, (list, tuple, dict, np.ndarray)) else v
                        for v in table[c]]
    return table


def _write(table: Any, out: Path, style: CsvStyle | None = None) -> None:
    """``table`` as ``out``'s format, written beside it and renamed into place; a CSV in ``style``
    (the input's delimiter, encoding, quote character and line ends), else UTF-8, ``,`` and ``\n``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if out.suffix.lower() == ".csv":
            how = {} if style is None else {"sep": style.delimiter, "encoding": style.encoding,
                                            "quotechar": style.quotechar, "lineterminator": style.lineterminator}
            try:
                _json_cells(table).to_csv(tmp, index=False, **how)
            except UnicodeEncodeError as exc:
                bad = exc.object[exc.start:exc.end]
                raise ExportError(f"--out {out}: the predictions hold {bad!r}, which {style.encoding if style else 'utf-8'} "
                                  "(the input's encoding) cannot write; write --out as .jsonl, or save the input as "
                                  "UTF-8") from None
        else:
            table.to_json(tmp, orient="records", lines=True, force_ascii=False)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
