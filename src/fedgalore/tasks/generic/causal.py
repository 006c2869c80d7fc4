"""``causal_lm``: instruction tuning of any ``AutoModelForCausalLM`` checkpoint on your files.

A front end over :class:`~fedgalore.tasks.paper_math.base.CausalLMTask` (response-only loss,
greedy generation, exact match) and :class:`~fedgalore.tasks.paper_math.data.PromptDataset`.
Each row becomes a prompt and a response in the ``format`` it is written in
(:mod:`~fedgalore.tasks.generic.formats`; null: from the columns named, as before formats had
names):

* ``prompt_response`` — ``prompt_column`` + ``response_column``: the prompt text, wrapped as the
  user turn of the tokenizer's chat template when ``chat_template`` says so (default: when it has
  one);
* ``template`` — ``template`` + ``response_column``: the prompt is ``template.format(**row)``
  (``{column}`` fields; ``{{`` for a literal brace), wrapped the same way;
* ``alpaca`` — instruction, optional input, output: one user turn of the chat template, or the
  usual Alpaca prompt without one;
* ``messages`` / ``sharegpt`` — a conversation (``{role, content}`` / ``{from, value}`` turns)
  ending with an assistant turn: the prompt is the chat template of the turns before it (with the
  generation prompt), the response that last turn's content; with ``train_on:
  all_assistant_turns`` (the default) every earlier assistant turn is trained too, with ``last``
  those are context.

Training loss: ``L = − (1/|R|) Σ_{t ∈ R} log p(x_t | x_<t)`` over the response tokens R (and the
end-of-sequence token) only. Evaluation on the test split: ``loss`` (the same response-token
mean) and ``perplexity = exp(loss)``; with ``answer_pattern`` (a regex) also greedy generation
and ``exact_match`` of the answer it extracts — the last match, its first group if it has one —
from the generated text against the gold answer (``answer_column``, or the pattern applied to
the response), equal as stripped strings or as numbers (``1,000`` = ``1000.0``). The primary
metric is ``exact_match`` with a pattern, else ``loss`` (lower is better).
"""
from __future__ import annotations

import logging
import math
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch import nn

from fedgalore.tasks.base import TaskError, task_option
from fedgalore.tasks.paper_math.base import CausalLMTask, torch_dtype
from fedgalore.tasks.paper_math.data import PromptDataset
from fedgalore.tasks.paper_math.grading import normalize_number
from fedgalore.tasks.generic.architectures import load_config, pick_target_modules, quiet_transformers, require_tokenizer_files, skeleton
from fedgalore.tasks.generic.common import FileTask, FileTaskOptions
from fedgalore.tasks.generic.data import Rows
from fedgalore.tasks.quantize import check_quantization, prepare_quantized, quantized_load_kwargs
from fedgalore.tasks.generic.formats import (CHAT_FORMATS, PLAIN_CHAT_TEMPLATE, FormatColumns, alpaca_prompt, alpaca_user_text,
                                             conversation_segments, end_of_turn_tokens, guess_format, to_turns)
from fedgalore.typed import to_plain

__all__ = ["CausalLMOptions", "GenericCausalLMTask", "template_fields", "extract_pattern"]


@dataclass(frozen=True)
class CausalLMOptions(FileTaskOptions):
    """Options of ``causal_lm`` (docs/data.md)."""

    model: str | None = task_option(None, "local folder or hub id of an AutoModelForCausalLM checkpoint with its tokenizer; "
                                          "null: the offline SmolLM2-135M-Instruct")
    format: Literal["alpaca", "sharegpt", "messages", "prompt_response", "template"] | None = task_option(
        None, "how rows are written: alpaca (instruction, input, output), sharegpt ([{from, value}]), messages ([{role, content}]), "
              "prompt_response, template; null: from the columns named")
    prompt_column: str | None = task_option(None, "column holding the prompt (with response_column); alpaca: the instruction "
                                                  "(default 'instruction')")
    input_column: str | None = task_option(None, "alpaca: column of the optional input (default 'input'; empty, NaN or absent: none)")
    response_column: str | None = task_option(None, "column holding the response: the tokens the loss is computed on; "
                                                    "alpaca: default 'output'")
    messages_column: str | None = task_option(None, "column holding a chat whose last assistant turn is the response: [{role, content}, "
                                                    "...] (messages; default 'messages') or [{from, value}, ...] (sharegpt; "
                                                    "default 'conversations')")
    template: str | None = task_option(None, "prompt made of columns, e.g. 'Question: {question}\\nAnswer: ' (with response_column)")
    chat_template: bool | None = task_option(None, "render with the tokenizer's chat template; null: when it has one (else the "
                                                   "plain fallback: the Alpaca prompt, ### User: / ### Assistant: blocks)")
    train_on: Literal["last", "all_assistant_turns"] = task_option(
        "all_assistant_turns", "multi-turn chats: the loss on every assistant turn, or on the last one only (earlier ones: context)")
    answer_pattern: str | None = task_option(None, "regex extracting the answer (its first group, else the match; last match wins): "
                                                   "evaluation then generates and reports exact_match")
    answer_column: str | None = task_option(None, "column holding the gold answer (default: answer_pattern applied to the response)")
    category_column: str | None = task_option(None, "column of each row's category (a task type, a source): what partitions "
                                                    "and the test split are stratified by; null: one category")
    system_prompt: str | None = task_option(None, "a system turn put first in every prompt without one (chat template only; "
                                            "'' for an empty one); null: the template's own default — SmolLM2's adds its "
                                            "own system prompt, and the run says so once")
    max_length: int = task_option(512, "tokens of prompt + response (a longer prompt keeps its end; the response is cut)")
    max_new_tokens: int = task_option(64, "tokens generated per test prompt (with answer_pattern)")
    dtype: str = task_option("float32", "weights' dtype: float32, bfloat16 or float16")
    quantization: str | None = task_option(
        None, "4bit | 8bit: the frozen base's linear layers quantised by bitsandbytes, dtype the compute dtype "
              "(CUDA; FedIT, FFA-LoRA, LoRA-FAIR); null: none")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_quantization(self.quantization)
        fmt = self.resolved_format()
        if self.input_column is not None and fmt != "alpaca":
            raise TaskError(f"task.options.input_column is read by format: alpaca only (this is format {fmt})")
        if self.format is None:
            if self.messages_column is not None:
                extra = [k for k in ("prompt_column", "response_column", "template") if getattr(self, k) is not None]
                if extra:
                    raise TaskError(f"task.options.messages_column holds prompt and response: leave out {', '.join(extra)}")
            elif self.response_column is None or (self.prompt_column is None) == (self.template is None):
                raise TaskError("task.options needs prompt_column + response_column, or template + response_column, "
                                "or messages_column, or a format: alpaca, sharegpt or messages")
        else:
            not_read = {"alpaca": ("template", "messages_column"), "sharegpt": ("prompt_column", "response_column", "template"),
                        "messages": ("prompt_column", "response_column", "template"),
                        "prompt_response": ("template", "messages_column"), "template": ("prompt_column", "messages_column")}
            extra = [k for k in not_read[fmt] if getattr(self, k) is not None]
            if extra:
                raise TaskError(f"task.options.format: {fmt} does not read {', '.join(extra)}; leave {'them' if len(extra) > 1 else 'it'} out")
            needed = {"prompt_response": ("prompt_column", "response_column"), "template": ("template", "response_column")}
            missing = [k for k in needed.get(fmt, ()) if getattr(self, k) is None]
            if missing:
                raise TaskError(f"task.options.format: {fmt} needs {' and '.join(missing)}")
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

    def resolved_format(self) -> str:
        """``format``, or the one the columns named imply (``messages_column``: messages;
        ``template``: template; else prompt_response)."""
        if self.format is not None:
            return self.format
        if self.messages_column is not None:
            return "messages"
        return "template" if self.template is not None else "prompt_response"

    def columns(self) -> FormatColumns:
        """The columns the format reads: the ones named, else the format's defaults."""
        return FormatColumns.of(self.resolved_format(), self.prompt_column, self.input_column, self.response_column,
                                self.messages_column)


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
        self.model_id = self._model_to_load(opts)  # an adapter folder's base (self.adapter)
        config = load_config(self.model_id)
        require_tokenizer_files(self.model_id)
        try:
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_id)
        except (OSError, ValueError) as exc:
            raise TaskError(f"could not load the tokenizer of {self.model_id!r} ({str(exc).splitlines()[0][:160]})") from None
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if not has_template and opts.chat_template:
            raise TaskError(f"the tokenizer of {self.model_id!r} has no chat template; leave task.options.chat_template out "
                            "(or false) for the plain prompt (docs/data.md, \"Instruction formats\")")
        self.use_chat = has_template if opts.chat_template is None else bool(opts.chat_template)
        self._note_default_system_prompt(opts)
        self.data_format, self.cols = opts.resolved_format(), opts.columns()
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
        self.target_modules = pick_target_modules(skeleton(AutoModelForCausalLM, config), config.model_type, self._adapter_targets(opts))

    @staticmethod
    def default_model() -> Path:
        """The offline SmolLM2-135M-Instruct folder (:func:`fedgalore.tasks.assets.smollm2_path`;
        converted from the packaged GGUF file on first use)."""
        from fedgalore.tasks.assets import smollm2_path

        return smollm2_path()

    # ------------------------------------------------------------------ data
    @staticmethod
    def _required_columns(opts: CausalLMOptions) -> list[tuple[str, str, str]]:
        fmt, cols = opts.resolved_format(), opts.columns()
        if fmt in CHAT_FORMATS:
            req = [(cols.messages, "messages_column", "chat")]
        else:
            if fmt == "template":
                req = [(f, "template", "template field") for f in template_fields(opts.template)]
            else:
                req = [(cols.prompt, "prompt_column", "instruction" if fmt == "alpaca" else "prompt")]
            req.append((cols.response, "response_column", "response"))
        if opts.answer_column:
            req.append((opts.answer_column, "answer_column", "answer"))
        if opts.category_column:
            req.append((opts.category_column, "category_column", "category"))
        return req

    def _column_hint(self, rows: Rows) -> str:
        """Which format (and option) rows that lack a column this format reads look like."""
        guess = guess_format(rows.columns, rows.data[0] if len(rows) else None)
        if guess is None or guess[0] == self.data_format:
            return ""
        here = f"format {self.data_format}" + (" (from the columns named)" if self.options.format is None else "")
        return f"{here} reads other columns; these look like {guess[0]}: set {guess[1]}"

    def _with_system(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        """``turns`` with ``task.options.system_prompt`` as a first system turn when they have none."""
        sp = self.options.system_prompt
        if sp is None or not self.use_chat or (turns and turns[0].get("role") == "system"):
            return turns
        return [{"role": "system", "content": sp}, *turns]

    def _note_default_system_prompt(self, opts: CausalLMOptions) -> None:
        """Say once when the chat template adds a system prompt of its own to turns without one
        (SmolLM2's does) and ``system_prompt`` does not choose it."""
        if not self.use_chat or opts.system_prompt is not None:
            return
        marker = "\u2063user-turn\u2063"
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        except Exception:  # a template that needs more than one turn: nothing to say
            return
        before = text.split(marker)[0]
        if "system" in before.lower():
            shown = " ".join(before.split())[:120]
            logging.getLogger("fedgalore").warning(
                "causal_lm: the chat template of %s adds its own system prompt to every row without one (%s...); set "
                "task.options.system_prompt to choose it ('' for an empty one)", self.model_id, shown)

    def _wrap(self, user: str) -> str:
        if not self.use_chat:
            return user
        return self.tokenizer.apply_chat_template(self._with_system([{"role": "user", "content": user}]), tokenize=False,
                                                  add_generation_prompt=True)

    def _render(self, turns: list[dict[str, str]], generation: bool) -> str:
        """Turns as text: the tokenizer's chat template, else (or with chat_template: false) the plain one."""
        template = None if self.use_chat else PLAIN_CHAT_TEMPLATE
        return self.tokenizer.apply_chat_template(self._with_system(turns), tokenize=False, add_generation_prompt=generation,
                                                  chat_template=template)

    def _conversations(self, rows: Rows) -> tuple[list[str], list[str], list]:
        """Prompts, responses and segments of a sharegpt / messages column (formats module doc)."""
        column = self.cols.messages
        eot = end_of_turn_tokens(self.tokenizer)
        train_all = self.options.train_on == "all_assistant_turns"
        prompts, responses, segments = [], [], []
        for i, chat in enumerate(rows.data[column]):
            where = f"{rows.name} row {rows.row(i)}"
            turns = to_turns(chat, self.data_format, where, f"{column!r} (task.options.messages_column)")
            prompt, segs = conversation_segments(turns, self._render, train_all, eot, where)
            prompts.append(prompt)
            responses.append(turns[-1]["content"])
            segments.append(segs)
        return prompts, responses, segments

    def _dataset(self, rows: Rows, evaluated: bool) -> PromptDataset:
        opts, cols = self.options, self.cols
        segments: list | None = None
        if self.data_format in CHAT_FORMATS:
            prompts, responses, segments = self._conversations(rows)
        else:
            if self.data_format == "alpaca":
                inputs = rows.data[cols.input] if cols.input in rows.columns else [None] * len(rows)
                instructions = rows.data[cols.prompt]
                if self.use_chat:
                    prompts = [self._wrap(alpaca_user_text(q, x)) for q, x in zip(instructions, inputs)]
                else:
                    prompts = [alpaca_prompt(q, x) for q, x in zip(instructions, inputs)]
            else:
                if self.data_format == "prompt_response":
                    users = [str(v) for v in rows.data[cols.prompt]]
                else:
                    names = template_fields(opts.template)
                    values = {f: rows.data[f] for f in names}
                    users = [opts.template.format(**{f: values[f][i] for f in names}) for i in range(len(rows))]
                prompts = [self._wrap(u) for u in users]
            responses = [str(v) for v in rows.data[cols.response]]
        answers = [""] * len(rows)
        if self.answer_pattern is not None and evaluated:
            answers = self._gold_answers(rows, responses)
        if segments is not None and not any(segments):
            segments = None
        return PromptDataset(prompts, responses, answers, ["answer"] * len(rows), self.tokenizer, self.max_length, segments)

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
        """The checkpoint's weights (in ``task.options.dtype``; ``quantization``: its linear layers
        quantised, :mod:`fedgalore.tasks.quantize`), a PEFT adapter given as the model set
        aside (:meth:`_apply_adapter`), eval mode."""
        from transformers import AutoModelForCausalLM

        quantized = quantized_load_kwargs(self.options.quantization, self.dtype, ["lm_head"])
        try:
            with quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(self.model_id, dtype=self.dtype, **quantized)
        except (OSError, ValueError) as exc:
            raise TaskError(f"could not load model {self.model_id!r} ({str(exc).splitlines()[0][:160]})") from None
        model = self._apply_adapter(prepare_quantized(model, self.options.quantization))
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

    def evaluation_generates(self) -> bool:
        """Generation and exact match only with ``answer_pattern``."""
        return self.answer_pattern is not None

    def evaluation_loss(self) -> bool:
        """The response-token loss, always (``perplexity`` is its exponential)."""
        return True

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics (``exact_match`` with a pattern, ``loss``, ``perplexity``) of
        the examples whose records ``outputs`` holds."""
        metrics = super().metrics_of_outputs(outputs)
        metrics.pop("answer_exact_match", None)
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(self.data_description(), model=self.model_id, model_type=self.model_type, max_length=self.max_length,
                 format=self.data_format, chat_template=self.use_chat, target_modules=list(self.target_modules), options=to_plain(self.options))
        return d

    def prediction_prompts(self, rows: Rows) -> list[str]:
        """The prompt of every row of ``rows`` as the task renders it for generation (its format,
        template, chat template), for ``fedgalore predict``: the response column may be absent (an
        unlabelled file), and a conversation may end with the user's turn (the turn to answer) —
        one that ends with an assistant turn is answered anew from the turns before it."""
        import datasets

        from fedgalore.tasks.generic.formats import CHAT_FORMATS, SHAREGPT_ROLES

        table = rows.data.to_dict()  # the rows as columns of plain values (a selection's included)
        if self.data_format in CHAT_FORMATS:
            column = self.cols.messages
            rows.require(column, "messages_column")
            role, text = ("from", "value") if self.data_format == "sharegpt" else ("role", "content")

            def answered(chat: Any) -> bool:
                last = chat[-1] if isinstance(chat, (list, tuple)) and chat and isinstance(chat[-1], dict) else {}
                who = str(last.get(role, "")).strip().lower()
                return (SHAREGPT_ROLES.get(who) if self.data_format == "sharegpt" else who) == "assistant"

            table[column] = [list(c) if answered(c) else list(c or []) + [{role: "assistant" if role == "role" else "gpt", text: ""}]
                             for c in table[column]]
        elif self.cols.response not in table:
            table[self.cols.response] = [""] * len(rows)
        data = datasets.Dataset.from_dict(table)
        return self._dataset(Rows(data, rows.name, rows.folder, rows.index, rows.origins), evaluated=False).prompts
