"""Prompt/response data of the causal LM tasks: :class:`PromptDataset` (tokenised on access),
right padding (:func:`pad_batch`) and records from local ``.json``/``.jsonl`` files or the hub
(:func:`read_records`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from fedgalore.tasks.base import TaskError

__all__ = ["PromptDataset", "pad_id", "pad_batch", "read_records"]


@dataclass
class PromptDataset:
    """Prompt/response pairs, tokenised on access (long corpora need no up-front pass).

    ``prompts[i]`` is the full prompt text (template applied), ``responses[i]`` the target text
    (training) and ``answers[i]`` / ``kinds[i]`` the gold final answer and its extraction rule
    (evaluation). ``dataset[i]`` gives ``input_ids`` and ``labels`` (prompt positions −100).

    ``segments`` (optional; per example None or ``((text, trained), ...)`` joining to
    ``prompts[i]``): a prompt that holds trained pieces itself — a conversation's earlier
    assistant turns. Each piece is tokenised on its own (the first with the tokenizer's special
    tokens, as a prompt is) and labelled with its tokens when ``trained``, −100 otherwise.
    """

    prompts: list[str]
    responses: list[str]
    answers: list[str]
    kinds: list[str]
    tokenizer: Any
    max_length: int
    segments: Sequence[tuple[tuple[str, bool], ...] | None] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        pieces = self.segments[idx] if self.segments is not None else None
        if pieces:
            p, lab = [], []
            for k, (text, trained) in enumerate(pieces):
                ids_k = tok(text, add_special_tokens=k == 0)["input_ids"]
                p += ids_k
                lab += ids_k if trained else [-100] * len(ids_k)
        else:
            p = tok(self.prompts[idx], add_special_tokens=True)["input_ids"]
            lab = [-100] * len(p)
        r = tok(self.responses[idx], add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            r = r + [tok.eos_token_id]
        if len(p) > self.max_length // 2 and len(p) + len(r) > self.max_length:
            p, lab = p[-(self.max_length // 2):], lab[-(self.max_length // 2):]  # keep the end of an over-long prompt
        ids = (p + r)[: self.max_length]
        labels = (lab + r)[: self.max_length]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-padded batch of the examples at ``indices``."""
        return pad_batch([self[int(i)] for i in indices], pad_id(self.tokenizer))


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id (else its end-of-sequence, else its unknown token, else 0)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tid is not None:
            return int(tid)
    return 0


def pad_batch(examples: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (with ``pad_id``) and ``labels`` (with −100) to the longest example."""
    n = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        k = len(e["input_ids"])
        ids[i, :k], labels[i, :k], mask[i, :k] = e["input_ids"], e["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def read_records(source: str, split: str = "train", config: str | None = None) -> list[dict]:
    """Records of a local ``.json``/``.jsonl`` file (or a folder of them) or a hub data set."""
    path = Path(source).expanduser()
    if path.exists():
        files = sorted(path.glob("*.json*")) if path.is_dir() else [path]
        if path.is_dir():
            named = [f for f in files if split in f.stem]
            files = named or files
        out: list[dict] = []
        for f in files:
            text = f.read_text(encoding="utf-8")
            if f.suffix == ".jsonl" or not text.lstrip().startswith("["):
                out.extend(json.loads(line) for line in text.splitlines() if line.strip())
            else:
                out.extend(json.loads(text))
        return out
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a core dependency
        raise TaskError("the `datasets` package is needed to load hub data sets") from None
    try:
        ds = datasets.load_dataset(source, config, split=split) if config else datasets.load_dataset(source, split=split)
    except Exception as exc:
        raise TaskError(
            f"could not load data set {source!r} (split {split!r}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
            "pass a local .json/.jsonl path instead when offline"
        ) from None
    return [dict(r) for r in ds]

