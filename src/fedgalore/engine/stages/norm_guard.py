"""The update-norm guard (``federation.max_update_norm``, ``federation.clip_update_norm``) as a
round stage: each valid upload's ‖ΔW_i‖_F over all adapted matrices (plus dense deltas;
:func:`~fedgalore.engine.validation.update_norm`, from the dense deltas built once per client)
rejects an upload above ``max_update_norm`` (or non-finite) and scales one above
``clip_update_norm`` down to it (:meth:`~fedgalore.methods.base.Method.scale_upload`: the upload
and its ΔW_i by C/‖ΔW_i‖; its record keeps ``clipped_from_norm``).
"""
from __future__ import annotations

from typing import Any

from fedgalore.engine.stages.base import Contribution, RoundStage, RunView
from fedgalore.engine.validation import norm_problem, update_norm

__all__ = ["NormGuard"]


class NormGuard(RoundStage):
    """``federation.max_update_norm`` / ``clip_update_norm`` (module doc)."""

    name = "norm_guard"
    server_only = True
    needs_deltas = True

    def __init__(self, max_norm: float | None, clip: float | None, method: Any) -> None:
        self.max_norm, self.clip, self.method = max_norm, clip, method

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "NormGuard | None":
        fed = cfg.federation
        if fed.max_update_norm is None and fed.clip_update_norm is None:
            return None
        return cls(fed.max_update_norm, fed.clip_update_norm, run.method)

    def check(self, item: Contribution, rec: dict[str, Any]) -> str | None:
        norm = update_norm(item.delta)
        reason = norm_problem(norm, self.max_norm)
        if reason is None and self.clip is not None and norm > self.clip:
            factor = self.clip / norm
            item.upload = self.method.scale_upload(item.upload, factor)
            item.delta = {k: d * factor for k, d in item.delta.items()}
            rec["clipped_from_norm"] = norm
        return reason
