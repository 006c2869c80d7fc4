"""``offline_text_amazon``: MiniLM-L6 on Amazon Fine Food reviews (great / other) from the Debian
package ``r-cran-modeldata`` (read without R)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedgalore.tasks.assets import debian_root, minilm_path, read_r_lazyload
from fedgalore.tasks.base import TaskError, TaskOptions
from fedgalore.tasks.paper_text.base import TextClassificationTask, TextExamples, fingerprint_files, subset_indices
from fedgalore.tasks.paper_text.bbc import OfflineTextOptions

__all__ = ["OfflineAmazonReviewsTask", "load_amazon_reviews", "AMAZON_PACKAGE"]


AMAZON_PACKAGE = "r-cran-modeldata"


def _data_dir() -> Path:
    """The package's R data folder (``Rdata.rdb``/``.rdx``/``.rds``: the reviews' lazy-load database)."""
    return debian_root(AMAZON_PACKAGE) / "usr/lib/R/site-library/modeldata/data"


def load_amazon_reviews() -> tuple[Any, Any]:
    """The Amazon Fine Food reviews (``training_data``: 4,000, ``testing_data``: 1,000 rows;
    columns ``product``, ``review``, ``score`` ∈ {great, other}) as pandas DataFrames."""
    db = _data_dir() / "Rdata"
    return read_r_lazyload(db, "training_data"), read_r_lazyload(db, "testing_data")


class OfflineAmazonReviewsTask(TextClassificationTask):
    """``offline_text_amazon``: MiniLM-L6 on Amazon Fine Food reviews, binary (great / other).

    Data: the package's own 4,000 / 1,000 train/test split (Debian ``r-cran-modeldata``, read
    without R). Label ids are the sorted names (great = 0, other = 1); ``f1`` is the F1 of
    ``great`` (the first factor level, the "event" in the package's convention). Metrics:
    accuracy (primary), macro-F1, F1. ``limit`` caps each split (a seeded subset).
    """

    name = "offline_text_amazon"
    options_class = OfflineTextOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The packaged MiniLM folder (unless ``model_path`` is given) and the reviews' R data folder."""
        return {**OfflineTextOptions.minilm_unless(getattr(options, "model_path", None)), "data": _data_dir()}

    def __init__(
        self,
        max_length: int = 128,
        seed: int = 0,
        limit: int | None = None,
        model_path: str | None = None,
        dropout: float | None = None,
    ) -> None:
        self.limit = limit
        model = model_path or str(minilm_path())
        data_fp = fingerprint_files(sorted(_data_dir().glob("Rdata.*")))
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
                return TextExamples(texts, labels).subset(subset_indices(len(texts), limit, s))

            return ex(train_df, seed), ex(test_df, seed + 1)

        super().__init__(
            model, load, names, max_length=max_length, seed=seed, metrics=("accuracy", "macro_f1", "f1"),
            positive_label=0, cache_key=key, dropout=dropout,
        )
