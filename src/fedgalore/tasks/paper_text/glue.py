"""``glue``: the paper's hub path — RoBERTa-base on GLUE (CoLA, SST-2, MRPC, QQP, MNLI-matched,
QNLI, RTE, STS-B, WNLI) from the hub or local files."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedgalore.tasks.base import TaskError, task_option
from fedgalore.tasks.paper_text.base import TextClassificationTask, TextExamples, TextOptions, fingerprint_files, subset_indices

__all__ = ["GlueTask", "GlueOptions", "GLUE_SUBTASKS"]


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


def _subtask(name: str) -> str:
    """The canonical GLUE subtask name of ``name`` (aliases such as ``sst-2``; TaskError if unknown)."""
    sub = _GLUE_ALIASES.get(str(name).lower(), str(name).lower())
    if sub not in GLUE_SUBTASKS:
        raise TaskError(f"unknown GLUE subtask {name!r}; available: {', '.join(GLUE_SUBTASKS)}")
    return sub


@dataclass(frozen=True)
class GlueOptions(TextOptions):
    """Options of ``glue`` (a hub encoder on one GLUE subtask)."""

    subtask: str = task_option("sst2", f"GLUE subtask: {', '.join(GLUE_SUBTASKS)} (or sst-2, sts-b, mnli-m)")
    model: str = task_option("roberta-base", "hub id or local folder of the encoder checkpoint (with its tokenizer)")
    data_dir: str | None = task_option(None, "local folder with train.* and validation.* (or dev.*) files; null: the hub")
    primary_metric: str | None = task_option(None, "metric reported in tables (e.g. mcc for CoLA); null: the subtask's first")
    cache: bool = task_option(True, "cache the tokenised tensors in the fedgalore cache folder")

    def __post_init__(self) -> None:
        super().__post_init__()
        metrics = GLUE_SUBTASKS[_subtask(self.subtask)].metrics
        if self.primary_metric is not None and self.primary_metric not in metrics:
            raise TaskError(f"task.options.primary_metric={self.primary_metric!r} must be one of {list(metrics)} for GLUE/{self.subtask}")


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
    options_class = GlueOptions

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
        sub = _subtask(subtask)
        self.subtask, self.data_dir, self.limit = sub, data_dir, limit
        spec = GLUE_SUBTASKS[sub]
        regression = not spec.label_names
        if data_dir is not None:
            d = Path(data_dir).expanduser()
            if not d.is_dir():
                raise TaskError(f"GLUE data_dir {str(d)!r} is not a folder")
            vnames = [spec.validation, "validation", "dev_matched" if sub == "mnli" else "dev", "dev"]
            files = [_find_split_file(d, ["train"]), _find_split_file(d, vnames)]
            source = {"files": [str(f.resolve()) for f in files], "fp": fingerprint_files(files)}
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
        idx = idx[subset_indices(len(idx), self.limit, seed)]
        text = [str(cols[spec.text][i]) for i in idx]
        pair = [str(cols[spec.text_pair][i]) for i in idx] if spec.text_pair else None
        return TextExamples(text, labels[idx], pair)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(subtask=self.subtask, data_dir=self.data_dir)
        return d
