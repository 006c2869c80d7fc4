"""LoRA-FAIR (Bian, Wang, Zhang, Xu; ICCV 2025): FedIT's factor averaging plus a server-side
correction of B̄ so that the broadcast product matches the ideal aggregate.

T  as FedIT (clients train ``A``, ``B`` and the head from the global ``(Ā, B̄')``; no
   re-initialisation, "Avg-Initial"), but with SGD, the paper's Table 1 optimizer (lr from
   ``train.sgd_lr``, else option ``sgd_lr``, else 2e-2; momentum ``train.sgd_momentum``).
A  ``Ā = Σp_iA_i``, ``B̄ = Σp_iB_i``, target ``T = Σp_iB_iA_i`` (fp32), then a correction
   ``ΔB`` so that ``(B̄+ΔB)Ā ≈ T``; the server keeps and broadcasts ``(Ā, B̄' = B̄+ΔB)``. The base
   weight never changes; communication equals FedIT's.

   ``objective: ridge`` (default) — the exact minimiser of
   ``‖(B̄+ΔB)Ā − T‖_F² + λ‖ΔB‖_F²``:  ``ΔB = (T − B̄Ā)Āᵀ(ĀĀᵀ + λI)⁻¹``, with
   ``λ = ridge_lambda · tr(ĀĀᵀ)/r`` (relative to the mean eigenvalue of the Gram matrix, so the
   option is scale-free; default 1e-3: a near-exact least-squares fit that stays well
   conditioned; ``ridge_lambda: 0`` uses the pseudo-inverse). With Ā of full row rank this makes
   ``(B̄+ΔB)Ā`` the projection of ``T`` onto Ā's row space, the best any B can do for this Ā, and
   it strictly lowers the residual whenever ``(T − B̄Ā)Āᵀ ≠ 0``. The LoRA-FAIR method section and
   official code were not available (reference/algorithms.md §4.6, §6); the residual form is the
   paper's stated goal, ``(B̄+ΔB)Ā ≈ Σp_iB_iA_i``.

   ``objective: cosine`` — the third-party re-implementation's objective,
   ``1 − cos(vec((B̄+ΔB)Ā), vec(T)) + λ‖ΔB‖_F²`` from ``ΔB = 0`` with ``cosine_steps`` (1000)
   plain gradient steps of lr ``cosine_lr`` (1e-2), ``λ = cosine_lambda`` (1e-2), fp32. Cosine
   is scale-invariant, so it aligns the direction only and need not lower the residual norm.
S  none.

Communication: down ``LowRank(B̄', Ā)`` + head; up ``LowRank(B_i, A_i)`` + head (as FedIT).
``state.meta["correction"]`` records the mean relative residual ``‖B̄Ā − T‖/‖T‖`` before and after
the correction in the last round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from fedgalore.methods.base import MethodError, option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.fedit import FedIT
from fedgalore.methods.lora_common import LoraSGDOptions, a_key, b_key, check_weights, lifted, w_key
from fedgalore.protocol.payload import Payload
from fedgalore.protocol.state import RoundContext, ServerState

__all__ = ["LoRAFAIR", "fair_correction"]


def fair_correction(
    b_bar: torch.Tensor,
    a_bar: torch.Tensor,
    target: torch.Tensor,
    objective: str = "ridge",
    ridge_lambda: float = 1e-3,
    cosine_lambda: float = 1e-2,
    cosine_steps: int = 1000,
    cosine_lr: float = 1e-2,
) -> torch.Tensor:
    """The correction ``ΔB`` (m×r) for ``(B̄+ΔB)Ā ≈ T`` (see the module docstring), fp32."""
    b_bar, a_bar, target = b_bar.float(), a_bar.float(), target.float()
    if objective == "ridge":
        residual = target - b_bar @ a_bar
        gram = a_bar @ a_bar.T
        lam = float(ridge_lambda) * float(torch.trace(gram)) / gram.shape[0]
        rhs = a_bar @ residual.T  # (r, m) = Ā Rᵀ
        if lam > 0:
            sol = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0]), rhs)
        else:
            sol = torch.linalg.pinv(gram, hermitian=True) @ rhs
        return sol.T
    if objective == "cosine":
        delta = torch.zeros_like(b_bar, requires_grad=True)
        opt = torch.optim.SGD([delta], lr=float(cosine_lr))
        goal = target.reshape(-1)
        with torch.enable_grad():
            for _ in range(int(cosine_steps)):
                approx = ((b_bar + delta) @ a_bar).reshape(-1)
                loss = 1.0 - F.cosine_similarity(approx, goal, dim=0) + float(cosine_lambda) * delta.pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return delta.detach()
    raise MethodError(f"lora_fair: objective must be 'ridge' or 'cosine', got {objective!r}")


@dataclass(frozen=True)
class LoRAFAIROptions(LoraSGDOptions):
    objective: Literal["ridge", "cosine"] = option("ridge", "the correction's objective: exact ridge fit, or the re-implementation's cosine")
    ridge_lambda: float = option(1e-3, "ridge penalty relative to the mean eigenvalue of ĀĀᵀ (0: pseudo-inverse)")
    cosine_lambda: float = option(1e-2, "cosine objective: penalty λ on ‖ΔB‖²")
    cosine_steps: int = option(1000, "cosine objective: gradient steps")
    cosine_lr: float = option(1e-2, "cosine objective: step size")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ridge_lambda < 0 or self.cosine_lambda < 0:
            raise MethodError("options ridge_lambda and cosine_lambda must be >= 0")


@register
class LoRAFAIR(FedIT):
    name = "lora_fair"
    summary = "LoRA A,B + head with SGD; server averages factors and corrects B̄ so (B̄+ΔB)Ā ≈ Σp_iB_iA_i"
    #: A's correction uses each client's product B_iA_i: each upload is used on its own; W0 never changes
    traits = MethodTraits(optimizer="sgd", dp_aggregate="individual", explicit_adapters=True, exact_low_rank=True)
    options_class = LoRAFAIROptions
    supports_scaffold = False  # its A corrects B̄ after averaging (not FedIT's plain average)

    def correction(self, b_bar: torch.Tensor, a_bar: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        o = self.options
        return fair_correction(b_bar, a_bar, target, o.objective, o.ridge_lambda, o.cosine_lambda, o.cosine_steps, o.cosine_lr)

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``(Ā, B̄ + ΔB)``; returns ``ΔW̄ = s((B̄+ΔB)Ā − B_oldA_old)`` per matrix."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        before, after = [], []
        for m in self.targets:
            pairs = [self.upload_pair(u, m) for u in uploads]
            b_bar, a_bar = self.average_factors(uploads, p, m)
            target = sum(pi * (b @ a) for pi, (b, a) in zip(p, pairs))
            b_new = b_bar + self.correction(b_bar, a_bar, target)
            scale = float(target.norm()) or 1.0
            before.append(float((b_bar @ a_bar - target).norm()) / scale)
            after.append(float((b_new @ a_bar - target).norm()) / scale)
            old = lifted(state.params[b_key(m)], state.params[a_key(m)], self.scaling)
            delta[w_key(m)] = lifted(b_new, a_bar, self.scaling) - old
            state.params[a_key(m)], state.params[b_key(m)] = a_bar, b_new
        self.average_heads(state, uploads, p)
        state.meta["correction"] = {
            "objective": self.options.objective,
            "rel_residual_before": sum(before) / len(before),
            "rel_residual_after": sum(after) / len(after),
        }
        return delta
