"""Text classification machinery: a pretrained encoder + a sequence-classification head (the base
of ``offline_text``, ``offline_text_amazon``, ``glue`` and the file-driven ``text_classification``).

:class:`TextClassificationTask` takes any Hugging Face ``AutoModelForSequenceClassification``
checkpoint (local folder or hub id) on single sentences or sentence pairs, classification
(cross-entropy) or regression (``num_labels=1``, MSE). Texts are tokenised ONCE at construction
(fixed padding to ``max_length``, optionally cached in :func:`fedgalore.tasks.assets.cache_dir`
as safetensors); batches are trimmed to their longest sequence (deterministic; padded positions
are masked, so results do not change). The head and any weight missing from the checkpoint are
re-initialised from a local ``torch.Generator`` (``N(0, initializer_range²)`` weights, zero
biases), so :meth:`~TextClassificationTask.build_model` returns identical weights on every call.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.assets import cache_dir
from fedgalore.tasks.base import ArrayDataset, Task, TaskError, TaskOptions, quiet_transformers, task_option
from fedgalore.tasks.fingerprint import fingerprint_files
from fedgalore.tasks.generic.architectures import init_fresh_weights, require_tokenizer_files
from fedgalore.tasks.metrics import accuracy, binary_f1, macro_f1, matthews_corrcoef, mse, pearson, spearman

__all__ = ["TextExamples", "TokenizedDataset", "TextClassificationTask", "TextOptions", "subset_indices", "fingerprint_files"]

_CACHE_FORMAT = 1  # bump when the cached tensor layout changes


@dataclass
class TextExamples:
    """Raw examples: ``text`` (and ``text_pair`` for sentence-pair tasks) with one label each
    (class ids ``0..K-1``, or floats for regression)."""

    text: list[str]
    labels: np.ndarray
    text_pair: list[str] | None = None

    def __post_init__(self) -> None:
        self.labels = np.asarray(self.labels)
        if len(self.text) != len(self.labels) or (self.text_pair is not None and len(self.text_pair) != len(self.text)):
            raise TaskError("text, text_pair and labels must have the same length")

    def subset(self, idx: Sequence[int]) -> "TextExamples":
        """The examples at ``idx`` (in that order)."""
        idx = [int(i) for i in idx]
        pair = [self.text_pair[i] for i in idx] if self.text_pair is not None else None
        return TextExamples([self.text[i] for i in idx], self.labels[idx], pair)


def _trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the trailing columns that are padding in every row (right padding)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[1] == 0:
        return batch
    length = int(mask.sum(1).max()) if mask.shape[0] else 0
    length = max(length, 1)
    return {k: (v[:, :length] if v.dim() == 2 and v.shape[1] == mask.shape[1] else v) for k, v in batch.items()}


class TokenizedDataset(ArrayDataset):
    """Pre-tokenised examples padded to ``max_length``; :meth:`batch` trims to the batch's longest row."""

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Stacked rows ``indices``, trimmed to the longest sequence among them."""
        return _trim(super().batch(indices))


@dataclass(frozen=True)
class TextOptions(TaskOptions):
    """Options every text classification task of the package takes (each task adds its own)."""

    max_length: int = task_option(128, "tokens per example (longer texts are truncated; >= 8)")
    seed: int = task_option(0, "seed of the data split and subsets and of the head initialisation")
    limit: int | None = task_option(None, "at most this many examples per split (a seeded subset); null: all")
    dropout: float | None = task_option(None, "encoder dropout probability; null: the checkpoint's")

    def __post_init__(self) -> None:
        if self.max_length < 8:
            raise TaskError(f"task.options.max_length={self.max_length} must be >= 8")
        if self.limit is not None and self.limit < 1:
            raise TaskError(f"task.options.limit={self.limit} must be a positive integer (or null for all examples)")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise TaskError(f"task.options.dropout={self.dropout} must be in [0, 1) (or null for the checkpoint's)")


def subset_indices(n: int, limit: int | None, seed: int) -> np.ndarray:
    """All of ``range(n)``, or ``limit`` of them drawn with a seeded permutation (kept in order)."""
    if limit is None or limit >= n:
        return np.arange(n)
    if limit < 1:
        raise TaskError(f"limit={limit} must be a positive integer (or null for all examples)")
    return np.sort(np.random.default_rng(seed).permutation(n)[:limit])




class TextClassificationTask(Task):
    """Sequence classification / regression with a pretrained Hugging Face encoder.

    Args:
        model: local folder or hub id of an ``AutoModelForSequenceClassification`` checkpoint
            (and its tokenizer).
        data: ``(train, test)`` :class:`TextExamples`, or a zero-argument callable returning
            them (called only when the tokenised tensors are not cached).
        label_names: class names, index = class id (regression: the names of the partition bins).
        max_length: tokens per example (truncation; padding to it, trimmed per batch).
        seed: seed of the head initialisation.
        regression: ``num_labels=1`` with MSE loss; labels are floats.
        metrics: metric names reported by :meth:`evaluate` (besides ``loss``), from
            ``accuracy, macro_f1, f1, mcc, mse, pearson, spearman``.
        primary_metric / higher_is_better: the metric reported in tables.
        positive_label: class id whose F1 is ``f1`` (binary tasks).
        partition_bins: regression only — bin edges for the Dirichlet partition column.
        cache_key: when given, tokenised tensors are cached in ``cache_dir()/text/`` under a hash
            of (cache_key, tokenizer files, max_length).
        dropout: override the encoder's dropout probabilities (None: keep the checkpoint's).
    """

    #: a base class, not registered: the registry's ``text_classification`` is
    #: :class:`fedgalore.tasks.generic.text.GenericTextClassificationTask` (data from files)
    name = "text_classification_base"
    target_modules = ("query", "value", "dense")
    head_modules = ("classifier",)
    peft_task_type = "SEQ_CLS"

    def __init__(
        self,
        model: str | os.PathLike,
        data: tuple[TextExamples, TextExamples] | Callable[[], tuple[TextExamples, TextExamples]],
        label_names: Sequence[str],
        *,
        max_length: int = 128,
        seed: int = 0,
        regression: bool = False,
        metrics: Sequence[str] = ("accuracy", "macro_f1"),
        primary_metric: str | None = None,
        higher_is_better: bool | None = None,
        positive_label: int = 1,
        partition_bins: Sequence[float] | None = None,
        cache_key: str | None = None,
        dropout: float | None = None,
    ) -> None:
        if int(max_length) < 8:
            raise TaskError(f"max_length={max_length} must be >= 8")
        unknown = sorted(set(metrics) - set(_METRICS))
        if unknown:
            raise TaskError(f"unknown metric {unknown[0]!r}; available: {', '.join(sorted(_METRICS))}")
        self.model_id = str(model)
        self.max_length, self.seed, self.regression = int(max_length), int(seed), bool(regression)
        self.metric_names = tuple(metrics)
        self.primary_metric = primary_metric or self.metric_names[0]
        if self.primary_metric not in self.metric_names:
            raise TaskError(f"primary_metric={self.primary_metric!r} must be one of {list(self.metric_names)}")
        self.higher_is_better = (self.primary_metric != "mse") if higher_is_better is None else bool(higher_is_better)
        self.positive_label = int(positive_label)
        self.partition_bins = None if partition_bins is None else np.asarray(partition_bins, dtype=np.float64)
        self.dropout = dropout
        self._label_names = [str(n) for n in label_names]
        self.num_labels = 1 if self.regression else len(self._label_names)
        if not self.regression and self.num_labels < 2:
            raise TaskError("a classification task needs at least 2 label names")
        self._train, self._test = self._prepare(data, cache_key)

    # ------------------------------------------------------------------ data
    def processor(self):
        """The checkpoint's tokenizer (saved with an export)."""
        return self.tokenizer()

    def tokenizer(self):
        """The checkpoint's tokenizer (loaded on demand)."""
        from transformers import AutoTokenizer

        require_tokenizer_files(self.model_id)
        try:
            with quiet_transformers():  # the new head is re-initialised on purpose
                return AutoTokenizer.from_pretrained(self.model_id)
        except (OSError, ValueError) as exc:
            raise TaskError(
                f"could not load the tokenizer of {self.model_id!r} ({str(exc).splitlines()[0][:160]}); "
                "pass a local model folder, or allow hub access (unset HF_HUB_OFFLINE)"
            ) from None

    def _tokenizer_fingerprint(self) -> str:
        p = Path(self.model_id)
        if p.is_dir():
            files = [f for f in sorted(p.iterdir()) if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))]
            h = hashlib.sha256()
            for f in files:
                h.update(f.name.encode() + f.read_bytes())
            return h.hexdigest()[:16]
        return self.model_id  # hub id: the name is the identity

    def _tokenize(self, ex: TextExamples, tok) -> TokenizedDataset:
        cols: dict[str, list[torch.Tensor]] = {}
        for start in range(0, len(ex.text), 512):
            a = ex.text[start : start + 512]
            b = ex.text_pair[start : start + 512] if ex.text_pair is not None else None
            enc = tok(a, b, truncation=True, max_length=self.max_length, padding="max_length", return_tensors="pt")
            for k in ("input_ids", "attention_mask", "token_type_ids"):
                if k in enc:
                    cols.setdefault(k, []).append(enc[k].to(torch.long))
        if not ex.text:
            cols = {"input_ids": [torch.zeros(0, self.max_length, dtype=torch.long)], "attention_mask": [torch.zeros(0, self.max_length, dtype=torch.long)]}
        out = {k: torch.cat(v) for k, v in cols.items()}
        dtype = torch.float32 if self.regression else torch.long
        out["labels"] = torch.as_tensor(np.asarray(ex.labels), dtype=dtype)
        return TokenizedDataset(out)

    def _prepare(self, data, cache_key: str | None) -> tuple[TokenizedDataset, TokenizedDataset]:
        path = None
        if cache_key is not None:
            key = json.dumps([_CACHE_FORMAT, cache_key, self._tokenizer_fingerprint(), self.max_length, self.regression])
            path = cache_dir() / "text" / f"{self.name}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"
            if path.is_file():
                from safetensors.torch import load_file

                try:
                    flat = load_file(str(path))
                    return self._unflatten(flat, "train"), self._unflatten(flat, "test")
                except Exception:  # noqa: BLE001 - a corrupt cache file is rebuilt
                    pass
        train, test = data() if callable(data) else data
        tok = self.tokenizer()
        sets = self._tokenize(train, tok), self._tokenize(test, tok)
        if path is not None:
            from safetensors.torch import save_file

            path.parent.mkdir(parents=True, exist_ok=True)
            flat = {f"{split}.{k}": v.contiguous() for split, ds in zip(("train", "test"), sets) for k, v in ds.columns.items()}
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            save_file(flat, str(tmp), metadata={"key": cache_key, "model": self.model_id, "max_length": str(self.max_length)})
            os.replace(tmp, path)
        return sets

    @staticmethod
    def _unflatten(flat: dict[str, torch.Tensor], split: str) -> TokenizedDataset:
        cols = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(split + ".")}
        if "labels" not in cols:
            raise TaskError(f"cached tensors lack {split}.labels")
        return TokenizedDataset(cols)

    def train_set(self) -> TokenizedDataset:
        return self._train

    def test_set(self) -> TokenizedDataset:
        return self._test

    def partition_labels(self) -> np.ndarray:
        """Class ids of the training examples (regression: the bin index of the score)."""
        y = self._train.columns["labels"].numpy()
        if self.regression:
            bins = self.partition_bins if self.partition_bins is not None else np.quantile(y, [0.2, 0.4, 0.6, 0.8])
            return np.digitize(y, bins).astype(np.int64)
        return y.astype(np.int64)

    def label_names(self) -> list[str]:
        return list(self._label_names)

    def collate(self, examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return _trim({k: torch.stack([e[k] for e in examples]) for k in examples[0]})

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        """The pretrained encoder with a freshly, deterministically initialised head (eval mode)."""
        from transformers import AutoModelForSequenceClassification

        kwargs: dict[str, Any] = {"num_labels": self.num_labels}
        if self.regression:
            kwargs["problem_type"] = "regression"
        else:
            kwargs["problem_type"] = "single_label_classification"
            kwargs["id2label"] = dict(enumerate(self._label_names))
            kwargs["label2id"] = {n: i for i, n in enumerate(self._label_names)}
        if self.dropout is not None:
            kwargs.update(hidden_dropout_prob=float(self.dropout), attention_probs_dropout_prob=float(self.dropout))
        try:
            with quiet_transformers():  # the new head is re-initialised on purpose
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    self.model_id, output_loading_info=True, ignore_mismatched_sizes=True, dtype=torch.float32, **kwargs
                )
        except (OSError, ValueError) as exc:
            raise TaskError(
                f"could not load model {self.model_id!r} ({str(exc).splitlines()[0][:160]}); "
                "pass a local model folder, or allow hub access (unset HF_HUB_OFFLINE)"
            ) from None
        fresh = set(info.get("missing_keys", ()))
        fresh |= {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())}
        self._init_new_weights(model, fresh)
        model.eval()
        return model

    def _init_new_weights(self, model: nn.Module, missing: set[str]) -> None:
        """Seeded fresh weights (:func:`~fedgalore.tasks.generic.architectures.init_fresh_weights`)
        for the ``missing`` parameters and the whole head."""
        heads = tuple(self.head_modules)
        init_fresh_weights(model, lambda name: name in missing or any(name == h or name.startswith(h + ".") for h in heads), 10_007 + self.seed)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy (classification) or MSE (regression), as computed by the HF model."""
        return model(**batch).loss

    @torch.no_grad()
    def predict(self, model: nn.Module, examples: Sequence[Any], batch_size: int) -> tuple[np.ndarray, float]:
        """Predictions (class ids, or scores for regression) and the mean loss over ``examples``."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        preds: list[np.ndarray] = []
        total, n = 0.0, len(examples)
        for start in range(0, n, batch_size):
            idx = list(range(start, min(start + batch_size, n)))
            batch = examples.batch(idx) if hasattr(examples, "batch") else self.collate([examples[i] for i in idx])
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            total += float(out.loss) * len(idx)
            logits = out.logits.float()
            preds.append((logits[:, 0] if self.regression else logits.argmax(-1)).cpu().numpy())
        model.train(was_training)
        return (np.concatenate(preds) if preds else np.zeros(0)), (total / n if n else float("nan"))

    def evaluate(self, model: nn.Module, examples: Sequence[Any], batch_size: int) -> dict[str, float]:
        """The task's metrics and the mean ``loss`` of ``model`` on ``examples``."""
        if len(examples) == 0:
            raise TaskError("cannot evaluate on an empty set")
        pred, loss = self.predict(model, examples, batch_size)
        gold = examples.columns["labels"].numpy() if hasattr(examples, "columns") else np.array([float(e["labels"]) for e in examples])
        out = {m: _METRICS[m](pred, gold, self.positive_label) for m in self.metric_names}
        out["loss"] = loss
        return out

    def example_outputs(self, model: nn.Module, examples: Sequence[Any], batch_size: int) -> dict[str, np.ndarray]:
        """Per-example logits, predictions and losses in one pass, longest rows first
        (:func:`fedgalore.tasks.grouped.classifier_outputs`)."""
        from fedgalore.tasks.grouped import classifier_outputs

        return classifier_outputs(model, examples, batch_size, regression=self.regression, collate=self.collate)

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics of the examples whose records ``outputs`` holds."""
        from fedgalore.tasks.grouped import accuracy_of, macro_f1_of

        fast = {"accuracy": lambda p, y, pos: accuracy_of(p, y), "macro_f1": lambda p, y, pos: macro_f1_of(p, y)}
        out = {m: fast.get(m, _METRICS[m])(outputs["pred"], outputs["gold"], self.positive_label) for m in self.metric_names}
        out["loss"] = float(np.mean(outputs["loss"]))
        return out

    def encode_texts(self, text: Sequence[str], text_pair: Sequence[str] | None = None) -> TokenizedDataset:
        """Model inputs of raw texts (sentence pairs with ``text_pair``), tokenised as the task's own
        (``max_length``, padding trimmed per batch), with placeholder labels: what ``fedgalore
        predict`` feeds the model."""
        labels = np.zeros(len(text), dtype=np.float32 if self.regression else np.int64)
        ex = TextExamples([str(t) for t in text], labels, [str(t) for t in text_pair] if text_pair is not None else None)
        return self._tokenize(ex, self.tokenizer())

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(model=self.model_id, max_length=self.max_length, seed=self.seed, regression=self.regression, metrics=list(self.metric_names))
        return d


_METRICS: dict[str, Callable[[np.ndarray, np.ndarray, int], float]] = {
    "accuracy": lambda p, y, pos: accuracy(p, y),
    "macro_f1": lambda p, y, pos: macro_f1(p, y),
    "f1": lambda p, y, pos: binary_f1(p, y, positive=pos),
    "mcc": lambda p, y, pos: matthews_corrcoef(p, y),
    "mse": lambda p, y, pos: mse(p, y),
    "pearson": lambda p, y, pos: pearson(p, y),
    "spearman": lambda p, y, pos: spearman(p, y),
}
