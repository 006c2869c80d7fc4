"""GaLore-AdamW: AdamW in a rank-``r`` gradient subspace (paper App. B, Alg. 1; DESIGN §3.1).

For a GaLore weight ``W (m x n)`` with basis ``P`` (right side, ``P (r x n)``; the left side is
the mirror image, see :mod:`fedgalore.optim.projector`) one step ``t`` is::

    R_t = G_t P^T                                       (m x r)
    M_t = b1 M_{t-1} + (1 - b1) R_t
    V_t = b2 V_{t-1} + (1 - b2) R_t * R_t
    U_t = M_t / (sqrt(V_t / c2_t) + eps)
    W_t = (1 - lr_t wd) W_{t-1} - (lr_t / (1 - b1^t)) * scale * U_t P

i.e. torch AdamW (decoupled decay applied before the update) with the moments kept in the
projected shape; ``t`` is the step count of the first moment, which always starts cold.

Refreshes happen at local steps ``0, tau, 2 tau, ...`` (``update_proj_gap = tau``). At a refresh
with an old basis the moments move to the new coordinates, ``C = P_old P_new^T`` (right) /
``C = P_new^T P_old`` (left): ``M <- M C`` and, by ``moment_transfer``, ``V <- max(V C, 0)``
(``linear``, the paper's literal rule, App. B "buffer reprojection"), ``V <- V (C∘C)``
(``squared``, the default: the second moment of ``g p_new`` when the old coordinates are
uncorrelated; non-negative and invariant to the sign of any basis vector), ``keep`` or ``reset``.

Second-moment bias correction ``c2_t`` (group key ``bias_correction``); the rules for the
moment and its evidence are stated once in :mod:`fedgalore.protocol.second_moment`:

* ``"steps"`` (default; AdamW's rule): ``c2_t = 1 - b2^s`` with ``s`` the steps of this
  optimizer since ``V`` last started (its creation or a ``reset`` transfer). A ``V``
  warm-started by :meth:`GaLoreAdamW.load_second_moment` is the synchronised *buffer* re-projected
  linearly onto the client's first basis and clamped at 0 (paper Algorithm 1 line 3 with App. B's
  buffer reprojection, :func:`~fedgalore.protocol.second_moment.warm_paper`), and the correction
  still counts this optimizer's steps, as a freshly initialised AdamW's does: Algorithm 1 as
  written (the paper mode of FedGaLore).
* ``"weight"``: every coordinate ``j`` of the projected axis carries the evidence ``c_j`` of its
  EMA (the mass ``1 - b2^s`` an EMA accumulates): ``c <- b2 c + (1 - b2)`` per step, ``V / c`` is
  the estimate. A warm start loads ``V = c̄ v̄`` and ``c = c̄`` *on the basis v̄ is expressed in*
  (exact), and every basis change — including the move to the round's first basis — moves ``V``
  and ``c`` by the ``squared`` rule: a direction the old basis does not span carries no prior, so
  the fresh gradients set its scale (sign-invariant). For a cold start ``c = 1 - b2^s``: identical
  to ``"steps"``. ``moment_transfer="linear"`` is refused with it (``V C / c`` is then no longer
  an average of old estimates).

``cap_to_cold=True`` (``"weight"`` only; FedGaLore's aligned protocol): the denominator is
``sqrt(max(V / c, V_cold / (1 - b2^s))) + eps`` with the shadow cold moment ``V_cold`` (zeros at
the optimizer's creation and at :meth:`GaLoreAdamW.mark`, fed the same gradients, moved like
``V``), so no coordinate ever steps larger than a cold start would: a prior that underestimates
``g²`` on a coordinate can no longer enlarge that coordinate's step (with prior weight ``c0`` the
first-step ratio ``|U| / |U_cold|`` reaches ``sqrt(1 + c0 / (1 - b2))`` otherwise, issue 33). The
prior still lowers steps where it is larger than the fresh estimate.

``warm_scale="gradient"`` (``"weight"`` only; FedGaLore's ``sync: aggregate``): a warm prior
whose numbers carry no gradient units (its *shape* across coordinates) is rescaled at the first
step after it was applied, ``V ← V · mean(R∘R) / mean(V / c)`` with ``R`` that step's projected
gradient, before the step's own update of ``V``; ``"absolute"`` (default) takes the prior as it is.

Projector kinds (group key ``projector``): ``identity`` (basis ``I`` of the projected side's
full dimension, ``rank`` ignored, never refreshed: exactly AdamW when ``scale = 1``), ``svd``, ``rsvd``, ``random`` (seeded Haar), ``svd_then_random`` and
``rsvd_then_random`` (the paper's SVD-to-random schedule, App. E: the first
``adaptive_proj_steps`` refreshes are data-driven, the rest seeded random).

The epoch schedule (group key ``seeded_from_step = s ≥ 0``, with a ``*_then_random`` projector;
-1 = off): data-driven refreshes at local steps ``0, τ, 2τ, … < s``, one refresh at step ``s`` to
the round's view basis ``R_k`` (:meth:`GaLoreAdamW.view_seed`: seed ``basis_seed(s_k, name, 0)``,
whatever the refresh index), and none after it — the round ends on ``R_k``, so
:meth:`GaLoreAdamW.export_moments` sends the second moment unmoved. The caller (FedGaLore's T)
computes ``s`` from the client's local epochs (:func:`fedgalore.federated.client.epoch_switch_step`);
the optimizer knows steps, not epochs. Steps taken on ``R_k`` are counted
(:meth:`GaLoreAdamW.moment_diagnostics`: ``view_step_share``; ``upload_kept``, ``warm_kept``).

``adaptive_scope``: ``"round"`` (default) counts those refreshes per optimizer lifetime, which is
one round because the federation builds a fresh optimizer per client per round; ``"global"``
counts them from :meth:`GaLoreAdamW.set_global_refresh_offset` ``(n)`` onwards, where ``n`` is
the number of refreshes this client performed in earlier rounds, so the switch happens once per
training run. Seeds always use the local refresh index ``q``:
``seed = basis_seed(projection_seed, name, q)``.

``galore_torch_compat=True`` reproduces the official ``galore_torch.GaLoreAdamW`` rule instead
(reference/algorithms.md §1.2): ``denom = sqrt(V) + eps``, step size
``lr sqrt(1 - b2^t) / (1 - b1^t)``, ``W <- W - step * scale * U P`` then ``W <- W - lr wd W``,
no moment transfer (the moments are kept across refreshes), and the same for plain groups.

``track_cold=True`` keeps the shadow cold second moment (as ``cap_to_cold`` does) and the update
the same first moments would have made with it: :meth:`GaLoreAdamW.moment_diagnostics` reports
both update norms, the warm/cold ``V̂`` ratio, what the warm start clamped or kept, and the
distribution of ``|U| / |U_cold|`` over every coordinate and step (max, 99th percentile, share
above 1) — the evidence that a synchronised state conditions the step instead of inflating it.

Low-precision weights (group key ``low_precision``; bf16 / fp16 GaLore parameters). The update
record is the intended fp32 update; rounding each step's new ``W`` to bf16 used to lose most of a
small step (512², r 32, lr 1e-4, |W| ~ 0.02: the weights moved by 0.32 of the record and 90 % of
their entries never changed), so the client trained on another model than it uploaded.
``"compensated"`` (default): the step updates ``W + c`` in fp32 and keeps what rounding to the
weights' dtype lost, ``c ← (W + c + ΔW) − round(W + c + ΔW)``, in that dtype (2 bytes per entry
for bf16) — Kahan-style compensation; ``"master"``: an fp32 master copy (4 bytes per entry) is
updated and rounded into ``W``; ``"off"``: the rounding is lost. Either of the first two keeps the
client's own ``W_T − W_0`` equal to its record to the weights' resolution (one unit in the last
place; tests/optim/test_low_precision.py). ``benchmarks/low_precision.py`` measured both at the SmolLM2
and 7B shapes: the same weights to within a bf16 unit, half the memory for ``compensated`` —
hence the default. ``fedgalore plan`` counts the bytes.

``eps = 0`` with a coordinate whose second moment and projected gradient are both 0 makes the
update 0/0: it is caught before the state changes and handled by the ``nonfinite`` policy.

The pieces (issue 43): this module is the ``torch.optim`` shell — groups and their validation, names,
state creation, checkpoint loading, the order of a step and its ``nonfinite`` policy — over small
modules that hold the algebra: :mod:`fedgalore.optim.kernels` (the projection and back-projection
GEMMs, per matrix or per bucket), :mod:`fedgalore.optim.bucket` (the moments of a bucket — the
matrices whose moments have one shape, stacked, each matrix's state a view into the stacks — the
moment algebra's only torch copy; the CPU's AVX2 kernel does it per matrix where it applies),
:mod:`fedgalore.optim.schedule` (when a basis is refreshed and which basis it gets),
:mod:`fedgalore.optim.update_record` (the exact record ``W_T − W_0``),
:mod:`fedgalore.optim.moment_exchange` (the upload ``ṽ`` and the warm start from ``v̄``),
:mod:`fedgalore.optim.low_precision` (how a step reaches bf16 weights),
:mod:`fedgalore.optim.plain_adamw` (the groups without ``rank``),
:mod:`fedgalore.optim.sharded` (FSDP2's sharded parameters: each rank steps its block of a matrix
with its block of the state) and :mod:`fedgalore.optim.step_diagnostics` (``|U| / |U_cold|``).

Group key ``bucket_gemm`` (``auto`` | ``stacked`` | ``per_matrix``): with ``stacked`` the matrices
of one weight shape and side are projected by one ``bmm`` and back-projected by one ``bmm`` and two
multi-tensor ops (:meth:`GaLoreAdamW._galore_gemm_bucket`), the GPU's form (``B − 1`` fewer
launches per GEMM); ``auto`` stacks on CUDA below :data:`STACK_AUTO_MAX_NUMEL` entries and keeps
the CPU per matrix. ``GaLoreAdamW(compile_moments=...)`` compiles the moment step
(:func:`fedgalore.optim.bucket.compiled_moments`; per-step numbers as tensors, so steps, learning
rates and bias corrections never recompile). Both equal the eager per-matrix step to fp32
rounding (tests/optim/test_bucket_gemm.py, tests/optim/test_compiled_moments.py); their GPU gain is not
measured yet (no GPU lent); on the CPU they cost 1.4-4.4x (stacked) and 1.00-1.06x (compiled)
(benchmarks/RESULTS.md §10.7).

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

import fedgalore.optim.bucket as bucket
import fedgalore.optim.cpu_kernels as cpu_kernels
import fedgalore.optim.kernels as kernels
import fedgalore.optim.low_precision as low_precision
import fedgalore.optim.moment_exchange as moment_exchange
import fedgalore.optim.plain_adamw as plain_adamw
import fedgalore.optim.schedule as schedule
import fedgalore.optim.sharded as sharded
import fedgalore.optim.step_diagnostics as step_diagnostics
import fedgalore.optim.update_record as update_record
from fedgalore.optim.groups import (ADAPTIVE_SCOPES, BIAS_CORRECTIONS, BUCKET_GEMMS, GALORE_DEFAULTS, LOW_PRECISION,
                                    MOMENT_TRANSFERS, NONFINITE_POLICIES, PROJECTORS, STACK_AUTO_MAX_NUMEL, WARM_SCALES,
                                    fill_galore_group, is_int)
from fedgalore.optim.projector import change_of_basis, resolve_side
from fedgalore.protocol.bases import SIDES, seeded_basis
from fedgalore.protocol.payload import GaLoreUpdate, MomentView

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta", "PROJECTORS", "MOMENT_TRANSFERS", "ADAPTIVE_SCOPES", "NONFINITE_POLICIES",
           "GALORE_DEFAULTS", "LOW_PRECISION", "BIAS_CORRECTIONS", "BUCKET_GEMMS", "WARM_SCALES"]  # the group keys: fedgalore.optim.groups



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
    v_weight: torch.Tensor  # (r,): prior weight c of each projected coordinate (see bias_correction)


def rebuild_delta(update: GaLoreUpdate, w0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense ``ΔW = decay · W0 + Σ_q term_q`` from an exact update record (DESIGN §3.1).

    ``term_q = C_q P_q`` (right) or ``P_q C_q`` (left), with ``P_q`` rebuilt from its seed for
    seeded terms. ``w0`` is needed when weight decay was on (``decay != 0``). Returns fp32 CPU.
    """
    return update.materialize(None if w0 is None else w0.detach().cpu())


def _has_nonfinite(x: torch.Tensor) -> bool:
    """Whether ``x`` has a NaN/Inf entry. A finite sum proves every entry finite (NaN/Inf propagate
    through a sum); only a non-finite sum (possibly an fp32 overflow of finite entries) triggers
    the full check."""
    return not (math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all()))


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


@dataclass
class _Prep:
    """A GaLore matrix between the per-matrix preparation of its step and the rest: the projected
    gradient, its basis and side, the coefficients c₂ (V's bias correction), cc (the cold moment's)
    and the cold cap, and ``u`` when the CPU kernel already did the moments."""

    p: torch.Tensor
    state: dict[str, Any]
    r: torch.Tensor
    basis: Optional[torch.Tensor]
    side: str
    c2: float
    cc: float
    cap: float
    u: Optional[torch.Tensor] = None


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
        compile_moments: Any = False,
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
        self._buckets = bucket.MomentBuckets()  # the stacked moments (fedgalore.optim.bucket)
        # the moment step compiled (torch.compile backend name, or True = inductor; False: eager)
        self._compile = compile_moments
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

    def __getstate__(self) -> dict[str, Any]:
        """Pickling keeps the parameter names (``torch.optim.Optimizer`` pickles only defaults,
        state and groups): a site's other ranks get the optimizer with the model in one pickle
        (:mod:`fedgalore.federated.data_parallel`)."""
        state = super().__getstate__()
        state["_names"], state["_by_name"], state["_compile"] = self._names, self._by_name, self._compile
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled: the bucket stacks start empty (the states' views are re-stacked at the first step)."""
        super().__setstate__(state)
        self._buckets = bucket.MomentBuckets()
        self.__dict__.setdefault("_compile", False)

    # ------------------------------------------------------------------ groups and names
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, fill GaLore defaults when it has ``rank``, validate, and name its params."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        if group["nonfinite"] not in NONFINITE_POLICIES:
            raise ValueError(f"unknown nonfinite policy {group['nonfinite']!r}; expected one of {NONFINITE_POLICIES}")
        names = group.get("param_names") or [f"g{gi}.p{i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            if name in self._by_name:
                raise ValueError(f"duplicate parameter name {name!r}")
            self._names[p] = name
            self._by_name[name] = p
        if "rank" not in group:
            return
        fill_galore_group(group, gi, names)

    def param_name(self, p: torch.Tensor) -> str:
        """The identity (name) used for ``p`` in seeds and exports."""
        return self._names[p]

    def rebind(self, mapping: dict[torch.Tensor, torch.Tensor]) -> None:
        """Move this optimizer onto other parameter objects of the same names and whole shapes,
        ``mapping[old] = new``, with its state: the groups, names and state follow. Where ``new`` is
        a sharded ``DTensor`` (FSDP2) and ``old`` a whole tensor, every state tensor that is sharded
        like its matrix (:mod:`fedgalore.optim.sharded`: the moments, cold moment and update record
        unless the shards split the basis's dimension; the weight-shaped ``master`` / ``comp``; a
        plain group's moments) keeps this rank's block; where ``old`` is sharded and ``new`` whole,
        those are gathered — then it is a collective, and every rank calls it with the same mapping.
        The rest (basis, evidence, a pending warm start, counters) is whole on every rank already.

        Used by a site that trains a sharded copy of its client's model
        (:mod:`fedgalore.federated.sharded_site`): the copy's optimizer is this one's pickle,
        rebound onto the copy's sharded parameters; at the round's end it is rebound onto whole
        tensors and its state loaded into the client's own optimizer."""
        for group in self.param_groups:
            params = []
            for old in group["params"]:
                new = mapping.get(old, old)
                if new is not old:
                    name = self._names[old]
                    if tuple(new.shape) != tuple(old.shape):
                        raise ValueError(f"rebind: parameter {name!r} has shape {tuple(old.shape)}, its new tensor "
                                         f"{tuple(new.shape)}")
                    st = self.state.pop(old, None)
                    if st:
                        self.state[new] = self._moved_state(old, new, group, st, name)
                    del self._names[old]
                    self._names[new], self._by_name[name] = name, new
                params.append(new)
            group["params"] = params
        self._buckets = bucket.MomentBuckets()  # stacks of the old state's views

    def _moved_state(self, old: torch.Tensor, new: torch.Tensor, group: dict[str, Any], st: dict[str, Any],
                     name: str) -> dict[str, Any]:
        """``old``'s state for ``new`` (:meth:`rebind`; :func:`fedgalore.optim.sharded.move_state`)."""
        src, dst = sharded.shard_dim(old, name), sharded.shard_dim(new, name)
        if src is not None and dst is not None:
            raise ValueError(f"rebind: parameter {name!r} is sharded before and after; rebind between a whole "
                             "tensor and its shards")
        p, dim = (new, dst) if src is None else (old, src)
        device = sharded.local(new).device
        if "rank" not in group:
            keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq") + sharded.WEIGHT_STATE
            moments = False
        else:
            moments = self._moments_sharded(p, group, st, dim)
            keys = (sharded.SHARDED_STATE if moments else ()) + sharded.WEIGHT_STATE
        return sharded.move_state(st, p, dim, keys, moments, to_shard=src is None, device=device)

    def set_projection_seed(self, seed: int) -> None:
        """Set the round seed ``s_k`` (paper Alg. 1) used by every later refresh of every group.

        Seeded basis of parameter ``name`` at local refresh ``q``:
        ``seeded_basis(basis_seed(seed, name, q), m, n, r, side)``.
        """
        if not is_int(seed):
            raise TypeError(f"projection seed must be an int, got {type(seed).__name__}")
        for g in self.param_groups:
            g["projection_seed"] = int(seed)

    def set_global_refresh_offset(self, n: int) -> None:
        """Refreshes already done in earlier rounds, for groups with ``adaptive_scope="global"``.

        Refresh ``q`` of this optimizer is data-driven iff ``n + q < adaptive_proj_steps``
        (``"round"`` scope ignores ``n``: data-driven iff ``q < adaptive_proj_steps``).
        """
        if not is_int(n) or n < 0:
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
            state["exp_avg"] = torch.zeros_like(sharded.local(p), memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(sharded.local(p), memory_format=torch.preserve_format)
            return state
        m, n = p.shape
        side = resolve_side((m, n), group["proj_type"])
        dim = sharded.shard_dim(p, self._names[p])  # rows / columns of a shard, or None
        if group["projector"] == "identity":
            rank = n if side == "right" else m
        else:
            rank = min(group["rank"], m, n)
        shape = (m, rank) if side == "right" else (rank, n)
        if group["projector"] == "identity":
            shape = (m, n)
        local_shape = list(shape)
        if dim is not None and (group["track_cold"] or group["warm_scale"] == "gradient"):
            raise ValueError(f"GaLore parameter {self._names[p]!r} is sharded: track_cold and warm_scale='gradient' need "
                             "statistics of the whole matrix and are not supported on sharded parameters; turn them off")
        if self._moments_sharded(p, group, {}):  # its block of M, V
            local_shape[dim] = int(sharded.local(p).shape[dim])
        state.update(
            side=SIDES.index(side),
            rank=rank,
            v_step=0,
            refresh=0,
            basis_seed=-1,
            basis_refresh=-1,
            on_view=0,  # 1 while the basis is the round's view basis R_k (view_seed)
            view_steps=0,  # steps taken on R_k (the seeded-phase share of the diagnostics)
            exp_avg=torch.zeros(local_shape, dtype=torch.float32, device=p.device),
            exp_avg_sq=torch.zeros(local_shape, dtype=torch.float32, device=p.device),
            rec_on=0,
        )
        if group["bias_correction"] == "weight":
            # prior weight per projected coordinate, shaped to broadcast against V
            d = shape[1] if side == "right" else shape[0]
            wshape = (1, d) if side == "right" else (d, 1)
            state["v_weight"] = torch.zeros(wshape, dtype=torch.float32, device=p.device)
        if group["track_cold"] or group["cap_to_cold"]:
            self._reset_cold(state)
        return state

    @staticmethod
    def _reset_cold(state: dict[str, Any]) -> None:
        state["cold_v"] = torch.zeros_like(state["exp_avg_sq"])
        state["cold_step"] = 0
        if "ratio_hist" in state:
            state["ratio_hist"].zero_()
            state["ratio_max"], state["ratio_above"], state["ratio_n"] = 0.0, 0, 0

    def _has_basis(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return group["projector"] == "identity" or "basis" in state

    # ------------------------------------------------------------------ projector schedule (fedgalore.optim.schedule)
    @staticmethod
    def _basis_kind(group: dict[str, Any], q: int, step: int = 0) -> str:
        return schedule.basis_kind(group, q, step)

    @staticmethod
    def _refresh_due(group: dict[str, Any], state: dict[str, Any]) -> bool:
        return schedule.refresh_due(group, state)

    def _refresh(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], g32: torch.Tensor) -> None:
        """New basis at local refresh ``q``; moment transfer / pending warm start; record term."""
        name = self._names[p]
        side = SIDES[state["side"]]
        q = state["refresh"]
        kind = schedule.basis_kind(group, q, state["step"])
        if sharded.is_sharded(p.grad) and sharded.shard_dim(p, name) is not None:
            # a data-driven basis reads the whole G (gathered at this step only); a seeded one its shape only
            g32 = p.grad.full_tensor().float() if kind in ("svd", "rsvd") else torch.empty(p.shape, device="meta")
        new, seed = schedule.new_basis(kind, group, name, q, g32, state["rank"], side, p.device)
        if seed < 0:
            new = sharded.broadcast_basis(new, p)  # every rank on the first rank's bits
        old = state.get("basis")
        if state["rec_on"]:
            self._close_term(state)
        if "warm_v" in state:
            self._apply_warm(p, state, group, side, new)
        elif old is not None and not group["galore_torch_compat"]:
            moment_exchange.transfer(state, group, side, change_of_basis(old, new, side))
        state["basis"] = new
        state["basis_seed"] = seed
        state["on_view"] = int(seed >= 0 and seed == schedule.view_seed(group, name))
        state["basis_refresh"] = q
        state["refresh"] = q + 1
        if state["rec_on"]:
            self._open_term(state, group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step over all groups (equations in the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if "rank" in group:
                self._galore_group_step(gi, group)
                continue
            batch: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []  # plain parameters for one fused kernel
            params = list(self._with_grads(group))
            # one vote per parameter, one all-reduce for the group's shards (a local check elsewhere)
            votes = sharded.any_rank_each([_has_nonfinite(sharded.local(p.grad)) for p in params], params)
            try:
                for p, bad in zip(params, votes):
                    state = self._init_state(p, group)
                    w, g = sharded.local(p), sharded.local(p.grad)  # a shard steps alone (elementwise)
                    if bad and self._nonfinite_policy(p, group, state):
                        continue
                    if plain_adamw.fusable(w, g, group):
                        batch.append((w, g, state))
                    else:
                        plain_adamw.step(w, g, group, state)
            finally:  # also when a later parameter raises: the ones before it have stepped, as unbatched
                if batch:
                    plain_adamw.step_fused(group, batch)
        return loss

    def _with_grads(self, group: dict[str, Any]) -> Iterable[torch.Tensor]:
        """The group's parameters that have a gradient, in order (a sparse gradient is refused)."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"GaLoreAdamW does not support sparse gradients ({self._names[p]!r})")
            yield p

    def _nonfinite(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], x: torch.Tensor) -> bool:
        """True when ``x`` has NaN/Inf and the policy is ``skip``; raises under ``raise``.

        Fast path: a finite sum proves every entry finite (NaN/Inf propagate through a sum); only
        a non-finite sum (possibly an fp32 overflow of finite entries) triggers the full check.
        """
        if not sharded.any_rank(_has_nonfinite(x), p):  # a sharded matrix: every rank decides as one
            return False
        return self._nonfinite_policy(p, group, state)

    def _nonfinite_policy(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """A non-finite gradient of ``p``: ``raise`` names it; ``skip`` counts it and returns True."""
        if group["nonfinite"] == "raise":
            raise FloatingPointError(f"non-finite gradient for parameter {self._names[p]!r} at step {state['step']}")
        state["skipped"] += 1
        return True

    def _nonfinite_update(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """``eps = 0`` and a coordinate whose second moment and projected gradient are both 0: the
        update would be 0/0 = NaN in ``W``. The ``nonfinite`` policy decides, as for a non-finite
        gradient: ``raise`` names the parameter; ``skip`` leaves its update and state untouched
        for this step (returns True)."""
        if group["nonfinite"] == "raise":
            raise FloatingPointError(
                f"non-finite update for parameter {self._names[p]!r} at step {state['step']}: eps = 0 and a coordinate with "
                "zero second moment and zero projected gradient give 0/0; set eps > 0 (or nonfinite='skip')")
        state["skipped"] += 1
        return True

    def _stacks_gemm(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p``'s projection and back-projection run stacked with its bucket
        (:func:`fedgalore.optim.kernels.project_stacked`; group key ``bucket_gemm``): ``stacked``
        everywhere; ``auto`` on a CUDA device for matrices under :data:`STACK_AUTO_MAX_NUMEL`
        entries; only for fp32 weights and gradients with a basis."""
        mode = group["bucket_gemm"]
        if mode == "per_matrix" or group["projector"] == "identity":
            return False
        if mode == "auto" and (p.device.type != "cuda" or p.numel() >= STACK_AUTO_MAX_NUMEL):
            return False
        return p.dtype == torch.float32 and p.grad.dtype == torch.float32

    def _galore_group_step(self, gi: int, group: dict[str, Any]) -> None:
        """One step of the module docstring's rule for every GaLore parameter of group ``gi``.

        Per matrix, in parameter order: the refresh when due and its check of ``G``
        (:meth:`_galore_begin`). Then, for a matrix whose GEMMs are per matrix
        (:meth:`_galore_prepare`), the projection ``R`` and the checks, and the moments per matrix
        by the CPU's AVX2 kernel where it applies; the remaining moments a whole bucket at once
        (:mod:`fedgalore.optim.bucket`: the matrices whose moments have one shape, stacked; one
        call of :func:`fedgalore.optim.bucket.adam_moments`, one non-finite check), then per matrix
        the counters, the weight update and the record (:meth:`_galore_finish`). Matrices whose
        GEMMs are stacked (:meth:`_stacks_gemm`) do all of it by bucket of one weight shape
        (:meth:`_galore_gemm_bucket`: one ``bmm`` projects, one back-projects). A parameter that
        raises leaves the ones before it stepped (the pending buckets step in ``finally``)."""
        pending: list[_Prep] = []
        gemm: dict[tuple, list[tuple[torch.Tensor, dict[str, Any], torch.Tensor, bool]]] = {}
        try:
            for p in self._with_grads(group):
                state = self._init_state(p, group)
                if self._stacks_gemm(p, group):
                    begun = self._galore_begin(p, group, state)
                    if begun is not None:
                        key = bucket.bucket_key(state) + (tuple(p.shape), state["side"], sharded.shard_dim(p, self._names[p]))
                        gemm.setdefault(key, []).append((p, state) + begun)
                    continue
                prep = self._galore_prepare(p, group, state)
                if prep is None:
                    continue
                if prep.u is not None:  # the AVX2 kernel did the moments
                    self._galore_finish(group, prep, prep.u)
                else:
                    pending.append(prep)
        finally:
            for key, items in gemm.items():
                for part, chunk in enumerate(kernels.stack_chunks(len(items), items[0][0].numel())):
                    self._galore_gemm_bucket(gi, group, key + (part,), items[chunk])
            if pending:
                self._galore_buckets(gi, group, pending)

    def _galore_begin(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> Optional[tuple[torch.Tensor, bool]]:
        """The refresh when due (after checking ``G`` under the ``nonfinite`` policy). Returns the
        fp32 gradient and whether it was checked, or None: the matrix skips this step."""
        g = sharded.local(p.grad)
        g32 = g if g.dtype == torch.float32 else g.float()
        checked = group["projector"] == "identity"  # identity: R is G itself, checked with R
        if not checked and self._refresh_due(group, state):
            if self._nonfinite(p, group, state, g32):
                return None
            self._refresh(p, group, state, g32)
            checked = True
        return g32, checked

    def _galore_prepare(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> Optional[_Prep]:
        """The per-matrix part of a step before the moments: refresh, projection, checks; the
        moments themselves when the CPU kernel applies. None: the matrix skips this step.

        Passes over ``m x n`` data in a normal (non-refresh) step of an fp32 parameter: ``G`` is
        read once (the projection ``R``), ``W`` is read and written once (decay and
        back-projection, :func:`fedgalore.optim.kernels.decay_back_project`); the non-finite check,
        the moments, the shadow cold moment and the update record touch ``m x r`` / ``r x n``
        tensors only. A refresh step adds one finite-sum pass over ``G`` and the basis computation;
        bf16 parameters add the fp32 casts of ``G`` and ``W`` and the copy back.

        Non-finite gradients (policy ``nonfinite``): a refresh step checks ``G`` itself, every
        step checks ``R`` (per bucket, :meth:`_galore_buckets`, or in the kernel). Under IEEE
        arithmetic a NaN/Inf entry of ``G`` makes its whole row (right) / column (left) of ``R``
        non-finite, whatever the basis entries it meets (``NaN·0 = Inf·0 = NaN``); the
        projection kernel in use is probed for that once per process
        (:func:`fedgalore.optim.kernels.propagates_nonfinite`), and a kernel that fails the probe
        gets ``G`` checked on every step. A finite ``G`` whose projection overflows fp32 also
        counts as non-finite.
        """
        begun = self._galore_begin(p, group, state)
        if begun is None:
            return None
        g32, checked = begun
        side = SIDES[state["side"]]
        if group["projector"] == "identity":
            basis, r = None, g32
        else:
            basis = self._shard_basis(p, state, side)
            r, propagates = kernels.project_step(g32, basis, side)
            if basis is not state["basis"]:  # a shard across the basis's dimension: R is the ranks' sum
                r = sharded.all_reduce_sum(r.contiguous(), p)
            if not (propagates or checked) and self._nonfinite(p, group, state, g32):
                return None
        return self._galore_ready(p, group, state, r, basis, side, kernel=True)

    def _shard_basis(self, p: torch.Tensor, state: dict[str, Any], side: str) -> torch.Tensor:
        """The basis the step multiplies this rank's block of ``p`` with: the whole basis, or — for
        a shard that splits the dimension the basis spans (:func:`fedgalore.optim.sharded.along_basis`)
        — the basis's rows (left) / columns (right) of that block."""
        dim = sharded.shard_dim(p, self._names[p])
        if not sharded.along_basis(side, dim):
            return state["basis"]
        return sharded.keep_local(state["basis"], p, dim)

    def _galore_ready(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], r: torch.Tensor,
                      basis: Optional[torch.Tensor], side: str, kernel: bool) -> Optional[_Prep]:
        """After the projection: the warm start's rescale, the ``eps = 0`` check, the coefficients;
        with ``kernel``, the moments by the CPU's AVX2 kernel where it applies."""
        eps = group["eps"]
        b1, b2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        w8, cv = state.get("v_weight"), state.get("cold_v")
        if state.pop("warm_rescale", 0):
            moment_exchange.rescale_warm(v, w8, r, state)
        if eps == 0.0 and sharded.any_rank(bool(((v == 0) & (r == 0)).any()), p):
            # V stays 0 where both are 0, so M / (sqrt(V̂) + 0) is 0/0: a non-finite update from finite input
            if self._nonfinite_update(p, group, state):
                return None
        # M / (sqrt(V) / c2 + eps) = c2 M / (sqrt(V) + c2 eps): AdamW's bias correction of this
        # step's V (v_step + 1) joins the coefficient; 1 with evidence c (V / c is the estimate)
        c2 = 1.0 if w8 is not None else math.sqrt(1.0 - b2 ** (state["v_step"] + 1))
        # the shadow cold moment's correction after this step, and the cold cap 1 / (1 - b2^s)
        cc = math.sqrt(1.0 - b2 ** (state["cold_step"] + 1)) if cv is not None else 1.0
        cap = 1.0 / (cc * cc) if group["cap_to_cold"] else 0.0
        prep = _Prep(p, state, r, basis, side, c2, cc, cap)
        if (kernel and not group["galore_torch_compat"] and not sharded.is_sharded(p) and p.numel() >= kernels.ONEDNN_MIN_NUMEL
                and cpu_kernels.moments_usable(r, m, v, w8, cv)):
            # the check of R, M, V (and c, the cold V) and U in one kernel call (same rule as bucket.adam_moments)
            prep.u = cpu_kernels.adam_moments(r, m, v, b1, b2, eps * c2, cold_v=cv, v_weight=w8, cold_cap=cap)
            if prep.u is None and not self._nonfinite(p, group, state, r):
                raise RuntimeError(f"internal: the moment kernel and torch disagree on whether R of {self._names[p]!r} is finite")
            if prep.u is None:
                return None
        return prep

    def _bucket_moments(self, key: tuple, group: dict[str, Any], items: list[_Prep],
                        r: Optional[torch.Tensor] = None) -> tuple[list[_Prep], Optional[torch.Tensor]]:
        """One bucket's moments: ``R`` stacked (or given stacked), one non-finite check (per matrix,
        by the policy, only when it fails), one :func:`fedgalore.optim.bucket.adam_moments` on the
        bucket's stacked state. Returns the matrices that step and their ``U`` (``[B, a, b]``; a
        bucket of one: its own tensors, not stacked)."""
        if r is None or len(items) == 1:
            r = bucket.stack_or_one([x.r for x in items])
        bad = not math.isfinite(float(r.sum())) and not bool(torch.isfinite(r).all())
        ref = next((x.p for x in items if sharded.is_sharded(x.p)), items[0].p)
        if sharded.any_rank(bad, ref):  # (a sharded bucket: every rank checks its matrices alike)
            items = [x for x in items if not self._nonfinite(x.p, group, x.state, x.r)]  # raises, or skips
            if not items:
                return [], None
            r = bucket.stack_or_one([x.r for x in items])
        b1, b2 = group["betas"]
        compat = group["galore_torch_compat"]
        # a bucket of one is its own tensors with plain numbers (no stack, the same algebra)
        st = items[0].state if len(items) == 1 else self._buckets.bind(key, [x.state for x in items])
        compiled = bool(self._compile)
        eps = bucket.per_matrix([group["eps"] * (1.0 if compat else x.c2) for x in items], r, tensor=compiled)
        cap = bucket.per_matrix([x.cap for x in items], r, tensor=compiled) if group["cap_to_cold"] else None
        args = (r, st["exp_avg"], st["exp_avg_sq"], b1, b2, eps, st.get("v_weight"), st.get("cold_v"), cap, compat)
        if not compiled:
            return items, bucket.adam_moments(*args)
        try:
            u = bucket.compiled_moments(self._compile)(*args)
        except Exception as exc:  # torch.compile's own failures (no C++ compiler, an unknown backend): one clear line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise RuntimeError(f"compile_moments={self._compile!r}: torch.compile of the moment step failed ({first}); "
                               "set compile_moments to False (on the CPU it needs a C++ compiler and measured no gain)") from exc
        return items, u

    def _galore_buckets(self, gi: int, group: dict[str, Any], preps: list[_Prep]) -> None:
        """The moments of the prepared matrices, one bucket (:func:`fedgalore.optim.bucket.bucket_key`)
        at a time (:meth:`_bucket_moments`); then each matrix's :meth:`_galore_finish`."""
        by_key: dict[tuple, list[_Prep]] = {}
        for x in preps:
            by_key.setdefault(bucket.bucket_key(x.state), []).append(x)
        for key, items in by_key.items():
            items, u = self._bucket_moments((gi, key), group, items)
            for x, ux in zip(items, u if len(items) > 1 else [u]):
                self._galore_finish(group, x, ux)

    def _galore_gemm_bucket(self, gi: int, group: dict[str, Any], key: tuple,
                            items: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor, bool]]) -> None:
        """A bucket of matrices of one weight shape and side, begun (:meth:`_galore_begin`), stepped
        with stacked GEMMs: ``R`` by one ``bmm`` (:func:`fedgalore.optim.kernels.project_stacked`),
        the checks and coefficients per matrix (:meth:`_galore_ready`), the moments by
        :meth:`_bucket_moments`, the counters and record per matrix (:meth:`_galore_finish`), and
        ``W ← d W + coef U P`` for all of them by one ``bmm`` and two multi-tensor ops
        (:func:`fedgalore.optim.kernels.decay_back_project_stacked`)."""
        side = SIDES[items[0][1]["side"]]
        own = [self._shard_basis(p, state, side) for p, state, _, _ in items]
        bases = torch.stack(own)
        r, propagates = kernels.project_stacked([g for _, _, g, _ in items], bases, side)
        if own[0] is not items[0][1]["basis"]:  # shards across the bases' dimension: R is the ranks' sum (one all-reduce)
            r = sharded.all_reduce_sum(r, items[0][0])
        preps: list[_Prep] = []
        for i, (p, state, g32, checked) in enumerate(items):
            if not (propagates or checked) and self._nonfinite(p, group, state, g32):
                continue
            prep = self._galore_ready(p, group, state, r[i], own[i], side, kernel=False)
            if prep is not None:
                preps.append(prep)
        if not preps:
            return
        stacked = r if len(preps) == len(items) else None
        preps, u = self._bucket_moments((gi,) + key, group, preps, stacked)
        if not preps:
            return
        coefs = [self._galore_finish(group, x, ux, weight=False) for x, ux in zip(preps, u if len(preps) > 1 else [u])]
        if len(preps) == 1:
            kernels.decay_back_project(sharded.local(preps[0].p), u, preps[0].basis, side, *coefs[0])
            return
        if len(preps) != len(items):
            bases = torch.stack([x.basis for x in preps])
        kernels.decay_back_project_stacked([sharded.local(x.p) for x in preps], u, bases, side, [d for d, _ in coefs],
                                           [c for _, c in coefs])

    def _galore_finish(self, group: dict[str, Any], x: _Prep, u: torch.Tensor,
                       weight: bool = True) -> Optional[tuple[float, float]]:
        """The per-matrix part of a step after the moments (``u = M / D``): the step counters, the
        weight update ``W ← d W + coef U P`` (torch order; the official order under compat) and the
        update record. ``weight=False``: the weight update is left to the caller (a stacked
        bucket), which gets ``(d, coef)``."""
        p, state, basis, side, c2, cc, cap = x.p, x.state, x.basis, x.side, x.c2, x.cc, x.cap
        lr, wd, eps, scale = float(group["lr"]), group["weight_decay"], group["eps"], group["scale"]
        b1, b2 = group["betas"]
        state["step"] += 1
        state["v_step"] += 1
        state["view_steps"] = state.get("view_steps", 0) + state.get("on_view", 0)
        t = state["step"]
        decay = 1.0 - lr * wd
        if group["galore_torch_compat"]:
            step_size = lr
            if group["correct_bias"]:
                step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
            # official order, update then decay: W <- d (W - step scale U P) = d W - d step scale U P
            d = decay if wd > 0.0 else 1.0
            if state["rec_on"]:
                self._record(state, u, -step_size * scale, d, after=True)
            return self._update_weight(p, group, state, u, basis, side, d, -step_size * scale * d, weight)
        coef = -lr / (1.0 - b1**t) * scale
        coef_u = coef * c2
        cold = None
        cv = state.get("cold_v")
        if cv is not None:
            state["cold_step"] += 1
            if state["rec_on"] and "rec_cold" in state:  # U_cold only feeds the record
                cold = (state["exp_avg"], cv.sqrt().add_(eps * cc), coef * cc)
            if group["track_cold"]:
                step_diagnostics.observe_ratio(state, state["exp_avg_sq"], state.get("v_weight"), cv, c2, cc, cap, eps)
        if state["rec_on"]:
            self._record(state, u, coef_u, decay, after=False, cold=cold)
        return self._update_weight(p, group, state, u, basis, side, decay, coef_u, weight)

    @staticmethod
    def _update_weight(p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], u: torch.Tensor,
                       basis: Optional[torch.Tensor], side: str, decay: float, coef: float,
                       weight: bool) -> Optional[tuple[float, float]]:
        """``W ← decay·W + coef·U P`` on the working weight (:mod:`fedgalore.optim.low_precision`),
        or ``(decay, coef)`` for the caller when ``weight`` is False."""
        if not weight:
            return decay, coef
        p = sharded.local(p)  # a shard's rows (columns) and its state's: the step needs nothing else
        w = low_precision.working_weight(p, group, state)
        kernels.decay_back_project(w, u, basis, side, decay, coef)
        low_precision.store_weight(p, group, state, w)
        return None

    # ------------------------------------------------------------------ update record (fedgalore.optim.update_record)
    def _open_term(self, state: dict[str, Any], group: dict[str, Any]) -> None:
        update_record.open_term(state, group["track_cold"])

    @staticmethod
    def _close_term(state: dict[str, Any]) -> None:
        update_record.close_term(state)

    @staticmethod
    def _record(state: dict[str, Any], u: torch.Tensor, alpha: float, decay: float, after: bool,
                cold: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> None:
        update_record.record(state, u, alpha, decay, after, cold)

    def mark(self) -> None:
        """Start recording the exact low-rank update ``W_T - W_0`` of every GaLore parameter
        (:mod:`fedgalore.optim.update_record`; with ``track_cold``, restart the shadow cold second moment)."""
        for _, p, group in self._galore_items():
            state = self._init_state(p, group)
            if "cold_v" in state:
                self._reset_cold(state)
            update_record.start(state, self._has_basis(group, state), group["track_cold"])

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
            out[name] = update_record.export(self._whole(p, group, state), (int(p.shape[0]), int(p.shape[1])), SIDES[state["side"]])
        return out

    # ------------------------------------------------------------------ state export / warm start
    def _moments_sharded(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], dim: Optional[int] = -1) -> bool:
        """Whether ``p``'s moments and record are blocks of a sharded matrix (``False``: not sharded,
        or whole on every rank because the shards split the basis's dimension); ``dim``: its shard
        dimension when known (−1, the default: read from ``p``)."""
        if dim == -1:
            dim = sharded.shard_dim(p, self._names[p])
        side = SIDES[state["side"]] if "side" in state else resolve_side((int(p.shape[0]), int(p.shape[1])), group["proj_type"])
        return dim is not None and (group["projector"] == "identity" or not sharded.along_basis(side, dim))

    def _whole(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """``p``'s state with its sharded tensors gathered from every rank (a shallow copy; the
        state itself when ``p`` is not sharded; :mod:`fedgalore.optim.sharded`). Every rank must
        call it for the same parameters in the same order."""
        if not self._moments_sharded(p, group, state):
            return state
        dim = sharded.shard_dim(p, self._names[p])
        out = dict(state)
        for k in sharded.SHARDED_STATE:
            if isinstance(out.get(k), torch.Tensor):
                out[k] = sharded.gather(out[k], p, dim)
        out["rec_terms"] = [{**t, **{k: sharded.gather(t[k], p, dim) for k in ("coef", "cold") if k in t}}
                            for t in state.get("rec_terms", [])]
        return out

    def _current_basis(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> Optional[torch.Tensor]:
        if group["projector"] == "identity":
            side = SIDES[state["side"]]
            return torch.eye(p.shape[1] if side == "right" else p.shape[0], device=p.device)
        return state.get("basis")

    def _v_weight(self, group: dict[str, Any], state: dict[str, Any]) -> torch.Tensor:
        """Prior weight ``c`` of each projected coordinate (:func:`fedgalore.optim.moment_exchange.v_weight`)."""
        return moment_exchange.v_weight(state, SIDES[state["side"]], group["betas"][1])

    def export_state(self) -> dict[str, GaLoreStateEntry]:
        """Per GaLore parameter name: projected moments, shape/side and basis identity."""
        out: dict[str, GaLoreStateEntry] = {}
        for name, p, group in self._galore_items():
            state = self._whole(p, group, self._init_state(p, group))
            side = SIDES[state["side"]]
            basis = self._current_basis(p, group, state)
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
                warm="warm_diag" in state,
                v_weight=self._v_weight(group, state).detach().flatten().clone(),
            )
        return out

    def view_seed(self, name: str) -> int:
        """Seed of the round's shared view basis ``R_k`` of parameter ``name`` (paper Alg. 1 line
        13, §5 "Seeded matrix view"): ``basis_seed(s_k, name, 0)`` — a function of the round
        seed and the parameter only, identical for every client whatever its step count. It is
        also the basis of a seeded refresh at local refresh 0, so a client whose round starts in
        the seeded phase trains on ``R_k`` itself."""
        if name not in self._by_name:
            raise KeyError(f"unknown parameter name {name!r}")
        p = self._by_name[name]
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        return schedule.view_seed(group, name)

    def export_moments(self, view_seeds: Optional[dict[str, int]] = None, buffer: bool = False) -> dict[str, MomentView]:
        """Per GaLore parameter, the projected second moment as a :class:`MomentView` (paper
        Alg. 1 line 10, "upload ṽ").

        ``buffer=False``: the estimate ``V / c`` with its evidence ``c``
        (:func:`fedgalore.protocol.second_moment.estimate`; ``c = 1 - b2^s`` on every coordinate
        under ``bias_correction="steps"``). ``buffer=True``: the raw buffer ``ṽ = V`` itself, with
        no evidence (``weight=None``) — Algorithm 1 line 10 as written.

        Without ``view_seeds`` it is expressed in the current basis (the matrix, or its seed when
        seeded). With ``view_seeds[name] = s`` it is expressed in the seeded basis
        ``R = seeded_basis(s, ...)``: unless the current basis already is ``R``, ``V`` (and ``c``)
        move there by the group's ``moment_transfer`` (``C = P R^T``,
        :func:`fedgalore.protocol.second_moment.move`), and the view carries the seed only.
        """
        out: dict[str, MomentView] = {}
        for name, p, group in self._galore_items():
            state = self._init_state(p, group)
            basis = self._current_basis(p, group, state)
            if basis is None:
                raise ValueError(f"parameter {name!r} has no basis yet (no optimizer step happened)")
            target = None if view_seeds is None else view_seeds.get(name)
            whole = self._whole(p, group, state)
            out[name] = moment_exchange.export_view(whole, group, SIDES[state["side"]], (int(p.shape[0]), int(p.shape[1])),
                                                    basis, target, buffer)
            if whole is not state:
                state["upload_kept"] = whole["upload_kept"]
        return out

    def _apply_warm(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], side: str, new: torch.Tensor) -> None:
        """Start ``V`` from the pending synchronised state on the basis ``new``
        (:func:`fedgalore.optim.moment_exchange.apply_warm`: the two rules); a shard keeps its
        rows (columns) of the whole warm ``V`` (:mod:`fedgalore.optim.sharded`)."""
        moment_exchange.apply_warm(state, group, side, new)
        if self._moments_sharded(p, group, state):
            state["exp_avg_sq"] = sharded.keep_local(state["exp_avg_sq"], p, sharded.shard_dim(p, self._names[p]))

    def load_second_moment(self, name: str, view: MomentView) -> None:
        """Warm-start ``V`` of parameter ``name`` from a synchronised state ``v̄`` (paper Alg. 1,
        lines 3 and 14; DESIGN §3.1): ``view.moment`` are its coordinates on the basis
        ``view.basis_matrix()``, ``view.weight`` their prior weights (``None``: full weight).

        Applied to the current basis, or — before the first step — to the round's first basis
        when the first refresh picks it (see :meth:`_apply_warm` for the two rules).
        """
        if name not in self._by_name:
            raise KeyError(f"unknown parameter name {name!r}")
        if not isinstance(view, MomentView):
            raise TypeError(f"load_second_moment({name!r}): expected a MomentView, got {type(view).__name__}")
        p = self._by_name[name]
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if "rank" not in group:
            raise ValueError(f"parameter {name!r} is not a GaLore parameter")
        state = self._init_state(p, group)
        side = SIDES[state["side"]]
        x, basis, w8 = moment_exchange.check_view(name, view, side, (int(p.shape[0]), int(p.shape[1])), p.device)
        state["warm_v"], state["warm_basis"], state["warm_weight"] = x, basis, w8
        current = self._current_basis(p, group, state)
        if current is not None:
            self._apply_warm(p, state, group, side, current)

    def moment_diagnostics(self) -> dict[str, dict[str, float]]:
        """Per GaLore parameter: what the warm start did (``warm_clamped``: fraction of entries
        clamped at 0; ``prior_retained``: share of the prior weight the move to the first basis
        kept) and, with ``track_cold``, since :meth:`mark`: ``update_norm`` = ``‖Σ_q f_q C_q P_q‖_F``
        (the record without its decay term), ``update_norm_cold`` (the same with the shadow cold
        second moment) and ``v_ratio_median`` = median of ``V̂ / V̂_cold`` at the last step."""
        out: dict[str, dict[str, float]] = {}
        for name, p, group in self._galore_items():
            state = self.state.get(p, {})
            d = dict(state.get("warm_diag", {}))
            if state.get("step", 0) > 0:
                d["view_step_share"] = state.get("view_steps", 0) / state["step"]
            if "upload_kept" in state:
                d["upload_kept"] = float(state["upload_kept"])
            if group["track_cold"] and "cold_v" in state and state.get("rec_on") and state.get("cold_step", 0) > 0:
                side = SIDES[state["side"]]
                terms = update_record.all_terms(state, with_cold=True)
                bases = [self._term_basis(p, group, state, t) for t in terms]
                d["update_norm"] = update_record.record_norm([t["coef"] * t["factor"] for t in terms], bases, side)
                d["update_norm_cold"] = update_record.record_norm([t["cold"] * t["factor"] for t in terms], bases, side)
                b2 = group["betas"][1]
                warm_hat = state["exp_avg_sq"] / self._v_weight(group, state).clamp(min=torch.finfo(torch.float32).tiny)
                cold_hat = state["cold_v"] / (1.0 - b2 ** state["cold_step"])
                ok = cold_hat > 0
                d["v_ratio_median"] = float((warm_hat[ok] / cold_hat[ok]).median()) if bool(ok.any()) else float("nan")
            if state.get("ratio_n", 0) > 0:
                d.update(step_diagnostics.ratio_summary(state["ratio_hist"], state["ratio_max"], state["ratio_above"], state["ratio_n"]))
            out[name] = d
        return out

    def update_ratio_summary(self) -> dict[str, float]:
        """``|U| / |U_cold|`` over every coordinate of every GaLore matrix and every step since
        :meth:`mark` (``track_cold``; empty without): ``update_ratio_max``, ``update_ratio_p99``
        (99th percentile, to the histogram's 1.1 % resolution, read at a bin's upper edge so that
        ratios all ≤ 1 give ≤ 1) and ``update_ratio_above`` (share of entries above 1). Above 1
        means a coordinate stepped larger than a cold start would have (module doc,
        ``cap_to_cold``)."""
        hist, top, above, n = None, 0.0, 0, 0
        for _, p, _ in self._galore_items():
            st = self.state.get(p, {})
            if st.get("ratio_n", 0) > 0:
                hist = st["ratio_hist"].clone() if hist is None else hist + st["ratio_hist"]
                top, above, n = max(top, st["ratio_max"]), above + st["ratio_above"], n + st["ratio_n"]
        return {} if hist is None else step_diagnostics.ratio_summary(hist, top, above, n)

    def _term_basis(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], term: dict[str, Any]) -> torch.Tensor:
        if term.get("basis") is not None:
            return term["basis"]
        if term["seed"] >= 0:
            rank = state["rank"]
            side = SIDES[state["side"]]
            return seeded_basis(int(term["seed"]), int(p.shape[0]), int(p.shape[1]), rank, side).to(p.device)
        return self._current_basis(p, group, state)

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
