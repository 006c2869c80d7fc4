"""``causal_lm``: instruction tuning of any ``AutoModelForCausalLM`` checkpoint on your files.

A front end over :class:`~fedgalore.tasks.causal_lm.base.CausalLMTask` (response-only loss,
greedy generation, exact match) and :class:`~fedgalore.tasks.causal_lm.data.PromptDataset`.
Each row becomes a prompt and a response, in one of three ways:

* ``prompt_column`` + ``response_column``: the prompt text, wrapped as the user turn of the
  tokenizer's chat template when ``chat_template`` says so (default: when it has one);
* ``template`` + ``response_column``: the prompt is ``template.format(**row)`` (``{column}``
  fields; ``{{`` for a literal brace), wrapped the same way;
* ``messages_column``: a conversation (a list of ``{role, content}``) ending with an assistant
  turn: the prompt is the chat template of the turns before it (with the generation prompt), the
  response is that last turn's content — earlier assistant turns are context, not trained.

Training loss: ``L = − (1/|R|) Σ_{t ∈ R} log p(x_t | x_<t)`` over the response tokens R (and the
end-of-sequence token) only. Evaluation on the test split: ``loss`` (the same response-token
mean) and ``perplexity = exp(loss)``; with ``answer_pattern`` (a regex) also greedy generation
and ``exact_match`` of the answer it extracts — the last match, its first group if it has one —
from the generated text against the gold answer (``answer_column``, or the pattern applied to
the response), equal as stripped strings or as numbers (``1,000`` = ``1000.0``). The primary
metric is ``exact_match`` with a pattern, else ``loss`` (lower is better).
"""
from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from fedgalore.tasks.base import TaskError, task_option
from fedgalore.tasks.causal_lm.base import CausalLMTask, torch_dtype
from fedgalore.tasks.causal_lm.data import PromptDataset
from fedgalore.tasks.causal_lm.grading import normalize_number
from fedgalore.tasks.generic.architectures import load_config, pick_target_modules, quiet_transformers, require_tokenizer_files, skeleton
from fedgalore.tasks.generic.common import FileTask, FileTaskOptions
from fedgalore.tasks.generic.data import Rows
from fedgalore.typed import to_plain

__all__ = ["CausalLMOptions", "GenericCausalLMTask", "template_fields", "extract_pattern"]


@dataclass(frozen=True)
class CausalLMOptions(FileTaskOptions):
    """Options of ``causal_lm`` (docs/data.md)."""

    model: str | None = task_option(None, "local folder or hub id of an AutoModelForCausalLM checkpoint with its tokenizer; "
                                          "null: the offline SmolLM2-135M-Instruct")
    prompt_column: str | None = task_option(None, "column holding the prompt (with response_column)")
    response_column: str | None = task_option(None, "column holding the response: the tokens the loss is computed on")
    messages_column: str | None = task_option(None, "column holding a chat, [{role, content}, ...], whose last assistant turn is the response")
    template: str | None = task_option(None, "prompt made of columns, e.g. 'Question: {question}\\nAnswer: ' (with response_column)")
    chat_template: bool | None = task_option(None, "wrap the prompt as a user turn in the tokenizer's chat template; null: when it has one")
    answer_pattern: str | None = task_option(None, "regex extracting the answer (its first group, else the match; last match wins): "
                                                   "evaluation then generates and reports exact_match")
    answer_column: str | None = task_option(None, "column holding the gold answer (default: answer_pattern applied to the response)")
    category_column: str | None = task_option(None, "column of each row's category (a task type, a source): what partitions "
                                                    "and the test split are stratified by; null: one category")
    max_length: int = task_option(512, "tokens of prompt + response (a longer prompt keeps its end; the response is cut)")
    max_new_tokens: int = task_option(64, "tokens generated per test prompt (with answer_pattern)")
    dtype: str = task_option("float32", "weights' dtype: float32, bfloat16 or float16")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.messages_column is not None:
            extra = [k for k in ("prompt_column", "response_column", "template") if getattr(self, k) is not None]
            if extra:
                raise TaskError(f"task.options.messages_column holds prompt and response: leave out {', '.join(extra)}")
        elif self.response_column is None or (self.prompt_column is None) == (self.template is None):
            raise TaskError("task.options needs prompt_column + response_column, or template + response_column, "
                            "or messages_column")
        if self.template is not None:
            template_fields(self.template)
        if self.answer_pattern is not None:
            try:
                re.compile(self.answer_pattern)
            except re.error as exc:
                raise TaskError(f"task.options.answer_pattern={self.answer_pattern!r} is not a regular expression ({exc})") from None
        if self.answer_column is not None and self.answer_pattern is None:
            raise TaskError("task.options.answer_column needs answer_pattern (to extract the answer from generated text)")
        if self.max_length < 8 or self.max_new_tokens < 1:
            raise TaskError("task.options.max_length must be >= 8 and max_new_tokens >= 1")
        torch_dtype(self.dtype)


def template_fields(template: str) -> list[str]:
    """The ``{column}`` fields of a prompt template, in order of first use (one-line TaskError for
    a malformed template or one without fields)."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise TaskError(f"task.options.template is malformed ({exc}); write fields as {{column}} and a literal brace as {{{{") from None
    if not fields or any(not f or any(c in f for c in ".[]") for f in fields):
        raise TaskError(f"task.options.template={template!r} needs {{column}} fields naming columns (got {fields})")
    return list(dict.fromkeys(fields))


def extract_pattern(pattern: re.Pattern[str], text: str) -> str | None:
    """The answer ``pattern`` finds in ``text``: its last match's first group (the whole match
    when it has no group), stripped; None when it does not match."""
    found = list(pattern.finditer(text))
    if not found:
        return None
    m = found[-1]
    return (m.group(1) if pattern.groups else m.group(0) or "").strip()


class GenericCausalLMTask(FileTask, CausalLMTask):
    """``causal_lm``: instruction tuning on prompt/response columns, chats or a template (module
    doc). Adapted matrices: :mod:`fedgalore.tasks.generic.architectures` (Llama family: all seven
    projections); nothing else is trained (``lm_head`` stays frozen)."""

    name = "causal_lm"
    options_class = CausalLMOptions

    def __init__(self, options: CausalLMOptions | None = None, /, **fields: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.options = opts = options if options is not None else CausalLMOptions(**fields)
        self.model_id = opts.model or str(self.default_model())
        config = load_config(self.model_id)
        require_tokenizer_files(self.model_id)
        try:
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_id)
        except (OSError, ValueError) as exc:
            raise TaskError(f"could not load the tokenizer of {self.model_id!r} ({str(exc).splitlines()[0][:160]})") from None
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if not has_template and (opts.chat_template or opts.messages_column):
            raise TaskError(f"the tokenizer of {self.model_id!r} has no chat template; "
                            "use prompt_column or template with task.options.chat_template: false")
        self.use_chat = has_template if opts.chat_template is None else bool(opts.chat_template)
        self.max_length, self.max_new_tokens, self.seed = opts.max_length, opts.max_new_tokens, opts.seed
        self.dtype = torch_dtype(opts.dtype)
        self.answer_pattern = re.compile(opts.answer_pattern) if opts.answer_pattern else None
        self.primary_metric = "exact_match" if self.answer_pattern else "loss"
        self.higher_is_better = self.answer_pattern is not None

        required = self._required_columns(opts)
        raw = self._read_rows(opts, required)
        self._rows = self._split_rows(opts, raw, opts.category_column)
        if opts.category_column:
            cats = np.asarray([str(v) for v in self._rows["train"].data[opts.category_column]])
            self._category_names, self._labels = np.unique(cats, return_inverse=True)
        else:
            self._category_names, self._labels = np.asarray(["all"]), np.zeros(len(self._rows["train"]), dtype=np.int64)
        self._labels = self._labels.astype(np.int64)
        self._sets = {split: self._dataset(rows, split != "train") for split, rows in self._rows.items()}
        self._train, self._test = self._sets["train"], self._sets["test"]
        self._warn_truncated()

        self.model_type = config.model_type
        self.target_modules = pick_target_modules(skeleton(AutoModelForCausalLM, config), config.model_type, opts.target_modules)

    @staticmethod
    def default_model() -> Path:
        """The offline SmolLM2-135M-Instruct folder (:func:`fedgalore.tasks.assets.smollm2_path`;
        converted from the packaged GGUF file on first use)."""
        from fedgalore.tasks.assets import smollm2_path

        return smollm2_path()

    # ------------------------------------------------------------------ data
    @staticmethod
    def _required_columns(opts: CausalLMOptions) -> list[tuple[str, str, str]]:
        if opts.messages_column:
            req = [(opts.messages_column, "messages_column", "chat")]
        else:
            req = [(opts.prompt_column, "prompt_column", "prompt")] if opts.prompt_column else \
                [(f, "template", "template field") for f in template_fields(opts.template)]
            req.append((opts.response_column, "response_column", "response"))
        if opts.answer_column:
            req.append((opts.answer_column, "answer_column", "answer"))
        if opts.category_column:
            req.append((opts.category_column, "category_column", "category"))
        return req

    def _wrap(self, user: str) -> str:
        if not self.use_chat:
            return user
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)

    def _chat(self, rows: Rows, i: int, chat: Any) -> tuple[str, str]:
        ok = isinstance(chat, list) and len(chat) >= 2 and all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in chat)
        if not ok or chat[-1]["role"] != "assistant":
            raise TaskError(f"{rows.name} row {rows.row(i)}: column {self.options.messages_column!r} must hold a list of "
                            "{role, content} turns ending with an assistant turn")
        turns = [{"role": t["role"], "content": t["content"]} for t in chat[:-1]]
        prompt = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return prompt, str(chat[-1]["content"])

    def _dataset(self, rows: Rows, evaluated: bool) -> PromptDataset:
        opts = self.options
        prompts, responses = [], []
        if opts.messages_column:
            for i, chat in enumerate(rows.data[opts.messages_column]):
                p, r = self._chat(rows, i, chat)
                prompts.append(p)
                responses.append(r)
        else:
            if opts.prompt_column:
                users = [str(v) for v in rows.data[opts.prompt_column]]
            else:
                names = template_fields(opts.template)
                cols = {f: rows.data[f] for f in names}
                users = [opts.template.format(**{f: cols[f][i] for f in names}) for i in range(len(rows))]
            prompts = [self._wrap(u) for u in users]
            responses = [str(v) for v in rows.data[opts.response_column]]
        answers = [""] * len(rows)
        if self.answer_pattern is not None and evaluated:
            answers = self._gold_answers(rows, responses)
        return PromptDataset(prompts, responses, answers, ["answer"] * len(rows), self.tokenizer, self.max_length)

    def _gold_answers(self, rows: Rows, responses: list[str]) -> list[str]:
        if self.options.answer_column:
            return [str(v).strip() for v in rows.data[self.options.answer_column]]
        out = []
        for i, r in enumerate(responses):
            a = extract_pattern(self.answer_pattern, r)
            if a is None:
                raise TaskError(f"{rows.name} row {rows.row(i)}: task.options.answer_pattern={self.options.answer_pattern!r} "
                                "finds no answer in the response; fix the pattern or give answer_column")
            out.append(a)
        return out

    def _warn_truncated(self) -> None:
        ds = self._train
        enc_p = self.tokenizer(ds.prompts, add_special_tokens=True)["input_ids"]
        enc_r = self.tokenizer(ds.responses, add_special_tokens=False)["input_ids"]
        over = sum(len(p) + len(r) + 1 > self.max_length for p, r in zip(enc_p, enc_r))
        if over:
            self._say_once("truncated", "causal_lm: %d of %d training examples exceed task.options.max_length=%d tokens and are cut "
                           "(a long prompt keeps its end; the response its start)", over, len(ds), self.max_length)

    def validation_set(self) -> PromptDataset | None:
        return self._sets.get("validation")

    def label_names(self) -> list[str]:
        return [str(c) for c in self._category_names]

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        """The checkpoint's weights (in ``task.options.dtype``), eval mode."""
        from transformers import AutoModelForCausalLM

        try:
            with quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(self.model_id, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise TaskError(f"could not load model {self.model_id!r} ({str(exc).splitlines()[0][:160]})") from None
        model.eval()
        return model

    # ------------------------------------------------------------------ evaluation
    def extract_answer(self, text: str, kind: str) -> str | None:
        return extract_pattern(self.answer_pattern, text)

    def answers_match(self, pred: str | None, gold: str, kind: str) -> bool:
        if pred is None:
            return False
        if pred.strip() == gold.strip():
            return True
        a, b = normalize_number(pred), normalize_number(gold)
        return a is not None and a == b

    def evaluate(self, model: nn.Module, examples: PromptDataset, batch_size: int) -> dict[str, float]:
        """``loss`` and ``perplexity`` on ``examples``; with ``answer_pattern`` also ``exact_match``."""
        if self.answer_pattern is not None:
            metrics = super().evaluate(model, examples, batch_size)
            metrics.pop("answer_exact_match", None)
        else:
            was_training = model.training
            model.eval()
            metrics = {"loss": self.mean_loss(model, examples, batch_size)}
            model.train(was_training)
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(self.data_description(), model=self.model_id, model_type=self.model_type, max_length=self.max_length,
                 chat_template=self.use_chat, target_modules=list(self.target_modules), options=to_plain(self.options))
        return d
