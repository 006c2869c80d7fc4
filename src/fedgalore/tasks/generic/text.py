"""``text_classification``: any ``AutoModelForSequenceClassification`` checkpoint on your files.

A front end over :class:`~fedgalore.tasks.paper_text.base.TextClassificationTask` (its
tokenisation, cache, loss and metrics): the options name the model, the data and the columns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import TaskError, task_option
from fedgalore.tasks.generic.architectures import (classifier_head_modules, load_config, load_with_head, pick_target_modules,
                                                   require_tokenizer_files, skeleton)
from fedgalore.tasks.generic.common import FileTask, FileTaskOptions
from fedgalore.tasks.generic.data import LabelSet, Rows
from fedgalore.tasks.quantize import check_quantization, prepare_quantized, quantized_load_kwargs
from fedgalore.tasks.paper_text.base import TextClassificationTask, TextExamples, TokenizedDataset
from fedgalore.typed import to_plain

__all__ = ["TextClassificationOptions", "GenericTextClassificationTask", "decide_regression"]

_FLOAT_TYPES = ("float16", "float32", "float64", "double", "float")


@dataclass(frozen=True)
class TextClassificationOptions(FileTaskOptions):
    """Options of ``text_classification`` (docs/data.md)."""

    model: str | None = task_option(
        None, "local folder or hub id of an AutoModelForSequenceClassification checkpoint (encoder or decoder) "
              "with its tokenizer; null: the offline MiniLM-L6")
    text_column: str = task_option("text", "column holding the text")
    text_columns: tuple[str, ...] | None = task_option(None, "two columns of a sentence pair, [first, second] (instead of text_column)")
    label_column: str = task_option("label", "column holding the label: strings, integers or whole-number floats (classes), "
                                             "numbers with a fractional part (regression)")
    labels: tuple[str, ...] | None = task_option(
        None, "the classes in id order (null: the training rows' distinct labels, sorted); needed when the server "
              "never sees a row (Flower with site-local data) or a site may lack a class")
    max_length: int = task_option(128, "tokens per example (longer texts are truncated)")
    regression: bool | None = task_option(None, "null: labels with a fractional part (0.25) are regression (MSE), whole "
                                                "numbers (3 or 3.0) classes; true / false: say so")
    new_head: bool | None = task_option(
        None, "null: create a head when the checkpoint has none, keep one whose labels are the data's; "
              "true: a fresh seeded head; false: keep the checkpoint's head of the right size")
    cache: bool = task_option(True, "cache the tokenised sets in the fedgalore cache folder")
    quantization: str | None = task_option(
        None, "4bit | 8bit: the frozen base's linear layers quantised by bitsandbytes (CUDA; FedIT, FFA-LoRA, LoRA-FAIR); null: none")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quantization(self.quantization)
        if self.text_columns is not None and len(self.text_columns) not in (1, 2):
            raise TaskError(f"task.options.text_columns={list(self.text_columns)} must name 1 or 2 columns (a sentence pair)")
        if self.max_length < 8:
            raise TaskError(f"task.options.max_length={self.max_length} must be >= 8")


def _is_float_column(rows: Rows, column: str) -> bool:
    feature = rows.data.features.get(column)
    return getattr(feature, "dtype", None) in _FLOAT_TYPES


def _fraction_example(rows: Rows, column: str) -> float | None:
    """A label of a float column with a fractional part (the first), or None when every label is a
    whole number (``0.0``, ``3.0``: classes stored as floats, e.g. by a spreadsheet or by pandas
    around an empty cell)."""
    for v in rows.data[column]:
        if v is not None and not float(v).is_integer():
            return float(v)
    return None


def decide_regression(rows: Rows, column: str, given: bool | None) -> tuple[bool, str | None]:
    """``(regression?, the line to say once or None)`` for label column ``column`` of the training
    rows: ``given`` (``task.options.regression``) when set; else regression only when a float
    column holds a number with a fractional part — a float column of whole numbers is classes."""
    if given is not None or not _is_float_column(rows, column):
        return bool(given), None
    frac = _fraction_example(rows, column)
    if frac is not None:
        return True, (f"text_classification: column {column!r} holds numbers with a fractional part (e.g. {frac:g}): "
                      "regression (one output, MSE; metrics mse, pearson, spearman); set task.options.regression: false "
                      "to treat its values as classes")
    names = sorted({int(v) for v in rows.data[column] if v is not None})
    shown = ", ".join(map(str, names[:8])) + (", ..." if len(names) > 8 else "")
    example = f"{float(names[-1]):.1f}" if names else "3.0"  # one of the column's own values, as it was written
    return False, (f"text_classification: column {column!r} holds whole numbers stored as floats ({example}): {len(names)} "
                   f"classes ({shown}); set task.options.regression: true for regression")


def _scores(rows: Rows, column: str) -> np.ndarray:
    values = rows.column(column, "label_column")
    try:
        return np.asarray([float(v) for v in values], dtype=np.float32)
    except (TypeError, ValueError):
        bad = next(i for i, v in enumerate(values) if not isinstance(v, (int, float)))
        raise TaskError(f"{rows.name}: regression needs numbers in column {column!r}, row {rows.row(bad)} holds {values[bad]!r}; "
                        "set task.options.regression: false for classes") from None


class GenericTextClassificationTask(FileTask, TextClassificationTask):
    """``text_classification``: sequence classification or regression on a text column (or a
    sentence pair) and a label column of your files (docs/data.md).

    Classes are fixed by the training rows (:class:`~fedgalore.tasks.generic.data.LabelSet`:
    sorted strings, sorted integers, or a ``ClassLabel``'s names) and written into the model's
    ``config.id2label`` / ``label2id``; a test or validation label the training rows lack is an
    error. A float label column is regression: ``num_labels = 1``, MSE loss, metrics ``mse``
    (primary, lower is better), ``pearson``, ``spearman``; its partition categories are the
    score quintiles of the training rows. Classification reports ``accuracy`` (primary) and
    ``macro_f1``. Target modules and head: :mod:`fedgalore.tasks.generic.architectures`.
    """

    name = "text_classification"
    options_class = TextClassificationOptions

    def __init__(self, options: TextClassificationOptions | None = None, /, **fields: Any) -> None:
        from transformers import AutoModelForSequenceClassification

        self.options = opts = options if options is not None else TextClassificationOptions(**fields)
        self.model_id = model = self._model_to_load(opts)  # an adapter folder's base (self.adapter)
        config = load_config(model)
        require_tokenizer_files(model)
        text_option = "text_columns" if opts.text_columns else "text_column"
        self.text_columns = tuple(opts.text_columns or (opts.text_column,))
        label = opts.label_column
        required = [(c, text_option, "text") for c in self.text_columns] + [(label, "label_column", "label")]
        raw = self._read_rows(opts, required)
        regression, said = decide_regression(raw["train"], label, opts.regression)
        if said:
            self._say_once("regression", "%s", said)
        if self.no_train and regression:
            raise TaskError("regression needs training rows on the server (a nodes deployment supports classes only)")
        self._require_labels_without_rows(opts)
        self._rows = self._split_rows(opts, raw, None if regression else label)
        train = self._rows["train"]
        if regression:
            targets = {split: _scores(rows, label) for split, rows in self._rows.items()}
            edges = np.unique(np.quantile(targets["train"], [0.2, 0.4, 0.6, 0.8]))
            bounds = [float(targets["train"].min())] + edges.tolist() + [float(targets["train"].max())]
            names = [f"[{lo:.4g},{hi:.4g})" for lo, hi in zip(bounds[:-1], bounds[1:])]
            self.label_set = None
        else:
            self.label_set = LabelSet.given(opts.labels) if opts.labels else LabelSet.from_rows(train, label)
            if len(self.label_set.names) < 2:
                raise TaskError(f"{train.name}: column {label!r} holds one label ({self.label_set.names[0]!r}); "
                                "a classifier needs at least 2 (or set task.options.regression: true)")
            targets = {split: self.label_set.encode(rows, label, train.name) for split, rows in self._rows.items()}
            names, edges = list(self.label_set.names), None
        self._targets = targets
        self._checkpoint_labels = [str(config.id2label[i]) for i in sorted(config.id2label)] if config.id2label else None
        config.num_labels = 1 if regression else len(names)
        skel = skeleton(AutoModelForSequenceClassification, config)
        self.head_modules = classifier_head_modules(skel)
        self.target_modules = pick_target_modules(skel, config.model_type, self._adapter_targets(opts), exclude=self.head_modules)
        self.model_type = config.model_type
        self._pad_token_id = None
        if getattr(config, "pad_token_id", None) is None:  # decoders: pad with the end-of-sequence token
            self._pad_token_id = self.tokenizer().pad_token_id
        key = None
        if opts.cache:
            key = json.dumps({"data": self._data_fingerprint, "splits": {s: r.name for s, r in sorted(self._rows.items())},
                              "text": list(self.text_columns), "label": label, "labels": opts.labels, "test_fraction": opts.test_fraction,
                              "seed": opts.seed, "limit": opts.limit, "data_config": opts.data_config,
                              # how the files were read (only when set: the keys of caches made before these options stay)
                              **({"csv": to_plain(opts.csv)} if opts.csv else {}), **({"drop_empty": True} if opts.drop_empty else {})})
        super().__init__(model, lambda: (self._examples("train"), self._examples("test")), names, max_length=opts.max_length,
                         seed=opts.seed, regression=regression,
                         metrics=("mse", "pearson", "spearman") if regression else ("accuracy", "macro_f1"),
                         partition_bins=edges, cache_key=key)
        self._validation: TokenizedDataset | None = None

    @staticmethod
    def default_model() -> Path:
        """The offline MiniLM-L6 folder (:func:`fedgalore.tasks.assets.minilm_path`)."""
        from fedgalore.tasks.assets import minilm_path

        return minilm_path()

    # ------------------------------------------------------------------ data
    def _examples(self, split: str) -> TextExamples:
        rows = self._rows[split]
        texts = [[str(v) for v in rows.data[c]] for c in self.text_columns]
        return TextExamples(texts[0], self._targets[split], texts[1] if len(texts) > 1 else None)

    def tokenizer(self):
        """The checkpoint's tokenizer; one without a padding token pads with its end-of-sequence
        token (decoder checkpoints)."""
        tok = super().tokenizer()
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise TaskError(f"the tokenizer of {self.model_id!r} has neither a padding nor an end-of-sequence token; "
                                "add a pad_token to it (tokenizer.add_special_tokens) and save it")
            tok.pad_token = tok.eos_token
        return tok

    def validation_set(self) -> TokenizedDataset | None:
        """The ``validation`` split's tokenised examples (tokenised on first use, not cached)."""
        if "validation" not in self._rows:
            return None
        if self._validation is None:
            self._validation = self._tokenize(self._examples("validation"), self.tokenizer())
        return self._validation

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        """The checkpoint with its head (kept, or created seeded:
        :func:`~fedgalore.tasks.generic.architectures.load_with_head`) and ``id2label`` set."""
        from transformers import AutoModelForSequenceClassification

        kwargs: dict[str, Any] = {"dtype": torch.float32,
                                  "problem_type": "regression" if self.regression else "single_label_classification"}
        if self._pad_token_id is not None:
            kwargs["pad_token_id"] = self._pad_token_id
        kwargs.update(quantized_load_kwargs(self.options.quantization, torch.float32, self.head_modules))
        labels = [self.options.label_column] if self.regression else self.label_names()
        model, created = load_with_head(AutoModelForSequenceClassification, self.model_id, labels,
                                        head_modules=self.head_modules, checkpoint_labels=self._checkpoint_labels,
                                        new_head=self.options.new_head, seed=10_007 + self.seed, **kwargs)
        if created and not self._adapter_has_head():
            self._say_once("head", "text_classification: %s gets a new head with %d output(s) (%s; seeded by task.options.seed=%d)",
                           self.model_id, len(labels), ", ".join(self.head_modules), self.seed)
        return self._apply_adapter(prepare_quantized(model, self.options.quantization))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(self.data_description(), text_columns=list(self.text_columns), label_column=self.options.label_column,
                 label_kind="regression" if self.regression else self.label_set.kind, model_type=self.model_type,
                 target_modules=list(self.target_modules), head_modules=list(self.head_modules),
                 options=to_plain(self.options))
        return d
