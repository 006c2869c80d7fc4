"""A run that starts from a PEFT LoRA adapter (``task.options.model`` an adapter folder;
:mod:`fedgalore.tasks.generic.adapter`).

The task builds the adapter's base with the adapter's other tensors in place and sets its LoRA
factors aside (``task.start_adapter``: per layer ``(B, A)`` and ``s``). The round loop's global
model at round 0 is then the adapter's model ``W0 + s·BA``, reached per method:

* the methods whose global model is the base plus LoRA adapters
  (:attr:`~fedgalore.methods.traits.MethodTraits.explicit_adapters`: FedIT, FFA-LoRA, LoRA-FAIR) train
  the adapter further: after ``setup`` its factors replace the fresh ones
  (:meth:`~fedgalore.methods.lora_common.LoraMethod.start_from`; same rank and scaling needed).
  ``W0`` stays the base, so an export ``--format peft`` is an adapter of the same base;
* every other method (FedGaLore and its variants, FedAvg-Full, FLoRA, FR-LoRA) changes the
  matrices themselves, so the adapter is merged first, ``W ← W + s·BA`` (:func:`merge_start_adapter`),
  and training starts from those weights.

Every process (sequential, Ray, Flower) builds its :class:`~fedgalore.engine.runtime.Runtime` the
same way, so all start from the same model.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fedgalore.methods.base import Method
from fedgalore.methods.traits import StartsFromAdapter

__all__ = ["continues_adapter", "merge_start_adapter", "start_adapter_of"]

log = logging.getLogger("fedgalore")


def start_adapter_of(task: Any) -> Any:
    """The task's starting adapter (``task.start_adapter``; None for a task built from a model)."""
    return getattr(task, "start_adapter", None)


def continues_adapter(method: Method) -> bool:
    """Whether ``method`` trains a starting adapter further (else it starts from the merged weights)."""
    return method.traits.explicit_adapters and isinstance(method, StartsFromAdapter)


@torch.no_grad()
def merge_start_adapter(model: nn.Module, start: Any) -> None:
    """``W ← W + s·BA`` for every layer of the starting adapter (fp32 arithmetic, stored in W's dtype)."""
    for name, (b, a) in start.factors.items():
        w = model.get_submodule(name).weight
        merged = w.detach().float() + float(start.scaling[name]) * (b.float().to(w.device) @ a.float().to(w.device))
        w.copy_(merged.to(w.dtype))
