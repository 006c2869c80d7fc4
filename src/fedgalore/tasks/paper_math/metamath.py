"""``metamath``: the paper's NLG setting (§6) — Llama-2 fine-tuned on MetaMathQA, partitioned by
a Dirichlet over the ``type`` field (GSM_Rephrased, MATH_AnsAug, ...), evaluated on GSM8K and MATH
by greedy generation and exact match of the extracted final answer. Data from the hub
(``datasets.load_dataset``) or local ``.json`` / ``.jsonl`` files."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from torch import nn

from fedgalore.tasks.base import TaskError, TaskOptions, task_option
from fedgalore.tasks.paper_math.base import CausalLMTask, torch_dtype
from fedgalore.tasks.paper_math.data import PromptDataset, read_records
from fedgalore.tasks.paper_math.grading import extract_gsm8k_answer, last_boxed
from fedgalore.tasks.quantize import check_quantization, prepare_quantized, quantized_load_kwargs

__all__ = ["MetaMathQATask", "MetaMathOptions", "ALPACA_PROMPT"]

#: MetaMath's Alpaca-style prompt (Yu et al. 2023, used for training and evaluation)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{query}\n\n### Response:\n"
)


@dataclass(frozen=True)
class MetaMathOptions(TaskOptions):
    """Options of ``metamath`` (the paper's causal LM on MetaMathQA, evaluated on GSM8K and MATH)."""

    model: str = task_option("meta-llama/Llama-2-7b-hf", "hub id or local folder of the causal LM")
    data: str = task_option("meta-math/MetaMathQA", "hub id or local .json/.jsonl with query, response (and type) fields")
    eval_sets: tuple[str, ...] = task_option(("gsm8k", "math"), "evaluation sets: a non-empty subset of [gsm8k, math]")
    gsm8k_data: str = task_option("openai/gsm8k", "hub id (config main, split test) or local file with question/answer")
    math_data: str = task_option("EleutherAI/hendrycks_math", "hub id (every subject) or local file with problem/solution")
    n_train: int | None = task_option(None, "the first n_train training records; null: all")
    n_eval: int | None = task_option(None, "the first n_eval problems of each evaluation set; null: all")
    max_length: int = task_option(1024, "training tokens per example (prompt + response)")
    max_new_tokens: int = task_option(512, "tokens generated per evaluation problem")
    load_in_4bit: bool = task_option(False, "deprecated: quantization: 4bit says the same")
    quantization: str | None = task_option(
        None, "4bit | 8bit: the frozen base's linear layers quantised by bitsandbytes, dtype the compute dtype "
              "(CUDA; FedIT, FFA-LoRA, LoRA-FAIR); null: none")
    dtype: str = task_option("bfloat16", "model dtype: float32, bfloat16 or float16 (fp32, bf16, fp16)")
    gradient_checkpointing: bool = task_option(False, "recompute activations in the backward pass (less memory)")
    tokenizer: str | None = task_option(None, "hub id or local folder of the tokenizer; null: the model's")
    eval_loss: bool = task_option(False, "also report the mean loss on the evaluation solutions")

    def __post_init__(self) -> None:
        bad = sorted(set(self.eval_sets) - {"gsm8k", "math"})
        if bad or not self.eval_sets:
            raise TaskError(f"task.options.eval_sets={list(self.eval_sets)} must be a non-empty subset of ['gsm8k', 'math']")
        torch_dtype(self.dtype)
        check_quantization(self.quantization)
        if self.load_in_4bit and self.quantization not in (None, "4bit"):
            raise TaskError(f"task.options.load_in_4bit: true and quantization: {self.quantization} disagree; "
                            "give quantization alone (load_in_4bit is its old name for 4bit)")


class MetaMathQATask(CausalLMTask):
    """Llama-2 on MetaMathQA, Dirichlet over ``type``, evaluated on GSM8K and MATH (paper §6).

    Options: ``model`` (hub id or local folder), ``data`` (hub id or local .json/.jsonl with
    ``query``/``response``/``type``), ``eval_sets`` (subset of ``("gsm8k", "math")``),
    ``gsm8k_data`` (hub id, config ``main``, split ``test``; or a local file with
    ``question``/``answer``), ``math_data`` (hub id — every subject config of
    ``EleutherAI/hendrycks_math`` is concatenated — or a local file with ``problem``/``solution``
    and optional ``answer``), ``n_train`` / ``n_eval`` (first-N subsets; None = all; GSM8K and
    MATH each get ``n_eval``), ``max_length`` (training tokens), ``max_new_tokens``
    (generation), ``dtype``, ``quantization`` (``4bit`` / ``8bit``: :mod:`fedgalore.tasks.quantize`;
    ``load_in_4bit: true`` is its old name for ``4bit``), ``gradient_checkpointing``,
    ``tokenizer`` (defaults to ``model``).
    """

    name = "metamath"
    options_class = MetaMathOptions

    MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                     "number_theory", "prealgebra", "precalculus")

    def __init__(
        self,
        model: str = "meta-llama/Llama-2-7b-hf",
        data: str = "meta-math/MetaMathQA",
        eval_sets: Sequence[str] = ("gsm8k", "math"),
        gsm8k_data: str = "openai/gsm8k",
        math_data: str = "EleutherAI/hendrycks_math",
        n_train: int | None = None,
        n_eval: int | None = None,
        max_length: int = 1024,
        max_new_tokens: int = 512,
        load_in_4bit: bool = False,
        dtype: str = "bfloat16",
        gradient_checkpointing: bool = False,
        tokenizer: str | None = None,
        eval_loss: bool = False,
        quantization: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.model_id, self.data_id = model, data
        self.max_length, self.max_new_tokens, self.eval_loss = int(max_length), int(max_new_tokens), bool(eval_loss)
        self.dtype, self.gradient_checkpointing = torch_dtype(dtype), bool(gradient_checkpointing)
        check_quantization(quantization)
        self.quantization = quantization or ("4bit" if load_in_4bit else None)
        self.load_in_4bit = self.quantization == "4bit"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        except Exception as exc:
            raise TaskError(f"could not load tokenizer {tokenizer or model!r}: {str(exc).splitlines()[0]}") from None

        rows = read_records(data, "train")
        if n_train is not None:
            rows = rows[: int(n_train)]
        if not rows or not {"query", "response"} <= set(rows[0]):
            raise TaskError(f"data {data!r} must have records with 'query', 'response' (and 'type') fields")
        self._labels = np.array([str(r.get("type", "unknown")) for r in rows])
        self._train = PromptDataset(
            prompts=[ALPACA_PROMPT.format(query=r["query"]) for r in rows],
            responses=[r["response"] for r in rows],
            answers=[str(extract_gsm8k_answer(r["response"]) or "") for r in rows],
            kinds=["gsm8k"] * len(rows),
            tokenizer=self.tokenizer,
            max_length=self.max_length,
        )

        prompts, responses, answers, kinds = [], [], [], []
        if "gsm8k" in eval_sets:
            recs = read_records(gsm8k_data, "test", None if Path(gsm8k_data).expanduser().exists() else "main")
            recs = recs[: int(n_eval)] if n_eval is not None else recs
            for r in recs:
                gold = r["answer"].split("####")[-1].strip()
                prompts.append(ALPACA_PROMPT.format(query=r["question"]))
                responses.append(re.sub(r"<<[^>]*>>", "", r["answer"]).replace("####", "The answer is:"))
                answers.append(gold)
                kinds.append("gsm8k")
        if "math" in eval_sets:
            recs = self._math_records(math_data)
            recs = recs[: int(n_eval)] if n_eval is not None else recs
            for r in recs:
                gold = r.get("answer") or last_boxed(r["solution"]) or ""
                prompts.append(ALPACA_PROMPT.format(query=r["problem"]))
                responses.append(r["solution"])
                answers.append(str(gold))
                kinds.append("math")
        self._test = PromptDataset(prompts, responses, answers, kinds, self.tokenizer, self.max_length)

    def _math_records(self, source: str) -> list[dict]:
        if Path(source).expanduser().exists() or source != "EleutherAI/hendrycks_math":
            return read_records(source, "test")
        out: list[dict] = []
        for subject in self.MATH_SUBJECTS:
            out.extend(read_records(source, "test", subject))
        return out

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": self.dtype, **quantized_load_kwargs(self.quantization, self.dtype, ["lm_head"])}
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_id, **kwargs)
        except Exception as exc:
            raise TaskError(f"could not load model {self.model_id!r}: {str(exc).splitlines()[0]}") from None
        model = prepare_quantized(model, self.quantization)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        model.eval()
        return model

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model": self.model_id, "data": self.data_id, "max_length": self.max_length}
