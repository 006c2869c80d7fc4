"""Server-side validation of client uploads: a lying or broken payload is rejected, never applied.

Checks, in order (the first failure is the rejection reason, logged and written to the ledger):

1. every tensor is floating point and finite (a single NaN averaged into the global model would
   ruin the run silently);
2. entries that update a global tensor have that tensor's shape (factors: consistent shapes);
3. the key set equals the expected one (the previous accepted key set, else the round's
   majority) — missing or extra keys are rejected;
4. the method's own checks (:meth:`Method.validate_upload`: e.g. FedGaLore's basis seeds must
   belong to this round's seed chain, ranks must not exceed the configured rank)
   — :func:`validate_upload`;
5. the Frobenius norm of the client's effective update (:func:`update_norm` of the client's
   deltas, computed once by the round loop) is at most ``max_update_norm`` — :func:`norm_problem`.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import torch

from fedgalore.methods.base import Method
from fedgalore.protocol.payload import Dense, Factored, GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank
from fedgalore.protocol.state import RoundContext, ServerState
from fedgalore.sync.ajive import all_finite

__all__ = ["validate_upload", "expected_keys", "update_norm", "norm_problem"]


def _tensors(entry) -> list[tuple[str, torch.Tensor]]:
    if isinstance(entry, Dense):
        return [("tensor", entry.tensor)]
    if isinstance(entry, LowRank):
        return [("left", entry.left), ("right", entry.right)]
    if isinstance(entry, SeededLowRank):
        return [("coef", entry.coef)]
    if isinstance(entry, GaLoreUpdate):
        return [(f"term{q}.{k}", t) for q, term in enumerate(entry.terms) for k, t in _tensors(term)]
    if isinstance(entry, MomentView):
        out = [("moment", entry.moment)]
        return out + ([("basis", entry.basis)] if entry.basis is not None else [])
    if isinstance(entry, Factored):
        return [("left", entry.left), ("core", entry.core), ("right", entry.right)]
    return []


def _factor_shape_error(name: str, term, shape: tuple[int, int]) -> str | None:
    m, n = shape
    if isinstance(term, LowRank):
        if term.left.dim() != 2 or term.right.dim() != 2 or term.left.shape[0] != m or term.right.shape[1] != n or term.left.shape[1] != term.right.shape[0]:
            return f"{name}: low-rank factors {tuple(term.left.shape)}·{tuple(term.right.shape)} do not form {shape}"
    elif isinstance(term, SeededLowRank):
        c = term.coef
        ok = c.dim() == 2 and tuple(term.shape) == shape and ((term.side == "right" and c.shape[0] == m) or (term.side == "left" and c.shape[1] == n))
        if not ok or term.side not in ("left", "right"):
            return f"{name}: seeded coefficients {tuple(c.shape)} ({term.side}) do not fit {shape}"
    return None


def _shape_error(name: str, entry, target: torch.Tensor) -> str | None:
    shape = tuple(target.shape)
    if isinstance(entry, Dense):
        if tuple(entry.tensor.shape) != shape:
            return f"{name}: shape {tuple(entry.tensor.shape)} != expected {shape}"
    elif isinstance(entry, GaLoreUpdate):
        if tuple(entry.shape) != shape:
            return f"{name}: update shape {tuple(entry.shape)} != expected {shape}"
        if not math.isfinite(entry.decay):
            return f"{name}: non-finite decay"
        for term in entry.terms:
            err = _factor_shape_error(name, term, shape)
            if err:
                return err
    elif isinstance(entry, (LowRank, SeededLowRank)):
        return _factor_shape_error(name, entry, shape)
    return None


def expected_keys(accepted: Sequence[str] | None, uploads: Sequence[Payload]) -> set[str] | None:
    """The previously accepted key set (``accepted``), else the most common key set of this round."""
    if accepted is not None:
        return set(accepted)
    if not uploads:
        return None
    counts = Counter(frozenset(u.entries) for u in uploads)
    keys, n = counts.most_common(1)[0]
    return set(keys) if n * 2 > len(uploads) or len(counts) == 1 else None


def update_norm(deltas: dict[str, torch.Tensor]) -> float:
    """‖ΔW_i‖_F over one client's effective updates (:meth:`Method.client_deltas`) of all adapted
    matrices (plus dense deltas)."""
    sq = sum(float((d.double() ** 2).sum()) for d in deltas.values())
    return math.sqrt(sq)


def norm_problem(norm: float, max_update_norm: float | None) -> str | None:
    """Reason to reject an update of Frobenius norm ``norm`` (check 5), or None."""
    if max_update_norm is not None and (not math.isfinite(norm) or norm > max_update_norm):
        return f"update norm {norm:.4g} exceeds federation.max_update_norm={max_update_norm:g}"
    return None


def validate_upload(
    method: Method,
    state: ServerState,
    upload: Payload,
    ctx: RoundContext,
    keys: set[str] | None,
) -> str | None:
    """Reason the upload must be rejected by checks 1-4, or None when it passes them (the norm
    bound needs the client's deltas: :func:`norm_problem`)."""
    for name, entry in upload.entries.items():
        for part, t in _tensors(entry):
            if not torch.is_floating_point(t):
                return f"{name}.{part}: dtype {t.dtype} is not floating point"
            if not all_finite(t):  # one reduction, not a t-sized mask (0.01 s instead of 0.24 s per 30 M values)
                return f"{name}.{part}: non-finite values"
        if name in state.params:
            err = _shape_error(name, entry, state.params[name])
            if err:
                return err
    if keys is not None:
        have = set(upload.entries)
        missing, extra = sorted(keys - have), sorted(have - keys)
        if missing:
            return f"missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}"
        if extra:
            return f"unexpected keys {extra[:3]}{'...' if len(extra) > 3 else ''}"
    return method.validate_upload(state, upload, ctx) or None
