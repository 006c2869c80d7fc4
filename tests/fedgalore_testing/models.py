"""A finished run's global model and logits, and the generic tasks' inputs (QA rows, image folders)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedgalore.engine.loop import Federation
from fedgalore.job.config import FederatedConfig
from fedgalore.tasks import get_task
from fedgalore.trained.evaluate import LoadedModel


class Run:
    """A finished run and the engine's own global model: its logits on the whole test set."""

    def __init__(self, cfg: FederatedConfig, **kw) -> None:
        fed = Federation(cfg, **kw)
        self.summary = fed.run().summary
        self.dir, self.task, self.cfg = fed.run_dir, fed.task, fed.cfg
        fed.method.load_global(fed.runtime.model, fed.state)  # what Federation._evaluate does
        self.model = fed.runtime.model.eval()
        self.batch = batch_of(self.task)
        with torch.no_grad():
            self.logits = self.model(**self.batch).logits.float()


def batch_of(task, n: int = 64):
    ts = task.test_set()
    idx = list(range(min(n, len(ts))))
    return ts.batch(idx) if hasattr(ts, "batch") else task.collate([ts[i] for i in idx])


@torch.no_grad()
def logits_of(model, batch) -> torch.Tensor:
    return model.eval()(**batch).logits.float()


def same_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


QA = [{"question": f"What is {a} plus {b}?", "solution": f"{a} + {b} = {a + b}. The answer is {a + b}",
       "kind": "add" if i % 2 else "sum"} for i, (a, b) in enumerate([(1, 2), (2, 3), (3, 4), (4, 5), (5, 1), (2, 2), (3, 3), (1, 1)] * 2)]


def causal_task(llama_dir, data, **kw):
    opts = dict(model=str(llama_dir), data=str(data), prompt_column="question", response_column="solution", max_length=64,
                max_new_tokens=4)
    opts.update(kw)
    return get_task("causal_lm", **opts)


def _images(root: Path, per_class: int = 6, size: int = 12) -> Path:
    from PIL import Image

    g = np.random.default_rng(0)
    for c, color in zip(("cat", "dog", "owl"), ((220, 30, 30), (30, 200, 30), (30, 30, 220))):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            arr = np.clip(np.array(color)[None, None] + g.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / f"{c}{i}.png")
    return root


def _loaded(monkeypatch, task):
    """predict on ``task``'s freshly built model (no run needed for checking inputs and outputs)."""
    cfg = FederatedConfig.from_dict({"task": {"name": task.name}})
    loaded = LoadedModel(task.build_model(), task, cfg, "test model")
    monkeypatch.setattr("fedgalore.trained.predict.load_for_inference", lambda *a, **k: loaded)
    return loaded
