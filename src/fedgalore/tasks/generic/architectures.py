"""What the generic tasks need to know about a checkpoint's architecture: its config, its
tokenizer files, the linear layers every method adapts (target modules), the classification head,
and the seeded initialisation of weights the checkpoint lacks.

Target modules (``task.options.target_modules`` overrides them): for a checkpoint's
``config.model_type``,

1. our own choice for the families the paper and the offline tasks use — attention query and
   value, the attention output projection and the MLP layers, the paper's Table 9 choice
   (``query, value, dense`` for RoBERTa) in each family's naming (:data:`OWN_TARGET_MODULES`):
   BERT-like encoders, DistilBERT, DeBERTa-v2, MPNet, ViT/DINOv2/BEiT, and the Llama-family
   decoders (all seven projections, as ``offline_math`` and ``metamath`` adapt);
2. else PEFT's own per-model mapping (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``,
   e.g. ``opt``: ``q_proj, v_proj``; ``gpt_neox``: ``query_key_value``);
3. else a one-line :class:`~fedgalore.tasks.base.TaskError` asking for
   ``task.options.target_modules``.

Our choice deviates from PEFT's mapping on purpose for the families in (1): PEFT adapts query and
value only, while every method here adapts the same, larger set (README, "Every method uses the
same target modules"), so the generic tasks on those checkpoints adapt what the paper's tasks
adapt. Only ``nn.Linear`` layers can be adapted (GaLore projects a weight matrix ``W x``):
GPT-2-style ``Conv1D`` layers cannot, and the error says so.

The classification head is every top-level module of a ``...ForSequenceClassification`` /
``...ForImageClassification`` model other than its base model (``classifier`` for BERT and ViT,
``pre_classifier`` + ``classifier`` for DistilBERT, ``pooler`` + ``classifier`` for DeBERTa-v2,
``score`` for decoders): every method trains it fully and averages it.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fedgalore.tasks.base import TaskError, head_parameters, quiet_transformers, resolve_target_modules

__all__ = [
    "OWN_TARGET_MODULES",
    "TOKENIZER_FILES",
    "quiet_transformers",
    "load_config",
    "require_tokenizer_files",
    "skeleton",
    "classifier_head_modules",
    "default_target_modules",
    "pick_target_modules",
    "init_fresh_weights",
    "load_with_head",
]

log = logging.getLogger(__name__)

_ENCODER = ("query", "value", "dense")
_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VIT = ("query", "value", "dense", "q_proj", "v_proj", "o_proj", "fc1", "fc2")  # both ViT namings

#: model_type -> target modules of our own choice (query, value, attention output, MLP)
OWN_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra"), _ENCODER),
    "distilbert": ("q_lin", "v_lin", "out_lin", "lin1", "lin2"),
    "deberta-v2": ("query_proj", "value_proj", "dense"),
    "mpnet": ("q", "v", "o", "dense"),
    **dict.fromkeys(("vit", "dinov2", "beit"), _VIT),
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2"), _LLAMA),
}

#: files of which a local model folder must hold at least one to have a tokenizer
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def load_config(model: str) -> Any:
    """The checkpoint's ``PretrainedConfig`` (a local folder with ``config.json``, or a hub id);
    one-line :class:`TaskError` naming ``task.options.model`` otherwise."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if (path.is_absolute() or str(model).startswith((".", "~"))) and not path.exists():
        raise TaskError(f"task.options.model={model!r}: no such folder")
    if path.is_dir() and not (path / "config.json").is_file():
        raise TaskError(f"task.options.model={model!r} is a folder without config.json: not a Hugging Face model folder "
                        "(save one with model.save_pretrained(FOLDER))")
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(str(path) if path.is_dir() else model)
    except (OSError, ValueError) as exc:
        raise TaskError(f"could not load the config of task.options.model={model!r} ({_first_line(exc)}); "
                        "pass a local model folder, or allow hub access (unset HF_HUB_OFFLINE)") from None


def require_tokenizer_files(model: str) -> None:
    """A local model folder must hold a tokenizer: transformers would otherwise build an empty
    vocabulary silently (every word ``[UNK]``). Hub ids are not checked (no network here)."""
    path = Path(model).expanduser()
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise TaskError(f"model folder {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...); "
                        "save the tokenizer there with tokenizer.save_pretrained(FOLDER)")


def skeleton(auto_class: Any, config: Any) -> nn.Module:
    """The architecture of ``config`` on the meta device (module names and shapes, no memory)."""
    try:
        with quiet_transformers(), torch.device("meta"):
            return auto_class.from_config(config)
    except (ValueError, KeyError) as exc:
        raise TaskError(f"{auto_class.__name__} has no model for model_type={getattr(config, 'model_type', '?')!r} "
                        f"({_first_line(exc)}); choose a checkpoint of a supported architecture") from None


def classifier_head_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the top-level modules of a classification model other than its base model (that
    hold parameters): the head every method trains fully (``classifier``, ``score``, ...)."""
    prefix = getattr(model, "base_model_prefix", "")
    heads = tuple(n for n, child in model.named_children() if n != prefix and any(True for _ in child.parameters()))
    if not heads:
        raise TaskError(f"{type(model).__name__} has no classification head outside its base model {prefix!r}")
    return heads


def default_target_modules(model_type: str) -> tuple[str, ...] | None:
    """Target modules for ``model_type``: ours (:data:`OWN_TARGET_MODULES`), else PEFT's mapping,
    else ``None``."""
    if model_type in OWN_TARGET_MODULES:
        return OWN_TARGET_MODULES[model_type]
    try:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_mapping
    except ImportError:  # pragma: no cover - peft is a core dependency
        return None
    found = peft_mapping.get(model_type)
    if found is None:
        return None
    return (found,) if isinstance(found, str) else tuple(found)


def pick_target_modules(model: nn.Module, model_type: str, override: Sequence[str] | None,
                        exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The target-module patterns of ``model`` (a :func:`skeleton` will do): ``override`` if given,
    else :func:`default_target_modules`; checked to match at least one ``nn.Linear`` outside
    ``exclude`` (one-line :class:`TaskError` naming ``task.options.target_modules`` otherwise)."""
    patterns = tuple(override) if override else default_target_modules(model_type)
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    if not patterns:
        raise TaskError(f"no default target modules for model_type={model_type!r} (neither ours nor PEFT's mapping has it); "
                        f"set task.options.target_modules to names of its linear layers: {', '.join(linear)}")
    try:
        resolve_target_modules(model, patterns, exclude=exclude)
    except TaskError:
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
        hint = " (its Conv1D layers are not nn.Linear and cannot be adapted)" if conv1d else ""
        raise TaskError(f"target modules {list(patterns)} match no nn.Linear layer of model_type={model_type!r}{hint}; "
                        f"set task.options.target_modules to names of its linear layers: {', '.join(linear) or 'none'}") from None
    return patterns


def init_fresh_weights(model: nn.Module, fresh: Callable[[str], bool], seed: int) -> None:
    """Re-initialise the parameters whose name satisfies ``fresh``, from a local generator seeded
    with ``seed``, in ``named_parameters`` order (identical draws on every call): biases 0,
    LayerNorm weights 1, other weights ``N(0, initializer_range²)`` (the config's, default 0.02,
    transformers' own ``_init_weights`` rule for linear layers)."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not fresh(name):
                continue
            if name.endswith("bias"):
                p.zero_()
            elif "LayerNorm" in name or "layer_norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def load_with_head(auto_class: Any, model_id: str, labels: Sequence[str], *, head_modules: Sequence[str],
                   checkpoint_labels: Sequence[str] | None, new_head: bool | None, seed: int, **kwargs: Any) -> tuple[nn.Module, bool]:
    """``auto_class.from_pretrained(model_id)`` with a ``len(labels)``-way head named by ``labels``
    (``config.id2label`` / ``label2id``), and whether the head was created.

    The head (``new_head``): created (seeded, :func:`init_fresh_weights`) when the checkpoint has
    none, or when ``new_head`` is true; ``None`` keeps a head of the right size whose labels
    (``config.id2label`` of the checkpoint, ``checkpoint_labels``) are ``labels`` — a folder
    exported from a run — and ``False`` keeps any head of the right size. A head of another size,
    or (``None``) for other labels, is a one-line :class:`TaskError` naming
    ``task.options.new_head``. Any other weight the checkpoint lacks is initialised the same way."""
    n = len(labels)
    try:
        with quiet_transformers():
            model, info = auto_class.from_pretrained(
                model_id, num_labels=n, id2label=dict(enumerate(labels)), label2id={c: i for i, c in enumerate(labels)},
                ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise TaskError(f"could not load model {model_id!r} ({_first_line(exc)}); "
                        "pass a local model folder, or allow hub access (unset HF_HUB_OFFLINE)") from None
    missing = set(info.get("missing_keys", ()))
    mismatched = {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())}
    head = set(head_parameters(model, head_modules))
    if mismatched - head:
        raise TaskError(f"model {model_id!r}: weights {sorted(mismatched - head)[:3]} have other shapes than its config says; "
                        "the checkpoint is inconsistent")
    if not new_head and mismatched:
        raise TaskError(f"model {model_id!r} has a classification head of another size than the {n} labels of the training data; "
                        f"set task.options.new_head: true to replace it with a fresh seeded {n}-way head")
    created = bool(new_head) or bool(missing & head)
    if not created and new_head is None and checkpoint_labels is not None and list(checkpoint_labels) != list(labels):
        raise TaskError(f"model {model_id!r} has a head for labels {list(checkpoint_labels)[:6]}, the training data has "
                        f"{list(labels)[:6]}; set task.options.new_head: true for a fresh seeded {n}-way head, "
                        "or false to keep this one (output i = label i of the data)")
    init_fresh_weights(model, lambda name: name in missing or (created and name in head), seed)
    model.eval()
    return model, created

