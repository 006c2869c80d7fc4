"""An exactly low-rank update as an exact LoRA adapter (``fedgalore export --format peft --exact``).

A method whose server moves each adapted matrix only by low-rank steps has an accumulated update
``ΔW = W_T − W_0`` of rank at most the sum of its rounds' ranks:

* FedGaLore (and FedGaLore⁻, mean sync): each round adds ``Σ_i p_i Σ_q L_iq R_iq`` — rank ≤ r per
  data-driven projector term of every client, plus r per seeded basis shared by the clients — and
  the decoupled weight decay ``decay·W``, which is full rank: so only a run with
  ``train.weight_decay: 0`` is exactly low-rank;
* FLoRA (``s·Σ_i p_i B_i A_i`` per round) and FR-LoRA (``s(B̄Ā − B0A0)`` per round);
* FedIT, FFA-LoRA, LoRA-FAIR: rank ≤ r (their own adapter, ``--format peft``, is already exact).

FedAvg-Full (a dense update) and a server optimizer that rescales the aggregate elementwise
(FedAdam, FedYogi, FedAdagrad) are not exactly low-rank: :func:`exact_problem` says why in one line.

**Where the update comes from, and why that is exact.** The run keeps ``W_0`` (the pretrained
matrices, which every process rebuilds bit for bit from the task) and ``W_T`` (the checkpoint).
The factored downlink's chain is no source: the server keeps only the newest updates whose bytes
stay below the dense matrix's (:func:`fedgalore.protocol.downlink.record_update`), and none under
``downlink: dense``. So the adapter is computed from ``ΔW = W_T − W_0`` in float64 (the
subtraction exact), by a full SVD ``ΔW = U S Vᵀ`` cut at the numerical rank ``k``: the singular
values above the rounding floor of ``W_T`` — ``W_T`` is stored in fp32, each of the run's ``T``
rounds rounded every entry by up to ``u|W_ij|`` (``u = 2⁻²⁴``), so the rounding matrix has spectral
norm about ``u·rms(W_T)·(√m + √n)·√T``; :data:`FLOOR_MARGIN` times that is the cut. What is dropped is
rounding, not update: ``B = U_k S_k^{1/2}``, ``A = S_k^{1/2} V_kᵀ`` (fp32) give ``W_0 + BA = W_T``
to fp32 rounding, which the export checks on the logits (the same strict tolerance as every
``peft`` export) before it keeps the folder. Each matrix gets its own rank (PEFT ``rank_pattern``)
and ``lora_alpha`` = its rank (scaling 1); a matrix the run did not change is left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ExactFactors", "exact_factors", "exact_problem", "FLOOR_MARGIN", "exact_methods"]

#: the cut: this many times the expected spectral norm of the run's fp32 rounding of W_T
FLOOR_MARGIN = 8.0
#: server optimizers that keep the aggregate a linear combination of the rounds' updates
_LINEAR_SERVER = ("fedavg", "fedavgm")


@dataclass
class ExactFactors:
    """``B`` (m×k) and ``A`` (k×n) with ``BA = ΔW`` to rounding, and what the cut measured."""

    b: torch.Tensor
    a: torch.Tensor
    #: k: singular values of ΔW above the rounding floor
    numerical_rank: int
    #: the cut (absolute singular value)
    floor: float
    #: the largest singular value dropped (0 when none), and the smallest kept (0 when none)
    largest_dropped: float
    smallest_kept: float
    #: ‖ΔW − BA‖_F / ‖ΔW‖_F (0 for ΔW = 0)
    rel_error: float

    @property
    def rank(self) -> int:
        return self.numerical_rank


def exact_methods() -> list[str]:
    """The registered methods whose update is exactly low-rank (:attr:`~fedgalore.methods.traits.MethodTraits.
    exact_low_rank`), under the conditions :func:`exact_problem` checks."""
    from fedgalore.methods.base import available_methods, method_class

    return [m for m in available_methods() if method_class(m).traits.exact_low_rank]


def exact_problem(method: str, cfg: Any) -> str | None:
    """Why the update of a run of ``method`` with config ``cfg`` is not exactly low-rank (one line
    that says what to change), or None when it is."""
    from fedgalore.methods.base import available_methods, method_class

    traits = method_class(method).traits if method in available_methods() else None
    if traits is None or not traits.exact_low_rank:
        return (f"method {method!r} trains the dense matrices (its update has full rank in general), so it has no exact "
                "LoRA form; export --format hf, or --format peft --rank R for a truncated one")
    server = cfg.federation.server_optimizer.name
    if server not in _LINEAR_SERVER:
        return (f"federation.server_optimizer.name={server} rescales the aggregate elementwise, so the run's update is not "
                "low-rank; export --format hf, or --format peft --rank R")
    if traits.decay_in_upload and float(cfg.train.weight_decay) != 0.0:
        return (f"this run used train.weight_decay={cfg.train.weight_decay:g}: FedGaLore's decoupled decay adds decay·W every "
                "step, a full-rank change, so W_T − W_0 is not low-rank; train with train.weight_decay=0 for an exact "
                "adapter, or export --format peft --rank R (truncated) or --format hf")
    return None


@torch.no_grad()
def exact_factors(w_now: torch.Tensor, w0: torch.Tensor, rounds: int, device: str = "cpu") -> ExactFactors:
    """The exact LoRA factors of ``w_now − w0`` (module doc); ``rounds``: the rounds that moved
    ``w_now`` (each one fp32 rounding of every entry). The SVD runs in float64 on ``device``."""
    now = w_now.detach().to(device=device, dtype=torch.float64)
    delta = now - w0.detach().to(device=device, dtype=torch.float64)
    m, n = delta.shape
    u = 2.0 ** -24
    rms = float(now.pow(2).mean().sqrt()) if now.numel() else 0.0
    floor = FLOOR_MARGIN * u * rms * (math.sqrt(m) + math.sqrt(n)) * math.sqrt(max(int(rounds), 1))
    norm = float(torch.linalg.matrix_norm(delta))
    if norm == 0.0:
        empty_b, empty_a = torch.zeros(m, 0), torch.zeros(0, n)
        return ExactFactors(empty_b, empty_a, 0, floor, 0.0, 0.0, 0.0)
    uu, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = int((s > floor).sum())
    root = s[:k].sqrt()
    b = (uu[:, :k] * root).float().cpu().contiguous()
    a = (root[:, None] * vh[:k]).float().cpu().contiguous()
    rest = s[k:]
    err = float(torch.linalg.matrix_norm(delta - (b.double().to(device) @ a.double().to(device)))) / norm
    return ExactFactors(b, a, k, floor, float(rest[0]) if rest.numel() else 0.0, float(s[k - 1]) if k else 0.0, err)
