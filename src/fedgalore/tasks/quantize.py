"""A 4-bit or 8-bit frozen base for the LoRA methods (``task.options.quantization``), QLoRA-style.

``quantization: 4bit`` loads every ``nn.Linear`` of the checkpoint except the head (the classifier
head every method trains, or ``lm_head``) as a bitsandbytes NF4 layer with double quantisation
and the task's dtype as compute dtype; ``8bit`` as LLM.int8 layers — through transformers'
``BitsAndBytesConfig``, as FlowerTune's baselines load their bases. The model is then prepared
with PEFT's ``prepare_model_for_kbit_training`` (the remaining fp16/bf16 tensors in fp32, the base
frozen). The methods whose global model is the base plus LoRA adapters (FedIT, FFA-LoRA,
LoRA-FAIR: :attr:`~fedgalore.methods.traits.MethodTraits.explicit_adapters`) put their adapters on the
quantised layers (PEFT's ``Linear4bit`` / ``Linear8bitLt``) and train them in fp32; the methods
that change the matrices themselves (FedGaLore, FedAvg-Full, FLoRA, FR-LoRA) are refused when the
config is checked.

bitsandbytes' quantised layers run on a CUDA GPU: on a machine without one, or without the
``bitsandbytes`` package (``pip install 'fedgalore[quantization]'``), building the model is one
:class:`~fedgalore.tasks.base.TaskError` line saying so.

Memory (``fedgalore plan``): :func:`quantized_bytes` — NF4 with double quantisation stores
0.5 B per weight plus 8-bit block scales per 64 weights and an fp32 scale per 256 blocks
(≈ 0.516 B/weight); LLM.int8 stores 1 B per weight plus an fp32 scale per output row.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fedgalore.tasks.base import TaskError

__all__ = ["QUANTIZATIONS", "check_quantization", "quantization_unavailable", "quantized_load_kwargs",
           "prepare_quantized", "quantized_bytes"]

QUANTIZATIONS = ("4bit", "8bit")
#: NF4 block size and the double quantisation's second-level block (bitsandbytes' defaults)
NF4_BLOCK, NF4_BLOCK2 = 64, 256


def check_quantization(value: str | None) -> None:
    """A one-line :class:`TaskError` unless ``value`` is null, ``4bit`` or ``8bit``."""
    if value is not None and value not in QUANTIZATIONS:
        raise TaskError(f"task.options.quantization={value!r} must be one of {', '.join(QUANTIZATIONS)} (or null for none)")


def quantization_unavailable() -> str | None:
    """Why bitsandbytes cannot load a quantised model on this machine (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'fedgalore[quantization]', on a machine with a CUDA GPU)"
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU, which bitsandbytes' 4-bit and 8-bit layers need"
    return None


def quantized_load_kwargs(kind: str | None, compute_dtype: torch.dtype, skip: Sequence[str]) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load the checkpoint with its linear layers
    quantised to ``kind`` (none for ``None``), except the modules ``skip`` (the head); one-line
    :class:`TaskError` when this machine cannot (:func:`quantization_unavailable`)."""
    if kind is None:
        return {}
    check_quantization(kind)
    why = quantization_unavailable()
    if why is not None:
        raise TaskError(f"task.options.quantization={kind}: {why}; run it on a CUDA machine, or leave quantization out")
    from transformers import BitsAndBytesConfig

    skip = list(skip)
    if kind == "4bit":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return {"quantization_config": config, "device_map": {"": torch.cuda.current_device()}}


def prepare_quantized(model: Any, kind: str | None) -> Any:
    """PEFT's ``prepare_model_for_kbit_training`` on a quantised model (no gradient checkpointing
    here: the task option decides that); the model as it is when ``kind`` is None."""
    if kind is None:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quantized_bytes(shape: Sequence[int], kind: str) -> int:
    """Bytes of one ``out × in`` weight matrix stored as ``kind`` (module doc)."""
    out_f, in_f = int(shape[0]), int(shape[1])
    n = out_f * in_f
    if kind == "4bit":
        blocks = -(-n // NF4_BLOCK)
        return n // 2 + blocks + 4 * -(-blocks // NF4_BLOCK2)
    if kind == "8bit":
        return n + 4 * out_f
    raise ValueError(f"unknown quantization {kind!r}")
