"""How a GaLore step reaches bf16 / fp16 weights (group key ``low_precision``; benchmarks/RESULTS.md §1.3; module doc
of :mod:`fedgalore.optim.galore_adamw`, "Low-precision weights").

The step updates an fp32 working weight: ``p`` itself (fp32 parameters); an fp32 master copy
(``master``, 4 bytes per entry); ``p + c`` with the compensation ``c`` of what earlier roundings
lost (``compensated``, the default, 2 bytes per entry for bf16; Kahan-style); ``p`` cast to fp32
(``off``: the rounding is lost). Either of the first two keeps the client's own ``W_T − W_0``
equal to its update record to the weights' resolution (tests/optim/test_low_precision.py).
"""
from __future__ import annotations

from typing import Any

import torch

from fedgalore.optim.state import GaLoreParamState

__all__ = ["MODES", "working_weight", "store_weight"]

MODES = ("compensated", "master", "off")


def working_weight(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState) -> torch.Tensor:
    """The fp32 weight this step updates: ``p`` (fp32); the master copy (``master``); ``p + c``
    (``compensated``); ``p`` cast to fp32 (``off``)."""
    if p.dtype == torch.float32:
        return p
    mode = group["low_precision"]
    if mode == "master":
        if state.master is None:
            state.master = p.detach().float()
        return state.master
    w = p.float()
    if mode == "compensated" and state.comp is not None:
        w.add_(state.comp)
    return w


def store_weight(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, w: torch.Tensor) -> None:
    """Write the updated fp32 weight ``w`` back into ``p`` (rounded to its dtype) and, under
    ``compensated``, keep what the rounding lost, ``c = w − round(w)``, in ``p``'s dtype."""
    if w is p:
        return
    p.copy_(w)
    if group["low_precision"] == "compensated":
        lost = w.sub_(p)  # w − round(w), computed in fp32 (w is a scratch copy here)
        if state.comp is not None:
            state.comp.copy_(lost)
        else:
            state.comp = lost.to(p.dtype)
