"""The shared causal LM task: response-only loss, batched greedy generation, exact match.

Training loss: the causal LM loss on the response tokens only,

    L = − (1/|R|) Σ_{t ∈ R} log p(x_t | x_<t),

where R are the response positions (prompt and padding carry label −100). Adapted matrices:
``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``; nothing else is trained
(``head_modules = ()``; ``lm_head`` stays frozen).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import Task, TaskError
from fedgalore.tasks.paper_math.data import PromptDataset, pad_batch, pad_id
from fedgalore.tasks.paper_math.grading import answers_match, extract_answer

__all__ = ["CausalLMTask", "LLAMA_TARGET_MODULES", "torch_dtype"]

#: the Llama-family linear layers every method adapts (attention + MLP)
LLAMA_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class CausalLMTask(Task):
    """Shared machinery: response-only LM loss, batched greedy generation and exact match.

    Subclasses fill ``self._train`` / ``self._test`` (:class:`PromptDataset`), ``self._labels``
    (the partition column) and implement :meth:`build_model`.
    """

    primary_metric = "exact_match"
    higher_is_better = True
    target_modules = LLAMA_TARGET_MODULES
    head_modules: Sequence[str] = ()
    peft_task_type = "CAUSAL_LM"

    tokenizer: Any
    max_new_tokens: int = 256
    eval_loss: bool = True
    _train: PromptDataset
    _test: PromptDataset
    _labels: np.ndarray

    def train_set(self) -> PromptDataset:
        return self._train

    def test_set(self) -> PromptDataset:
        return self._test

    def partition_labels(self) -> np.ndarray:
        return self._labels

    def processor(self) -> Any:
        """The task's tokenizer (saved with an export)."""
        return self.tokenizer

    def collate(self, examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_batch(examples, pad_id(self.tokenizer))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean token cross-entropy over the response positions (labels ≠ −100)."""
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss

    def loss_items(self, batch: dict[str, torch.Tensor]) -> int:
        """Terms :meth:`loss` averages over: the predicted response tokens (labels shifted by one,
        ≠ −100), so gradient accumulation weights micro-batches by tokens (train.grad_accum_steps)."""
        return int((batch["labels"][:, 1:] != -100).sum())

    @torch.no_grad()
    def generate(self, model: nn.Module, prompts: Sequence[str], max_new_tokens: int | None = None) -> list[str]:
        """Greedy continuations of ``prompts`` (left-padded batch); returns the new text only."""
        tok = self.tokenizer
        device = next(model.parameters()).device
        encoded = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
        n = max(len(e) for e in encoded)
        pad = pad_id(tok)
        ids = torch.full((len(encoded), n), pad, dtype=torch.long)
        mask = torch.zeros((len(encoded), n), dtype=torch.long)
        for i, e in enumerate(encoded):
            ids[i, n - len(e):], mask[i, n - len(e):] = torch.tensor(e), 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=int(max_new_tokens or self.max_new_tokens),
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
        return tok.batch_decode(out[:, n:], skip_special_tokens=True)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: PromptDataset, batch_size: int) -> dict[str, float]:
        """Exact match per evaluation set (``<set>_exact_match``), their unweighted mean
        (``exact_match``) and, if ``eval_loss``, the response-token loss (``loss``)."""
        was_training = model.training
        model.eval()
        hits: dict[str, list[bool]] = {}
        for start in range(0, len(examples), batch_size):
            idx = range(start, min(start + batch_size, len(examples)))
            texts = self.generate(model, [examples.prompts[i] for i in idx])
            for i, text in zip(idx, texts):
                kind = examples.kinds[i]
                hits.setdefault(kind, []).append(self.answers_match(self.extract_answer(text, kind), examples.answers[i], kind))
        metrics: dict[str, float] = {f"{k}_exact_match": float(np.mean(v)) for k, v in sorted(hits.items())}
        metrics["exact_match"] = float(np.mean([metrics[f"{k}_exact_match"] for k in hits])) if hits else 0.0
        if self.eval_loss:
            metrics["loss"] = self.mean_loss(model, examples, batch_size)
        model.train(was_training)
        return metrics

    def evaluation_generates(self) -> bool:
        """Whether :meth:`evaluate` generates and scores answers (exact match); the shared tasks always do."""
        return True

    def evaluation_loss(self) -> bool:
        """Whether :meth:`evaluate` reports the response-token ``loss`` (``eval_loss``)."""
        return bool(self.eval_loss)

    @torch.no_grad()
    def example_outputs(self, model: nn.Module, examples: PromptDataset, batch_size: int) -> dict[str, np.ndarray]:
        """Per-example records in one batched pass: ``kind``, ``hit`` (the generated answer matches;
        when :meth:`evaluation_generates`), ``loss_sum`` and ``tokens`` (the response-token loss
        summed over the example's predicted tokens, and their count; when :meth:`evaluation_loss`)."""
        was_training = model.training
        model.eval()
        n = len(examples)
        out: dict[str, np.ndarray] = {"kind": np.asarray(examples.kinds, dtype=object)}
        try:
            if self.evaluation_generates():
                hit = np.zeros(n, dtype=bool)
                for start in range(0, n, batch_size):
                    idx = range(start, min(start + batch_size, n))
                    for i, text in zip(idx, self.generate(model, [examples.prompts[i] for i in idx])):
                        kind = examples.kinds[i]
                        hit[i] = self.answers_match(self.extract_answer(text, kind), examples.answers[i], kind)
                out["hit"] = hit
            if self.evaluation_loss():
                out["loss_sum"], out["tokens"] = self.example_losses(model, examples, batch_size)
        finally:
            model.train(was_training)
        return out

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics of the examples whose records ``outputs`` holds: exact match
        per kind and their unweighted mean, and the token-weighted response loss."""
        metrics: dict[str, float] = {}
        if "hit" in outputs:
            kinds = sorted(set(outputs["kind"].tolist()))
            for k in kinds:
                metrics[f"{k}_exact_match"] = float(np.mean(outputs["hit"][outputs["kind"] == k]))
            metrics["exact_match"] = float(np.mean([metrics[f"{k}_exact_match"] for k in kinds])) if kinds else 0.0
        if "loss_sum" in outputs:
            metrics["loss"] = float(outputs["loss_sum"].sum() / max(int(outputs["tokens"].sum()), 1))
        return metrics

    @torch.no_grad()
    def example_losses(self, model: nn.Module, examples: PromptDataset, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Per example: the summed cross-entropy of its predicted response tokens (labels shifted by
        one, ≠ −100) and their count — :meth:`mean_loss` is ``Σ loss_sum / Σ tokens``."""
        device = next(model.parameters()).device
        n = len(examples)
        sums, counts = np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.int64)
        for start in range(0, n, batch_size):
            idx = list(range(start, min(start + batch_size, n)))
            batch = examples.batch(idx)
            labels = batch["labels"][:, 1:].to(device)
            if int((labels != -100).sum()) == 0:
                continue
            logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
            for row, i in enumerate(idx):
                ce = nn.functional.cross_entropy(logits[row, :-1].float(), labels[row], ignore_index=-100, reduction="sum")
                sums[i], counts[i] = float(ce), int((labels[row] != -100).sum())
        return sums, counts

    def extract_answer(self, text: str, kind: str) -> str | None:
        """The final answer in a generated ``text`` (:func:`~fedgalore.tasks.paper_math.grading.extract_answer`)."""
        return extract_answer(text, kind)

    def answers_match(self, pred: str | None, gold: str, kind: str) -> bool:
        """Whether an extracted answer is the gold one (:func:`~fedgalore.tasks.paper_math.grading.answers_match`)."""
        return answers_match(pred, gold, kind)

    @torch.no_grad()
    def mean_loss(self, model: nn.Module, examples: PromptDataset, batch_size: int) -> float:
        """The response-token loss over all of ``examples``: each batch's mean weighted by its
        predicted response tokens, ``Σ_b n_b L_b / Σ_b n_b`` (the token mean, not a batch mean)."""
        device = next(model.parameters()).device
        total, count = 0.0, 0
        for start in range(0, len(examples), batch_size):
            batch = examples.batch(range(start, min(start + batch_size, len(examples))))
            n_tok = self.loss_items(batch)
            if n_tok == 0:
                continue
            out = model(**{k: v.to(device) for k, v in batch.items()})
            total += float(out.loss) * n_tok
            count += n_tok
        return total / max(count, 1)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise TaskError(f"dtype={name!r} must be one of {sorted(table)}")
    return table[name]

