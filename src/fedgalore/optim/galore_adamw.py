"""GaLore-AdamW: AdamW in a rank-``r`` gradient subspace (paper App. B, Alg. 1; DESIGN §3.1).

For a GaLore weight ``W (m x n)`` with basis ``P`` (right side, ``P (r x n)``; the left side is
the mirror image, see :mod:`fedgalore.optim.projector`) one step ``t`` is::

    R_t = G_t P^T                                       (m x r)
    M_t = b1 M_{t-1} + (1 - b1) R_t
    V_t = b2 V_{t-1} + (1 - b2) R_t * R_t
    U_t = M_t / (sqrt(V_t / c2_t) + eps),   c2_t = 1 - b2^s   (c2_t = 1 when V was warm-started)
    W_t = (1 - lr_t wd) W_{t-1} - (lr_t / (1 - b1^t)) * scale * U_t P

i.e. torch AdamW (decoupled decay applied before the update) with the moments kept in the
projected shape. ``s`` counts steps since the second moment last started cold (start or a
``reset`` transfer); ``t`` is the step count of the first moment.

Refreshes happen at local steps ``0, tau, 2 tau, ...`` (``update_proj_gap = tau``). At a refresh
with an old basis the moments move to the new coordinates, ``C = P_old P_new^T`` (right) /
``C = P_new^T P_old`` (left): ``M <- M C`` and, by ``moment_transfer``, ``V <- max(V C, 0)``
(``linear``, the paper's literal rule), ``V <- V (C∘C)`` (``squared``, the default), ``keep`` or
``reset``.

Second-moment bias correction: a cold ``V`` (zeros at start or after ``reset``) is corrected
with ``1 - b2^s``; a ``V`` warm-started by :meth:`GaLoreAdamW.load_second_moment` (the server's
synchronised state, paper Alg. 1 line "Broadcast vbar") is already an estimate of the second
moment and is used uncorrected. The first moment always starts cold and is corrected as AdamW.

Projector kinds (group key ``projector``): ``identity`` (basis ``I`` of the projected side's
full dimension, ``rank`` ignored, never refreshed: exactly AdamW when ``scale = 1``), ``svd``, ``rsvd``, ``random`` (seeded Haar), ``svd_then_random`` and
``rsvd_then_random`` (the paper's SVD-to-random schedule, App. E: the first
``adaptive_proj_steps`` refreshes are data-driven, the rest seeded random).

``adaptive_scope``: ``"round"`` (default) counts those refreshes per optimizer lifetime, which is
one round because the federation builds a fresh optimizer per client per round; ``"global"``
counts them from :meth:`GaLoreAdamW.set_global_refresh_offset` ``(n)`` onwards, where ``n`` is
the number of refreshes this client performed in earlier rounds, so the switch happens once per
training run. Seeds always use the local refresh index ``q``:
``seed = derive_seed(projection_seed, name, q)``.

``galore_torch_compat=True`` reproduces the official ``galore_torch.GaLoreAdamW`` rule instead
(reference/algorithms.md §1.2): ``denom = sqrt(V) + eps``, step size
``lr sqrt(1 - b2^t) / (1 - b1^t)``, ``W <- W - step * scale * U P`` then ``W <- W - lr wd W``,
no moment transfer (the moments are kept across refreshes), and the same for plain groups.

Optimizer state holds tensors and plain Python numbers only (side is stored as ``0=right,
1=left``), so ``state_dict()`` loads with ``torch.load(weights_only=True)``. GaLore state
(moments, bases, update record) is always fp32, also for bf16 parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from fedgalore.federated.payload import GaLoreUpdate, LowRank, MomentView, SeededLowRank
from fedgalore.optim.projector import (
    PROJ_TYPES,
    SIDES,
    change_of_basis,
    derive_seed,
    project,
    project_back,
    resolve_side,
    rsvd_basis,
    seeded_basis,
    svd_basis,
)

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta", "PROJECTORS", "MOMENT_TRANSFERS"]

PROJECTORS = ("identity", "svd", "rsvd", "random", "svd_then_random", "rsvd_then_random")
MOMENT_TRANSFERS = ("linear", "squared", "keep", "reset")
_SCOPES = ("round", "global")
_NONFINITE = ("raise", "skip")

#: Defaults filled into every group that has ``rank`` (the official package's keys first).
GALORE_DEFAULTS: dict[str, Any] = {
    "update_proj_gap": 200,
    "scale": 1.0,
    "proj_type": "std",
    "projector": "svd",
    "adaptive_proj_steps": 1,
    "adaptive_scope": "round",
    # Provisional default: non-negative by construction (reference §2.6(d)); DESIGN §3.1 leaves the
    # final choice to the reproduction measurement.
    "moment_transfer": "squared",
    "rsvd_oversample": 8,
    "rsvd_niter": 2,
}


@dataclass(frozen=True)
class GaLoreStateEntry:
    """Exported optimizer state of one GaLore parameter (:meth:`GaLoreAdamW.export_state`).

    ``exp_avg_sq`` is the projected second moment ``v`` ((m x r) right / (r x n) left); its
    full-space matrix view is ``V = v P`` (right) or ``P v`` (left) (paper eq. "matrix view").
    ``basis`` is always the current basis matrix (``None`` before the first refresh); ``seed``
    and ``refresh_index`` identify it when it is seeded (``seed is None`` for data-driven bases).
    """

    name: str
    shape: tuple[int, int]
    side: str
    rank: int
    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    basis: Optional[torch.Tensor]
    seed: Optional[int]
    refresh_index: Optional[int]
    projection_seed: int
    warm: bool

    def moment_view(self, with_basis: Optional[bool] = None) -> MomentView:
        """Payload view of ``v``; the basis matrix travels only for data-driven bases by default."""
        if with_basis is None:
            with_basis = self.seed is None
        if self.basis is None:
            raise ValueError(f"parameter {self.name!r} has no basis yet (no refresh happened)")
        return MomentView(
            self.exp_avg_sq.detach().float().cpu(),
            self.side,
            self.shape,
            self.basis.detach().float().cpu() if with_basis else None,
            self.seed,
        )


def rebuild_delta(update: GaLoreUpdate, w0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense ``ΔW = decay · W0 + Σ_q term_q`` from an exact update record (DESIGN §3.1).

    ``term_q = C_q P_q`` (right) or ``P_q C_q`` (left), with ``P_q`` rebuilt from its seed for
    seeded terms. ``w0`` is needed when weight decay was on (``decay != 0``). Returns fp32 CPU.
    """
    return update.materialize(None if w0 is None else w0.detach().cpu())


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _copy_state(value: Any, device: torch.device) -> Any:
    """Deep copy of loaded state keeping tensor dtypes (torch would cast to the param dtype)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: _copy_state(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_state(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_state(v, device) for v in value)
    return value


class GaLoreAdamW(Optimizer):
    """AdamW with GaLore gradient-subspace groups (paper App. B; DESIGN §3.1).

    Param groups with ``rank`` are GaLore groups (keys of the official package: ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type`` in ``std | reverse_std | left | right``, plus
    ``projector``, ``adaptive_proj_steps``, ``adaptive_scope``, ``moment_transfer``,
    ``rsvd_oversample``, ``rsvd_niter``; defaults in :data:`GALORE_DEFAULTS`). Groups without
    ``rank`` are plain AdamW with torch's conventions (``lr``, ``betas``, ``eps``,
    ``weight_decay``; defaults as ``torch.optim.AdamW``).

    Keys valid for every group: ``galore_torch_compat`` (official update rule), ``correct_bias``
    (compat only), ``projection_seed`` (round seed ``s_k``), ``global_refresh_offset``,
    ``nonfinite`` (``"raise"``: ``FloatingPointError`` naming the parameter; ``"skip"``: that
    parameter's update and state are left untouched for this step and ``state["skipped"]``
    counts it).

    Parameter identity is its name: pass named parameters (``(name, tensor)`` tuples, stored by
    torch as ``group["param_names"]``); otherwise ``"g{group}.p{index}"``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        galore_torch_compat: bool = False,
        correct_bias: bool = True,
        projection_seed: int = 0,
        nonfinite: str = "raise",
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        self._names: dict[torch.Tensor, str] = {}
        self._by_name: dict[str, torch.Tensor] = {}
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "galore_torch_compat": bool(galore_torch_compat),
            "correct_bias": bool(correct_bias),
            "projection_seed": int(projection_seed),
            "global_refresh_offset": 0,
            "nonfinite": nonfinite,
        }
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and names
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, fill GaLore defaults when it has ``rank``, validate, and name its params."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        if group["nonfinite"] not in _NONFINITE:
            raise ValueError(f"unknown nonfinite policy {group['nonfinite']!r}; expected one of {_NONFINITE}")
        names = group.get("param_names") or [f"g{gi}.p{i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            if name in self._by_name:
                raise ValueError(f"duplicate parameter name {name!r}")
            self._names[p] = name
            self._by_name[name] = p
        if "rank" not in group:
            return
        for k, v in GALORE_DEFAULTS.items():
            group.setdefault(k, v)
        rank = group["rank"]
        if not _is_int(rank) or rank <= 0:
            raise ValueError(f"GaLore group {gi}: rank must be a positive int, got {rank!r}")
        if group["projector"] not in PROJECTORS:
            raise ValueError(f"unknown projector {group['projector']!r}; expected one of {PROJECTORS}")
        if group["proj_type"] not in PROJ_TYPES:
            raise ValueError(f"unknown proj_type {group['proj_type']!r}; expected one of {PROJ_TYPES}")
        if group["moment_transfer"] not in MOMENT_TRANSFERS:
            raise ValueError(
                f"unknown moment_transfer {group['moment_transfer']!r}; expected one of {MOMENT_TRANSFERS}"
            )
        if group["adaptive_scope"] not in _SCOPES:
            raise ValueError(f"unknown adaptive_scope {group['adaptive_scope']!r}; expected one of {_SCOPES}")
        if not _is_int(group["update_proj_gap"]) or group["update_proj_gap"] < 1:
            raise ValueError(f"update_proj_gap must be an int >= 1, got {group['update_proj_gap']!r}")
        if not _is_int(group["adaptive_proj_steps"]) or group["adaptive_proj_steps"] < 0:
            raise ValueError(f"adaptive_proj_steps must be an int >= 0, got {group['adaptive_proj_steps']!r}")
        for p in group["params"]:
            if p.dim() != 2:
                raise ValueError(
                    f"GaLore parameter {self._names[p]!r} must be 2-D (a weight matrix), got shape {tuple(p.shape)}"
                )

    def param_name(self, p: torch.Tensor) -> str:
        """The identity (name) used for ``p`` in seeds and exports."""
        return self._names[p]

    def set_projection_seed(self, seed: int) -> None:
        """Set the round seed ``s_k`` (paper Alg. 1) used by every later refresh of every group.

        Seeded basis of parameter ``name`` at local refresh ``q``:
        ``seeded_basis(derive_seed(seed, name, q), m, n, r, side)``.
        """
        if not _is_int(seed):
            raise TypeError(f"projection seed must be an int, got {type(seed).__name__}")
        for g in self.param_groups:
            g["projection_seed"] = int(seed)

    def set_global_refresh_offset(self, n: int) -> None:
        """Refreshes already done in earlier rounds, for groups with ``adaptive_scope="global"``.

        Refresh ``q`` of this optimizer is data-driven iff ``n + q < adaptive_proj_steps``
        (``"round"`` scope ignores ``n``: data-driven iff ``q < adaptive_proj_steps``).
        """
        if not _is_int(n) or n < 0:
            raise ValueError(f"global refresh offset must be an int >= 0, got {n!r}")
        for g in self.param_groups:
            g["global_refresh_offset"] = int(n)

    def _galore_items(self) -> Iterable[tuple[str, torch.Tensor, dict[str, Any]]]:
        for group in self.param_groups:
            if "rank" in group:
                for p in group["params"]:
                    yield self._names[p], p, group

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if state:
            return state
        state["step"] = 0
        state["skipped"] = 0
        if "rank" not in group:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return state
        m, n = p.shape
        side = resolve_side((m, n), group["proj_type"])
        if group["projector"] == "identity":
            rank = n if side == "right" else m
        else:
            rank = min(group["rank"], m, n)
        shape = (m, rank) if side == "right" else (rank, n)
        if group["projector"] == "identity":
            shape = (m, n)
        state.update(
            side=SIDES.index(side),
            rank=rank,
            v_step=0,
            v_warm=0,
            refresh=0,
            basis_seed=-1,
            basis_refresh=-1,
            exp_avg=torch.zeros(shape, dtype=torch.float32, device=p.device),
            exp_avg_sq=torch.zeros(shape, dtype=torch.float32, device=p.device),
            rec_on=0,
        )
        return state

    def _has_basis(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return group["projector"] == "identity" or "basis" in state

    def _basis_kind(self, group: dict[str, Any], q: int) -> str:
        kind = group["projector"]
        if kind.endswith("_then_random"):
            idx = q + (group["global_refresh_offset"] if group["adaptive_scope"] == "global" else 0)
            return kind.split("_")[0] if idx < group["adaptive_proj_steps"] else "random"
        return kind

    def _refresh(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], g32: torch.Tensor) -> None:
        """New basis at local refresh ``q``; moment transfer / pending warm start; record term."""
        name = self._names[p]
        m, n = p.shape
        side = SIDES[state["side"]]
        rank = state["rank"]
        q = state["refresh"]
        kind = self._basis_kind(group, q)
        seed = -1
        if kind == "random":
            seed = derive_seed(group["projection_seed"], name, q)
            new = seeded_basis(seed, m, n, rank, side).to(p.device)
        elif kind == "rsvd":
            rseed = derive_seed(group["projection_seed"], name + "#rsvd", q)
            new = rsvd_basis(g32, rank, side, rseed, group["rsvd_oversample"], group["rsvd_niter"])
        else:
            new = svd_basis(g32, rank, side)
        old = state.get("basis")
        if state["rec_on"]:
            self._close_term(state)
        if old is not None and not group["galore_torch_compat"]:
            c = change_of_basis(old, new, side)
            mt = group["moment_transfer"]
            mul = (lambda x, y: x @ y) if side == "right" else (lambda x, y: y @ x)
            state["exp_avg"] = mul(state["exp_avg"], c)
            if mt == "linear":
                state["exp_avg_sq"] = mul(state["exp_avg_sq"], c).clamp_(min=0.0)
            elif mt == "squared":
                state["exp_avg_sq"] = mul(state["exp_avg_sq"], c * c)
            elif mt == "reset":
                state["exp_avg_sq"].zero_()
                state["v_step"] = 0
                state["v_warm"] = 0
        state["basis"] = new
        state["basis_seed"] = seed
        state["basis_refresh"] = q
        state["refresh"] = q + 1
        if "warm_core" in state:
            self._apply_warm(state, side, state.pop("warm_left"), state.pop("warm_core"), state.pop("warm_right"))
        if state["rec_on"]:
            self._open_term(state)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step over all groups (equations in the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"GaLoreAdamW does not support sparse gradients ({self._names[p]!r})")
                state = self._init_state(p, group)
                if "rank" in group:
                    self._galore_step(p, group, state)
                else:
                    self._adamw_step(p, group, state)
        return loss

    def _nonfinite(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], x: torch.Tensor) -> bool:
        """True when ``x`` has NaN/Inf and the policy is ``skip``; raises under ``raise``.

        Fast path: a finite sum proves every entry finite (NaN/Inf propagate through a sum); only
        a non-finite sum (possibly an fp32 overflow of finite entries) triggers the full check.
        """
        if bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all()):
            return False
        if group["nonfinite"] == "raise":
            raise FloatingPointError(f"non-finite gradient for parameter {self._names[p]!r} at step {state['step']}")
        state["skipped"] += 1
        return True

    def _adamw_step(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Plain AdamW (torch convention; HF/official convention under compat)."""
        g = p.grad
        if self._nonfinite(p, group, state, g):
            return
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        t = state["step"]
        if group["galore_torch_compat"]:
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = v.sqrt().add_(eps)
            step_size = lr
            if group["correct_bias"]:
                step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
            p.add_(m / denom, alpha=-step_size)
            if wd > 0.0:
                p.add_(p, alpha=-lr * wd)
            return
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v.sqrt() / math.sqrt(1.0 - b2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1.0 - b1**t))

    def _galore_step(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        g = p.grad
        g32 = g if g.dtype == torch.float32 else g.float()
        side = SIDES[state["side"]]
        identity = group["projector"] == "identity"
        compat = group["galore_torch_compat"]
        if not identity and (state["step"] % group["update_proj_gap"] == 0 or "basis" not in state):
            if self._nonfinite(p, group, state, g32):
                return
            self._refresh(p, group, state, g32)
        basis = None if identity else state["basis"]
        r = g32 if identity else project(g32, basis, side)
        if self._nonfinite(p, group, state, r):
            return
        lr, wd, eps, scale = float(group["lr"]), group["weight_decay"], group["eps"], group["scale"]
        b1, b2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        state["v_step"] += 1
        t = state["step"]
        decay = 1.0 - lr * wd
        if compat:
            m.mul_(b1).add_(r, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(r, r, value=1.0 - b2)
            denom = v.sqrt().add_(eps)
            step_size = lr
            if group["correct_bias"]:
                step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
            u = m / denom
            full = (u if identity else project_back(u, basis, side)) * scale
            if p.dtype == torch.float32:
                p.add_(full, alpha=-step_size)
                if wd > 0.0:
                    p.add_(p, alpha=-lr * wd)
            else:
                w = p.float().add_(full, alpha=-step_size)
                if wd > 0.0:
                    w.add_(w, alpha=-lr * wd)
                p.copy_(w)
            if state["rec_on"]:
                self._record(state, u, -step_size * scale, decay if wd > 0.0 else 1.0, after=True)
            return
        m.lerp_(r, 1.0 - b1)
        v.mul_(b2).addcmul_(r, r, value=1.0 - b2)
        if state["v_warm"]:
            denom = v.sqrt().add_(eps)
        else:
            denom = (v.sqrt() / math.sqrt(1.0 - b2 ** state["v_step"])).add_(eps)
        u = m / denom
        coef = -lr / (1.0 - b1**t) * scale
        w = p if p.dtype == torch.float32 else p.float()
        if decay != 1.0:  # a separate pass is faster than addmm's beta on CPU (benchmarks/optimizer_step.py)
            w.mul_(decay)
        if identity:
            w.add_(u, alpha=coef)
        elif side == "right":
            w.addmm_(u, basis, alpha=coef)
        else:
            w.addmm_(basis, u, alpha=coef)
        if w is not p:
            p.copy_(w)
        if state["rec_on"]:
            self._record(state, u, coef, decay, after=False)

    # ------------------------------------------------------------------ update record
    def _open_term(self, state: dict[str, Any]) -> None:
        state["rec_coef"] = torch.zeros_like(state["exp_avg"])
        state["rec_n"] = 0

    def _close_term(self, state: dict[str, Any]) -> None:
        if "rec_coef" not in state:
            return
        coef = state.pop("rec_coef")
        if state.pop("rec_n") > 0:
            term = {"coef": coef, "factor": 1.0, "seed": state["basis_seed"]}
            if state["basis_seed"] < 0 and "basis" in state:
                term["basis"] = state["basis"]
            state["rec_terms"].append(term)

    def _record(self, state: dict[str, Any], u: torch.Tensor, alpha: float, decay: float, after: bool) -> None:
        """Keep ``ΔW = (a_t - 1) W0 + Σ_q f_q C_q P_q`` exact under decay ``d_t = 1 - lr_t wd``.

        torch order (decay, then update): ``C <- d C + alpha U``; compat order (update, then
        decay): ``C <- d (C + alpha U)``. Every step ``a <- d a`` and each closed term's factor
        ``f_q <- d f_q``.
        """
        c = state["rec_coef"]
        if after:
            c.add_(u, alpha=alpha)
            if decay != 1.0:
                c.mul_(decay)
        else:
            if decay != 1.0:
                c.mul_(decay)
            c.add_(u, alpha=alpha)
        state["rec_n"] += 1
        if decay != 1.0:
            state["rec_A"] *= decay
            for term in state["rec_terms"]:
                term["factor"] *= decay

    def mark(self) -> None:
        """Start recording the exact low-rank update ``W_T - W_0`` of every GaLore parameter."""
        for _, p, group in self._galore_items():
            state = self._init_state(p, group)
            state["rec_on"] = 1
            state["rec_A"] = 1.0
            state["rec_terms"] = []
            state.pop("rec_coef", None)
            state.pop("rec_n", None)
            if self._has_basis(group, state):
                self._open_term(state)

    def export_update(self) -> dict[str, GaLoreUpdate]:
        """Per GaLore parameter name, ``ΔW = decay·W0 + Σ_q term_q`` since :meth:`mark`.

        Seeded bases give ``SeededLowRank(coef, seed, side, shape)``; data-driven bases give
        ``LowRank(coef, P)`` (right) / ``LowRank(P, coef)`` (left); identity uses ``P = I``.
        ``decay = Π_t (1 - lr_t wd) - 1``. Exact up to fp32 rounding for fp32 parameters (for
        bf16 parameters the rounding of ``W`` to bf16 is not part of the record).
        """
        out: dict[str, GaLoreUpdate] = {}
        for name, p, group in self._galore_items():
            state = self.state.get(p, {})
            if not state.get("rec_on"):
                raise RuntimeError(f"export_update() without mark() for parameter {name!r}")
            shape = (int(p.shape[0]), int(p.shape[1]))
            side = SIDES[state["side"]]
            terms: list[Any] = []
            current = []
            if "rec_coef" in state and state["rec_n"] > 0:
                cur = {"coef": state["rec_coef"], "factor": 1.0, "seed": state["basis_seed"]}
                if "basis" in state and state["basis_seed"] < 0:
                    cur["basis"] = state["basis"]
                current = [cur]
            for term in list(state["rec_terms"]) + current:
                coef = (term["coef"] * term["factor"]).detach().cpu()
                if term["seed"] >= 0:
                    terms.append(SeededLowRank(coef, int(term["seed"]), side, shape))
                    continue
                basis = term.get("basis")
                if basis is None:  # identity projector
                    basis = torch.eye(shape[1] if side == "right" else shape[0])
                basis = basis.detach().float().cpu().clone()
                terms.append(LowRank(coef, basis) if side == "right" else LowRank(basis, coef))
            out[name] = GaLoreUpdate(float(state["rec_A"]) - 1.0, tuple(terms), shape)
        return out

    # ------------------------------------------------------------------ state export / warm start
    def export_state(self) -> dict[str, GaLoreStateEntry]:
        """Per GaLore parameter name: projected moments, shape/side and basis identity."""
        out: dict[str, GaLoreStateEntry] = {}
        for name, p, group in self._galore_items():
            state = self._init_state(p, group)
            side = SIDES[state["side"]]
            if group["projector"] == "identity":
                d = p.shape[1] if side == "right" else p.shape[0]
                basis: Optional[torch.Tensor] = torch.eye(d, device=p.device)
            else:
                basis = state.get("basis")
            seeded = state["basis_seed"] >= 0
            out[name] = GaLoreStateEntry(
                name=name,
                shape=(int(p.shape[0]), int(p.shape[1])),
                side=side,
                rank=int(state["rank"]),
                step=int(state["step"]),
                exp_avg=state["exp_avg"].detach().clone(),
                exp_avg_sq=state["exp_avg_sq"].detach().clone(),
                basis=None if basis is None else basis.detach().clone(),
                seed=int(state["basis_seed"]) if seeded else None,
                refresh_index=int(state["basis_refresh"]) if seeded else None,
                projection_seed=int(group["projection_seed"]),
                warm=bool(state["v_warm"]),
            )
        return out

    def _apply_warm(
        self, state: dict[str, Any], side: str, left: torch.Tensor, core: torch.Tensor, right: torch.Tensor
    ) -> None:
        basis = state.get("basis")
        if basis is None:  # identity
            v = left @ core @ right.T
        elif side == "right":
            v = left @ (core @ (right.T @ basis.T))
        else:
            v = (basis.T @ left) @ core @ right.T
        state["exp_avg_sq"] = v.clamp_(min=0.0).contiguous()
        state["v_warm"] = 1

    def load_second_moment(self, name: str, left: torch.Tensor, core: torch.Tensor, right: torch.Tensor) -> None:
        """Warm-start ``v`` from a factored full-space second moment ``V = left @ core @ right^T``.

        ``left (m x a)``, ``core (a x b)``, ``right (n x b)`` (e.g. the server's synchronised
        ``vbar``, DESIGN §3.2). Projected onto the current basis, or onto the first basis at the
        first refresh when none exists yet: right side ``v = V P^T = left core (right^T P^T)``,
        left side ``v = P^T V``; then ``v <- max(v, 0)``. For a shared basis this inverts the
        lift ``V = v P`` exactly. A warm ``v`` is not bias-corrected.
        """
        if name not in self._by_name:
            raise KeyError(f"unknown parameter name {name!r}")
        p = self._by_name[name]
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if "rank" not in group:
            raise ValueError(f"parameter {name!r} is not a GaLore parameter")
        m, n = p.shape
        if left.dim() != 2 or core.dim() != 2 or right.dim() != 2:
            raise ValueError(f"load_second_moment({name!r}): factors must be 2-D")
        if left.shape[0] != m or right.shape[0] != n or core.shape != (left.shape[1], right.shape[1]):
            raise ValueError(
                f"load_second_moment({name!r}): factors {tuple(left.shape)}, {tuple(core.shape)}, "
                f"{tuple(right.shape)} do not form an {m}x{n} matrix left @ core @ right.T"
            )
        factors = [x.detach().to(device=p.device, dtype=torch.float32) for x in (left, core, right)]
        if not all(bool(torch.isfinite(x).all()) for x in factors):
            raise FloatingPointError(f"load_second_moment({name!r}): non-finite factors")
        state = self._init_state(p, group)
        side = SIDES[state["side"]]
        if self._has_basis(group, state):
            self._apply_warm(state, side, *factors)
        else:
            state["warm_left"], state["warm_core"], state["warm_right"] = factors

    # ------------------------------------------------------------------ checkpointing
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like ``Optimizer.load_state_dict`` but keeps state dtypes (fp32 GaLore state stays fp32)."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        current = chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved, current))
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                self.state[p] = _copy_state(v, p.device)
