"""GaLore's moments as data: matrices of one shape stacked in *buckets*, the moment step as pure
functions over a bucket (paper App. B, Alg. 1 lines 6-8: the optimizer state of the
projected gradient).

A bucket is the GaLore matrices of one parameter group whose projected state has the same
(device, shape, side) and the same optional state (per-coordinate evidence ``v_weight``, shadow cold
moment ``cold_v``). Their first moments ``M``, second moments ``V``, evidence ``c`` and cold
moments are kept stacked, ``[B, a, b]`` (state as data, as optax's ``ScaleByAdamState`` or torch's
functional ``adamw`` over lists); each matrix's optimizer state holds *views* into the stacks, so
``state_dict()`` stays per parameter and tensor-only, and checkpoints of either layout load.

:class:`MomentBuckets` keeps the stacks valid: code that *replaces* a matrix's moment tensor (a
basis refresh moving the moments, a warm start, ``load_state_dict``) breaks the view, which
:meth:`MomentBuckets.bind` notices (storage pointer per slot) and answers with a fresh stack (one
copy of ``r``-sized tensors); in-place changes (``warm_scale`` rescaling) act on the views.

:func:`adam_moments` is the moment algebra — the only copy of it in torch ops; the CPU's AVX2
kernel (:func:`fedgalore.optim.cpu_kernels.adam_moments`) is the same rule in C, used per matrix
where it applies and wins (large fp32 matrices, one thread). A bucket of ``B`` matrices costs one
kernel per elementwise op instead of ``B``: the GPU's gain (kernel launches; not measured yet). On
the CPU it buys nothing — stacking ``R`` and the bookkeeping cost about what the fewer calls save
(1.00-1.05x the per-matrix step on small matrices, benchmarks/RESULTS.md §1.2).
:func:`compiled_moments` is the same function under ``torch.compile`` (one generated kernel per
bucket; no recompilation across steps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from fedgalore.optim.state import STACKED, GaLoreParamState

__all__ = ["MomentBuckets", "MomentStack", "adam_moments", "bucket_key", "compiled_moments", "per_matrix", "stack_or_one"]

def bucket_key(state: GaLoreParamState) -> tuple:
    """Which bucket a GaLore matrix's moments belong to: device, dtype, the shape of ``M`` and of
    the evidence ``c`` (or None), and whether it has a shadow cold moment."""
    m, evidence = state.exp_avg, state.v_weight
    return (m.device, m.dtype, tuple(m.shape), None if evidence is None else tuple(evidence.shape), state.cold_v is not None)


def per_matrix(values: list[float], like: torch.Tensor, tensor: bool = False) -> torch.Tensor | float:
    """Per-matrix scalars as a ``[B, 1, 1]`` tensor that broadcasts against a bucket's stacks; the
    number itself for a bucket of one (its own tensors, not stacked) — a 0-d tensor with
    ``tensor`` (a compiled step takes its per-step numbers as tensors: no recompilation when
    they change)."""
    if len(values) == 1 and like.dim() == 2:
        return torch.tensor(values[0], dtype=like.dtype, device=like.device) if tensor else values[0]
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1, 1)


def stack_or_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors stacked ``[B, ...]``; a bucket of one is its tensor itself (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


@dataclass
class MomentStack:
    """A bucket's moments, ``[B, a, b]`` stacks (or one matrix's own tensors): ``M``, ``V`` and,
    when the bucket has them, the evidence ``c`` and the shadow cold moment."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    v_weight: Optional[torch.Tensor] = None
    cold_v: Optional[torch.Tensor] = None


class MomentBuckets:
    """The persistent stacks of an optimizer's buckets (keyed by group index and :func:`bucket_key`)."""

    def __init__(self) -> None:
        self._stacks: dict[tuple, dict[str, Any]] = {}

    def bind(self, key: tuple, states: list[GaLoreParamState]) -> MomentStack:
        """The stacks of ``states`` (one bucket, in this order), each state's tensors views into
        them: the stored stacks when every slot still is its matrix's tensor, else new stacks (the
        tensors copied in, the states re-pointed at their views)."""
        names = [n for n in STACKED if getattr(states[0], n) is not None]  # the state's fields, by name
        held = self._stacks.get(key)
        if held is not None and held["ids"] == [id(s) for s in states] and all(
            getattr(s, n).data_ptr() == ptr and getattr(s, n).shape == shape
            for n in names for s, ptr, shape in zip(states, held["slots"][n], held["shapes"][n])
        ):  # every state still holds its slot (the held stacks keep that memory theirs: no other tensor starts there)
            return MomentStack(**held["stacks"])
        stacks = {n: torch.stack([getattr(s, n) for s in states]) for n in names}
        slots: dict[str, list[int]] = {n: [] for n in names}
        for i, s in enumerate(states):
            for n in names:
                setattr(s, n, stacks[n][i])
                slots[n].append(getattr(s, n).data_ptr())
        self._stacks[key] = {"ids": [id(s) for s in states], "stacks": stacks, "slots": slots,
                             "shapes": {n: [getattr(s, n).shape for s in states] for n in names}}
        return MomentStack(**stacks)


def adam_moments(r: torch.Tensor, m: torch.Tensor, v: torch.Tensor, b1: float, b2: float, eps: torch.Tensor | float,
                 v_weight: Optional[torch.Tensor] = None, cold_v: Optional[torch.Tensor] = None,
                 cold_cap: Optional[torch.Tensor | float] = None, compat: bool = False) -> torch.Tensor:
    """One step of Adam's moments on a bucket, in place, and the direction ``U`` (App. B):

    ``M ← lerp(M, R, 1−β₁)``, ``V ← β₂V + (1−β₂) R∘R`` (the shadow ``cold_v`` alike),
    ``c ← β₂c + (1−β₂)`` for the evidence ``c``; ``U = M / (√(V/c) + ε)`` with evidence, else
    ``U = M / (√V + ε·c₂)`` (``eps`` per matrix, ``[B,1,1]``: AdamW's bias correction of ``V`` moved
    into ε, see :func:`fedgalore.optim.functional._ready`); with ``cold_cap`` (``[B,1,1]``,
    ``1/(1−β₂^s)`` or 0) the estimate is ``max(V/c, cold_cap · cold_v)`` (the aligned protocol's cap).
    ``compat``: the official galore-torch rule, ``M ← β₁M + (1−β₁)R``, ``U = M / (√V + ε)``.

    ``r``, ``m``, ``v`` (and the optional state) are ``[B, a, b]`` stacks, or one matrix's own
    tensors with ``eps`` and ``cold_cap`` plain numbers (a bucket of one is not stacked)."""
    if compat:
        m.mul_(b1).add_(r, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(r, r, value=1.0 - b2)
        return m / v.sqrt().add_(eps)
    m.lerp_(r, 1.0 - b1)
    v.mul_(b2).addcmul_(r, r, value=1.0 - b2)
    if cold_v is not None:
        cold_v.mul_(b2).addcmul_(r, r, value=1.0 - b2)
    if v_weight is None:
        return m / v.sqrt().add_(eps)
    v_weight.mul_(b2).add_(1.0 - b2)
    est = v / v_weight
    if cold_cap is not None:
        est = torch.maximum(est, cold_v * cold_cap)
    return m / est.sqrt_().add_(eps)


_COMPILED: dict[Any, Any] = {}


def compiled_moments(backend: Any):
    """:func:`adam_moments` compiled with ``torch.compile(backend=backend)`` (one compiled function
    per backend and process; ``True`` = inductor). Its per-step numbers (``eps·c₂``, the cold cap)
    must come as tensors (:func:`per_matrix` with ``tensor=True``) so that a new step, a new
    learning rate or a new bias correction reuses the compiled code; ``β₁, β₂`` and ``compat`` are
    constants of a group (a change recompiles). On a GPU the elementwise chain (about ten kernels)
    becomes one fused kernel per bucket; the refresh and the GEMMs stay outside."""
    backend = "inductor" if backend is True else backend
    key = backend if isinstance(backend, str) else id(backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(adam_moments, backend=backend)
    return _COMPILED[key]
