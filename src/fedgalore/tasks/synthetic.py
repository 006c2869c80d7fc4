"""``tiny_text``: a tiny random-weight BERT classifier on synthetic token data.

For tests and smoke runs: the real architecture class (``BertForSequenceClassification``, with
``query``/``value``/``dense`` linear layers and a ``classifier`` head) at a few hundred thousand
parameters, on a learnable synthetic task (the label is the class whose marker tokens occur most
often in the sequence). Everything is drawn from local generators, so every call builds the same
model and data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import ArrayDataset, Task, TaskError, TaskOptions, task_option
from fedgalore.tasks.metrics import accuracy, macro_f1


@dataclass(frozen=True)
class TinyTextOptions(TaskOptions):
    """Options of ``tiny_text`` (sizes of the synthetic data and of the random-weight BERT)."""

    num_classes: int = task_option(4, "number of classes (each has its own marker tokens)")
    n_train: int = task_option(320, "training examples")
    n_test: int = task_option(128, "test examples")
    seq_len: int = task_option(16, "tokens per example")
    vocab_size: int = task_option(64, "vocabulary size (>= 4 + 3 * num_classes + 1)")
    hidden_size: int = task_option(32, "hidden size of the random BERT")
    num_layers: int = task_option(2, "encoder layers of the random BERT")
    seed: int = task_option(0, "seed of the data and of the model's random weights")

    def __post_init__(self) -> None:
        for key in ("num_classes", "n_train", "n_test", "seq_len", "hidden_size", "num_layers"):
            if getattr(self, key) < 1:
                raise TaskError(f"task.options.{key}={getattr(self, key)} must be >= 1")
        if self.vocab_size <= 4 + 3 * self.num_classes:
            raise TaskError(f"task.options.vocab_size={self.vocab_size} must exceed 4 + 3 * num_classes = {4 + 3 * self.num_classes}")


class TinyTextTask(Task):
    name = "tiny_text"
    options_class = TinyTextOptions
    primary_metric = "accuracy"
    target_modules = ("query", "value", "dense")
    head_modules = ("classifier",)
    peft_task_type = "SEQ_CLS"

    def __init__(
        self,
        num_classes: int = 4,
        n_train: int = 320,
        n_test: int = 128,
        seq_len: int = 16,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_layers: int = 2,
        seed: int = 0,
    ) -> None:
        self.num_classes, self.seq_len, self.vocab_size = num_classes, seq_len, vocab_size
        self.hidden_size, self.num_layers, self.seed = hidden_size, num_layers, seed
        g = torch.Generator().manual_seed(seed)
        self._train = self._make(n_train, g)
        self._test = self._make(n_test, g)

    def _make(self, n: int, g: torch.Generator) -> ArrayDataset:
        # marker tokens of class c: 4 + c*3 + {0,1,2}; the rest is filler noise
        labels = torch.randint(self.num_classes, (n,), generator=g)
        ids = torch.randint(4 + 3 * self.num_classes, self.vocab_size, (n, self.seq_len), generator=g)
        for i in range(n):
            k = int(torch.randint(3, 6, (1,), generator=g))
            pos = torch.randperm(self.seq_len - 1, generator=g)[:k] + 1
            ids[i, pos] = 4 + 3 * int(labels[i]) + torch.randint(3, (k,), generator=g)
        ids[:, 0] = 2  # [CLS]-like
        return ArrayDataset({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})

    def build_model(self) -> nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=2,
            intermediate_size=2 * self.hidden_size,
            max_position_embeddings=max(64, self.seq_len),
            num_labels=self.num_classes,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = BertForSequenceClassification(cfg)
        g = torch.Generator().manual_seed(1000 + self.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm" in name and name.endswith("weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        model.eval()
        return model

    def train_set(self) -> ArrayDataset:
        return self._train

    def test_set(self) -> ArrayDataset:
        return self._test

    def partition_labels(self) -> np.ndarray:
        return self._train.columns["labels"].numpy()

    def collate(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: Sequence, batch_size: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        preds, gold, losses = [], [], []
        ds = examples
        device = next(model.parameters()).device
        for start in range(0, len(ds), batch_size):
            idx = list(range(start, min(start + batch_size, len(ds))))
            batch = {k: v.to(device) for k, v in ds.batch(idx).items()}
            out = model(**batch)
            losses.append(float(out.loss) * len(idx))
            preds.append(out.logits.argmax(-1).cpu().numpy())
            gold.append(batch["labels"].cpu().numpy())
        model.train(was_training)
        p, y = np.concatenate(preds), np.concatenate(gold)
        return {"accuracy": accuracy(p, y), "macro_f1": macro_f1(p, y), "loss": sum(losses) / len(ds)}

    def example_outputs(self, model: nn.Module, examples: Sequence, batch_size: int) -> dict[str, np.ndarray]:
        """Per-example predictions and losses in one pass (:func:`fedgalore.tasks.grouped.classifier_outputs`)."""
        from fedgalore.tasks.grouped import classifier_outputs

        return classifier_outputs(model, examples, batch_size, collate=self.collate)

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics of the examples whose records ``outputs`` holds."""
        from fedgalore.tasks.grouped import accuracy_of, macro_f1_of

        p, y = outputs["pred"], outputs["gold"]
        return {"accuracy": accuracy_of(p, y), "macro_f1": macro_f1_of(p, y), "loss": float(np.mean(outputs["loss"]))}
