"""GaLore-AdamW's step as functions over typed state (as torch's functional
``torch.optim.adamw.adamw`` under the thin ``torch.optim.AdamW`` class).

:func:`galore_group_step` steps one GaLore group (the rule of :mod:`fedgalore.optim.galore_adamw`'s
module doc: paper App. B, Alg. 1 lines 4-9), :func:`plain_group_step` one plain AdamW group. Each
group's execution path is chosen once per step (:func:`group_path`): ``per_matrix`` (each matrix
projected and back-projected by its own GEMMs, the moments by the CPU's AVX2 kernel where it
applies, the rest a bucket at a time) or ``stacked`` (the matrices of one weight shape and side by
one ``bmm`` each, :func:`stacked_bucket_step`; matrices that cannot be stacked — bf16 weights, or
large ones under ``bucket_gemm: auto`` — take the per-matrix path). A group of FSDP2 shards
(:mod:`fedgalore.optim.sharded`) takes either path: the sharding helpers are the identity on whole
tensors, and every rank decides together where the data is split.

The state is :class:`~fedgalore.optim.state.GaLoreParamState` (GaLore matrices) and
:class:`~fedgalore.optim.state.AdamParamState` (plain parameters); :class:`StepEnv` carries what a
step needs from its optimizer (names, bucket stacks, the compile setting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

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
from fedgalore.optim.groups import STACK_AUTO_MAX_NUMEL
from fedgalore.optim.projector import change_of_basis, resolve_side
from fedgalore.optim.state import SHARDED, AdamParamState, GaLoreParamState, ParamState

__all__ = ["StepEnv", "MatrixStep", "init_state", "whole_state", "current_basis", "moments_sharded", "reset_cold", "has_basis",
           "apply_warm", "refresh", "group_path", "galore_group_step", "plain_group_step", "has_nonfinite"]


@dataclass
class StepEnv:
    """What a step needs from its optimizer besides a group: each parameter's name, the persistent
    bucket stacks (:class:`fedgalore.optim.bucket.MomentBuckets`), ``compile_moments`` and the
    optimizer's ``state`` mapping (parameter → typed state)."""

    names: dict[torch.Tensor, str]
    buckets: bucket.MomentBuckets
    compile: Any
    states: Any  # the optimizer's ``state`` mapping (parameter -> ParamState)


@dataclass
class MatrixStep:
    """A GaLore matrix between the preparation of its step and the moments: its projected
    gradient ``R``, the basis and side it was projected with, V's bias correction ``c₂``
    (``v_bias``; 1 with evidence), the shadow cold moment's (``cold_bias``), the cold cap
    ``1/(1−β₂^s)`` (``cold_cap``, 0 when off), and ``direction`` ``U = M / D`` when the CPU kernel
    already did the moments."""

    param: torch.Tensor
    state: GaLoreParamState
    projected: torch.Tensor
    basis: Optional[torch.Tensor]
    side: str
    v_bias: float
    cold_bias: float
    cold_cap: float
    direction: Optional[torch.Tensor] = None


def has_nonfinite(x: torch.Tensor) -> bool:
    """Whether ``x`` has a NaN/Inf entry. A finite sum proves every entry finite (NaN/Inf propagate
    through a sum); only a non-finite sum (possibly an fp32 overflow of finite entries) triggers
    the full check."""
    return not (math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all()))


# ---------------------------------------------------------------------------------------- state
def state_of(p: torch.Tensor, group: dict[str, Any], env: StepEnv) -> ParamState:
    """``p``'s state, created (:func:`init_state`) at its first use."""
    st = env.states.get(p)
    if not isinstance(st, (GaLoreParamState, AdamParamState)):
        st = env.states[p] = init_state(p, group, env.names[p])
    return st


def init_state(p: torch.Tensor, group: dict[str, Any], name: str) -> ParamState:
    """A new state for ``p``: zero moments (fp32, projected shape, this rank's block on a shard;
    the parameter's shape and dtype in a plain group), the evidence ``c = 0`` under
    ``bias_correction="weight"`` and the shadow cold moment with ``track_cold`` / ``cap_to_cold``."""
    if "rank" not in group:
        return AdamParamState(torch.zeros_like(sharded.local(p), memory_format=torch.preserve_format),
                              torch.zeros_like(sharded.local(p), memory_format=torch.preserve_format))
    m, n = p.shape
    side = resolve_side((m, n), group["proj_type"])
    dim = sharded.shard_dim(p, name)  # rows / columns of a shard, or None
    rank = (n if side == "right" else m) if group["projector"] == "identity" else min(group["rank"], m, n)
    shape = (m, n) if group["projector"] == "identity" else ((m, rank) if side == "right" else (rank, n))
    local_shape = list(shape)
    if dim is not None and (group["track_cold"] or group["warm_scale"] == "gradient"):
        raise ValueError(f"GaLore parameter {name!r} is sharded: track_cold and warm_scale='gradient' need "
                         "statistics of the whole matrix and are not supported on sharded parameters; turn them off")
    if moments_sharded(p, name, group, side, dim):  # its block of M, V
        local_shape[dim] = int(sharded.local(p).shape[dim])
    state = GaLoreParamState(side=side, rank=rank, exp_avg=torch.zeros(local_shape, dtype=torch.float32, device=p.device),
                             exp_avg_sq=torch.zeros(local_shape, dtype=torch.float32, device=p.device))
    if group["bias_correction"] == "weight":
        # prior weight per projected coordinate, shaped to broadcast against V
        d = shape[1] if side == "right" else shape[0]
        state.v_weight = torch.zeros((1, d) if side == "right" else (d, 1), dtype=torch.float32, device=p.device)
    if group["track_cold"] or group["cap_to_cold"]:
        reset_cold(state)
    return state


def reset_cold(state: GaLoreParamState) -> None:
    """Restart the shadow cold second moment (zeros, step 0) and the ratio histogram."""
    state.cold_v = torch.zeros_like(state.exp_avg_sq)
    state.cold_step = 0
    if state.ratio is not None:
        state.ratio.hist.zero_()
        state.ratio.max, state.ratio.above, state.ratio.count = 0.0, 0, 0


def has_basis(group: dict[str, Any], state: GaLoreParamState) -> bool:
    """Whether a basis ``P`` is in use (the identity projector's ``I`` always is; else after the first refresh)."""
    return group["projector"] == "identity" or state.basis is not None


def moments_sharded(p: torch.Tensor, name: str, group: dict[str, Any], side: Optional[str] = None,
                    dim: Optional[int] = -1) -> bool:
    """Whether ``p``'s moments and record are blocks of a sharded matrix (``False``: not sharded,
    or whole on every rank because the shards split the basis's dimension); ``side`` and ``dim``
    (its shard dimension) are read from ``p`` when not given."""
    if dim == -1:
        dim = sharded.shard_dim(p, name)
    side = side or resolve_side((int(p.shape[0]), int(p.shape[1])), group["proj_type"])
    return dim is not None and (group["projector"] == "identity" or not sharded.along_basis(side, dim))


def whole_state(p: torch.Tensor, name: str, group: dict[str, Any], state: GaLoreParamState) -> GaLoreParamState:
    """``p``'s state with its sharded tensors gathered from every rank (a copy; the state itself
    when ``p`` is not sharded; :mod:`fedgalore.optim.sharded`). Every rank must call it for the same
    parameters in the same order."""
    if not moments_sharded(p, name, group, state.side):
        return state
    dim = sharded.shard_dim(p, name)
    return sharded.convert_state(state, lambda x: sharded.gather(x, p, dim), SHARDED, record=True)


def current_basis(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState) -> Optional[torch.Tensor]:
    """The basis in use: ``I`` for the identity projector, else the stored one (None before the first refresh)."""
    if group["projector"] == "identity":
        return torch.eye(p.shape[1] if state.side == "right" else p.shape[0], device=p.device)
    return state.basis


def apply_warm(p: torch.Tensor, name: str, group: dict[str, Any], state: GaLoreParamState, new: torch.Tensor) -> None:
    """Start ``V`` from the pending synchronised state on the basis ``new`` (paper Alg. 1 line 3;
    :func:`fedgalore.optim.moment_exchange.apply_warm`: the two rules); a shard keeps its rows
    (columns) of the whole warm ``V`` (:mod:`fedgalore.optim.sharded`)."""
    moment_exchange.apply_warm(state, group, state.side, new)
    if moments_sharded(p, name, group, state.side):
        state.exp_avg_sq = sharded.keep_local(state.exp_avg_sq, p, sharded.shard_dim(p, name))


# ---------------------------------------------------------------------------------------- policy
def _nonfinite_policy(name: str, group: dict[str, Any], state: ParamState) -> bool:
    """A non-finite gradient: ``raise`` names the parameter; ``skip`` counts it and returns True."""
    if group["nonfinite"] == "raise":
        raise FloatingPointError(f"non-finite gradient for parameter {name!r} at step {state.step}")
    state.skipped += 1
    return True


def _nonfinite(p: torch.Tensor, name: str, group: dict[str, Any], state: ParamState, x: torch.Tensor) -> bool:
    """True when ``x`` has NaN/Inf and the policy is ``skip``; raises under ``raise`` (a sharded
    matrix: every rank decides as one)."""
    if not sharded.any_rank(has_nonfinite(x), p):
        return False
    return _nonfinite_policy(name, group, state)


def _nonfinite_update(name: str, group: dict[str, Any], state: GaLoreParamState) -> bool:
    """``eps = 0`` and a coordinate whose second moment and projected gradient are both 0: the
    update would be 0/0 = NaN in ``W``. The ``nonfinite`` policy decides, as for a non-finite
    gradient: ``raise`` names the parameter; ``skip`` leaves its update and state untouched
    for this step (returns True)."""
    if group["nonfinite"] == "raise":
        raise FloatingPointError(
            f"non-finite update for parameter {name!r} at step {state.step}: eps = 0 and a coordinate with "
            "zero second moment and zero projected gradient give 0/0; set eps > 0 (or nonfinite='skip')")
    state.skipped += 1
    return True


def _with_grads(group: dict[str, Any], env: StepEnv) -> Iterable[torch.Tensor]:
    """The group's parameters that have a gradient, in order (a sparse gradient is refused)."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"GaLoreAdamW does not support sparse gradients ({env.names[p]!r})")
        yield p


# ---------------------------------------------------------------------------------------- plain groups
def plain_group_step(group: dict[str, Any], env: StepEnv) -> None:
    """AdamW for a group without ``rank`` (:mod:`fedgalore.optim.plain_adamw`): the fusable
    parameters by one fused kernel, the rest one by one; a non-finite gradient by the policy."""
    batch: list[tuple[torch.Tensor, torch.Tensor, AdamParamState]] = []  # plain parameters for one fused kernel
    params = list(_with_grads(group, env))
    # one vote per parameter, one all-reduce for the group's shards (a local check elsewhere)
    votes = sharded.any_rank_each([has_nonfinite(sharded.local(p.grad)) for p in params], params)
    try:
        for p, bad in zip(params, votes):
            state = state_of(p, group, env)
            w, g = sharded.local(p), sharded.local(p.grad)  # a shard steps alone (elementwise)
            if bad and _nonfinite_policy(env.names[p], group, state):
                continue
            if plain_adamw.fusable(w, g, group):
                batch.append((w, g, state))
            else:
                plain_adamw.step(w, g, group, state)
    finally:  # also when a later parameter raises: the ones before it have stepped, as unbatched
        if batch:
            plain_adamw.step_fused(group, batch)


# ---------------------------------------------------------------------------------------- refresh
def refresh(p: torch.Tensor, name: str, group: dict[str, Any], state: GaLoreParamState, g32: torch.Tensor) -> None:
    """New basis at local refresh ``q`` (paper App. E; :mod:`fedgalore.optim.schedule`); the moments
    move to it, ``C = P_old P_newᵀ`` (App. B "buffer reprojection"), or a pending warm start is
    applied on it; the update record closes its term and opens one for the new basis."""
    side = state.side
    q = state.refresh
    kind = schedule.basis_kind(group, q, state.step)
    held = schedule.held_basis(group, state, kind, int(p.shape[0]), int(p.shape[1]), p.device)  # hold_warm_basis
    if held is not None:
        new, seed = held
    else:
        if sharded.is_sharded(p.grad) and sharded.shard_dim(p, name) is not None:
            # a data-driven basis reads the whole G (gathered at this step only); a seeded one its shape only
            g32 = p.grad.full_tensor().float() if kind in ("svd", "rsvd") else torch.empty(p.shape, device="meta")
        new, seed = schedule.new_basis(kind, group, name, q, g32, state.rank, side, p.device)
    if seed < 0:
        new = sharded.broadcast_basis(new, p)  # every rank on the first rank's bits
    old = state.basis
    if state.record.on:
        update_record.close_term(state)
    if state.warm is not None:
        apply_warm(p, name, group, state, new)
    elif old is not None and not group["galore_torch_compat"]:
        moment_exchange.transfer(state, group, side, change_of_basis(old, new, side))
    state.basis = new
    state.basis_seed = seed
    state.on_view = bool(seed >= 0 and seed == schedule.view_seed(group, name))
    state.held = held is not None
    state.basis_refresh = q
    state.refresh = q + 1
    if state.record.on:
        update_record.open_term(state, group["track_cold"])


# ---------------------------------------------------------------------------------------- GaLore groups
def group_path(group: dict[str, Any], params: list[torch.Tensor]) -> str:
    """The group's execution path for this step (group key ``bucket_gemm``): ``"stacked"`` under
    ``stacked``, and under ``auto`` when a parameter is on CUDA; ``"per_matrix"`` otherwise (and
    always for the identity projector, which has no GEMM)."""
    mode = group["bucket_gemm"]
    if mode == "per_matrix" or group["projector"] == "identity":
        return "per_matrix"
    if mode == "auto" and not any(p.device.type == "cuda" for p in params):
        return "per_matrix"
    return "stacked"


def _stackable(p: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p`` joins a stacked bucket on the ``stacked`` path: fp32 weight and gradient, and
    under ``auto`` a CUDA matrix of fewer than :data:`~fedgalore.optim.groups.STACK_AUTO_MAX_NUMEL` entries."""
    if group["bucket_gemm"] == "auto" and (p.device.type != "cuda" or p.numel() >= STACK_AUTO_MAX_NUMEL):
        return False
    return p.dtype == torch.float32 and p.grad.dtype == torch.float32


def galore_group_step(gi: int, group: dict[str, Any], env: StepEnv) -> None:
    """One step of the module doc's rule (paper App. B, Alg. 1 lines 4-9) for every GaLore
    parameter of group ``gi``, on the group's path (:func:`group_path`).

    Per matrix, in parameter order: the refresh when due and its check of ``G`` (:func:`_begin`).
    Then, on the per-matrix path (:func:`_prepare`), the projection ``R`` and the checks, and the
    moments per matrix by the CPU's AVX2 kernel where it applies; the remaining moments a whole
    bucket at once (:mod:`fedgalore.optim.bucket`: the matrices whose moments have one shape,
    stacked; one call of :func:`fedgalore.optim.bucket.adam_moments`, one non-finite check), then
    per matrix the counters, the weight update and the record (:func:`_finish`). On the stacked
    path the matrices do all of it by bucket of one weight shape (:func:`stacked_bucket_step`: one
    ``bmm`` projects, one back-projects). A parameter that raises leaves the ones before it stepped
    (the pending buckets step in ``finally``)."""
    params = list(_with_grads(group, env))
    stacked_path = group_path(group, params) == "stacked"
    pending: list[MatrixStep] = []
    gemm: dict[tuple, list[tuple[torch.Tensor, GaLoreParamState, torch.Tensor, bool]]] = {}
    try:
        for p in params:
            state = state_of(p, group, env)
            if stacked_path and _stackable(p, group):
                begun = _begin(p, group, state, env)
                if begun is not None:
                    key = bucket.bucket_key(state) + (tuple(p.shape), state.side, sharded.shard_dim(p, env.names[p]))
                    gemm.setdefault(key, []).append((p, state) + begun)
                continue
            prep = _prepare(p, group, state, env)
            if prep is None:
                continue
            if prep.direction is not None:  # the AVX2 kernel did the moments
                _finish(group, prep, prep.direction)
            else:
                pending.append(prep)
    finally:
        for key, items in gemm.items():
            for part, chunk in enumerate(kernels.stack_chunks(len(items), items[0][0].numel())):
                stacked_bucket_step(gi, group, key + (part,), items[chunk], env)
        if pending:
            _bucketed_moments_step(gi, group, pending, env)


def _begin(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, env: StepEnv) -> Optional[tuple[torch.Tensor, bool]]:
    """The refresh when due (after checking ``G`` under the ``nonfinite`` policy). Returns the
    fp32 gradient and whether it was checked, or None: the matrix skips this step."""
    g = sharded.local(p.grad)
    g32 = g if g.dtype == torch.float32 else g.float()
    checked = group["projector"] == "identity"  # identity: R is G itself, checked with R
    if not checked and schedule.refresh_due(group, state):
        if _nonfinite(p, env.names[p], group, state, g32):
            return None
        refresh(p, env.names[p], group, state, g32)
        checked = True
    return g32, checked


def _prepare(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, env: StepEnv) -> Optional[MatrixStep]:
    """The per-matrix part of a step before the moments: refresh, projection ``R = G Pᵀ`` /
    ``Pᵀ G`` (App. B), checks; the moments themselves when the CPU kernel applies. None: the
    matrix skips this step.

    Passes over ``m x n`` data in a normal (non-refresh) step of an fp32 parameter: ``G`` is
    read once (the projection ``R``), ``W`` is read and written once (decay and
    back-projection, :func:`fedgalore.optim.kernels.decay_back_project`); the non-finite check,
    the moments, the shadow cold moment and the update record touch ``m x r`` / ``r x n``
    tensors only. A refresh step adds one finite-sum pass over ``G`` and the basis computation;
    bf16 parameters add the fp32 casts of ``G`` and ``W`` and the copy back.

    Non-finite gradients (policy ``nonfinite``): a refresh step checks ``G`` itself, every
    step checks ``R`` (per bucket, :func:`_bucket_moments`, or in the kernel). Under IEEE
    arithmetic a NaN/Inf entry of ``G`` makes its whole row (right) / column (left) of ``R``
    non-finite, whatever the basis entries it meets (``NaN·0 = Inf·0 = NaN``); the
    projection kernel in use is probed for that once per process
    (:func:`fedgalore.optim.kernels.propagates_nonfinite`), and a kernel that fails the probe
    gets ``G`` checked on every step. A finite ``G`` whose projection overflows fp32 also
    counts as non-finite.
    """
    begun = _begin(p, group, state, env)
    if begun is None:
        return None
    g32, checked = begun
    side = state.side
    if group["projector"] == "identity":
        basis, r = None, g32
    else:
        basis = _shard_basis(p, state, env)
        r, propagates = kernels.project_step(g32, basis, side)
        if basis is not state.basis:  # a shard across the basis's dimension: R is the ranks' sum
            r = sharded.all_reduce_sum(r.contiguous(), p)
        if not (propagates or checked) and _nonfinite(p, env.names[p], group, state, g32):
            return None
    return _ready(p, group, state, r, basis, env, kernel=True)


def _shard_basis(p: torch.Tensor, state: GaLoreParamState, env: StepEnv) -> torch.Tensor:
    """The basis the step multiplies this rank's block of ``p`` with: the whole basis, or — for
    a shard that splits the dimension the basis spans (:func:`fedgalore.optim.sharded.along_basis`)
    — the basis's rows (left) / columns (right) of that block."""
    dim = sharded.shard_dim(p, env.names[p])
    if not sharded.along_basis(state.side, dim):
        return state.basis
    return sharded.keep_local(state.basis, p, dim)


def _ready(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, r: torch.Tensor,
           basis: Optional[torch.Tensor], env: StepEnv, kernel: bool) -> Optional[MatrixStep]:
    """After the projection: the warm start's rescale, the ``eps = 0`` check, the coefficients;
    with ``kernel``, the moments by the CPU's AVX2 kernel where it applies."""
    name = env.names[p]
    eps = group["eps"]
    b1, b2 = group["betas"]
    m, v = state.exp_avg, state.exp_avg_sq
    evidence, cold_v = state.v_weight, state.cold_v
    if state.warm_rescale:
        state.warm_rescale = False
        moment_exchange.rescale_warm(v, evidence, r, state)
    if eps == 0.0 and sharded.any_rank(bool(((v == 0) & (r == 0)).any()), p):
        # V stays 0 where both are 0, so M / (sqrt(V̂) + 0) is 0/0: a non-finite update from finite input
        if _nonfinite_update(name, group, state):
            return None
    # M / (sqrt(V) / c2 + eps) = c2 M / (sqrt(V) + c2 eps): AdamW's bias correction of this
    # step's V (v_step + 1) joins the coefficient; 1 with evidence c (V / c is the estimate)
    v_bias = 1.0 if evidence is not None else math.sqrt(1.0 - b2 ** (state.v_step + 1))
    # the shadow cold moment's correction after this step, and the cold cap 1 / (1 - b2^s)
    cold_bias = math.sqrt(1.0 - b2 ** (state.cold_step + 1)) if cold_v is not None else 1.0
    cold_cap = 1.0 / (cold_bias * cold_bias) if group["cap_to_cold"] else 0.0
    prep = MatrixStep(p, state, r, basis, state.side, v_bias, cold_bias, cold_cap)
    if (kernel and not group["galore_torch_compat"] and not sharded.is_sharded(p) and p.numel() >= kernels.ONEDNN_MIN_NUMEL
            and cpu_kernels.moments_usable(r, m, v, evidence, cold_v)):
        # the check of R, M, V (and c, the cold V) and U in one kernel call (same rule as bucket.adam_moments)
        prep.direction = cpu_kernels.adam_moments(r, m, v, b1, b2, eps * v_bias, cold_v=cold_v, v_weight=evidence,
                                                  cold_cap=cold_cap)
        if prep.direction is None and not _nonfinite(p, name, group, state, r):
            raise RuntimeError(f"internal: the moment kernel and torch disagree on whether R of {name!r} is finite")
        if prep.direction is None:
            return None
    return prep


def _bucket_moments(key: tuple, group: dict[str, Any], items: list[MatrixStep], env: StepEnv,
                    r: Optional[torch.Tensor] = None) -> tuple[list[MatrixStep], Optional[torch.Tensor]]:
    """One bucket's moments (App. B, Alg. 1 lines 6-8): ``R`` stacked (or given stacked), one
    non-finite check (per matrix, by the policy, only when it fails), one
    :func:`fedgalore.optim.bucket.adam_moments` on the bucket's stacked state. Returns the
    matrices that step and their ``U`` (``[B, a, b]``; a bucket of one: its own tensors, not stacked)."""
    if r is None or len(items) == 1:
        r = bucket.stack_or_one([x.projected for x in items])
    bad = not math.isfinite(float(r.sum())) and not bool(torch.isfinite(r).all())
    ref = next((x.param for x in items if sharded.is_sharded(x.param)), items[0].param)
    if sharded.any_rank(bad, ref):  # (a sharded bucket: every rank checks its matrices alike)
        items = [x for x in items if not _nonfinite(x.param, env.names[x.param], group, x.state, x.projected)]  # raises, or skips
        if not items:
            return [], None
        r = bucket.stack_or_one([x.projected for x in items])
    b1, b2 = group["betas"]
    compat = group["galore_torch_compat"]
    # a bucket of one is its own tensors with plain numbers (no stack, the same algebra)
    if len(items) == 1:
        st = items[0].state
        stacks = bucket.MomentStack(st.exp_avg, st.exp_avg_sq, st.v_weight, st.cold_v)
    else:
        stacks = env.buckets.bind(key, [x.state for x in items])
    compiled = bool(env.compile)
    eps = bucket.per_matrix([group["eps"] * (1.0 if compat else x.v_bias) for x in items], r, tensor=compiled)
    cap = bucket.per_matrix([x.cold_cap for x in items], r, tensor=compiled) if group["cap_to_cold"] else None
    args = (r, stacks.exp_avg, stacks.exp_avg_sq, b1, b2, eps, stacks.v_weight, stacks.cold_v, cap, compat)
    if not compiled:
        return items, bucket.adam_moments(*args)
    try:
        u = bucket.compiled_moments(env.compile)(*args)
    except Exception as exc:  # torch.compile's own failures (no C++ compiler, an unknown backend): one clear line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise RuntimeError(f"compile_moments={env.compile!r}: torch.compile of the moment step failed ({first}); "
                           "set compile_moments to False (on the CPU it needs a C++ compiler and measured no gain)") from exc
    return items, u


def _bucketed_moments_step(gi: int, group: dict[str, Any], preps: list[MatrixStep], env: StepEnv) -> None:
    """The moments of the prepared matrices, one bucket (:func:`fedgalore.optim.bucket.bucket_key`)
    at a time (:func:`_bucket_moments`); then each matrix's :func:`_finish`."""
    by_key: dict[tuple, list[MatrixStep]] = {}
    for x in preps:
        by_key.setdefault(bucket.bucket_key(x.state), []).append(x)
    for key, items in by_key.items():
        items, u = _bucket_moments((gi, key), group, items, env)
        for x, ux in zip(items, u if len(items) > 1 else [u]):
            _finish(group, x, ux)


def stacked_bucket_step(gi: int, group: dict[str, Any], key: tuple,
                        items: list[tuple[torch.Tensor, GaLoreParamState, torch.Tensor, bool]], env: StepEnv) -> None:
    """A bucket of matrices of one weight shape and side, begun (:func:`_begin`), stepped with
    stacked GEMMs (App. B's rule, batched): ``R`` by one ``bmm``
    (:func:`fedgalore.optim.kernels.project_stacked`), the checks and coefficients per matrix
    (:func:`_ready`), the moments by :func:`_bucket_moments`, the counters and record per matrix
    (:func:`_finish`), and ``W ← d W + coef U P`` for all of them by one ``bmm`` and two
    multi-tensor ops (:func:`fedgalore.optim.kernels.decay_back_project_stacked`)."""
    side = items[0][1].side
    own = [_shard_basis(p, state, env) for p, state, _, _ in items]
    bases = torch.stack(own)
    r, propagates = kernels.project_stacked([g for _, _, g, _ in items], bases, side)
    if own[0] is not items[0][1].basis:  # shards across the bases' dimension: R is the ranks' sum (one all-reduce)
        r = sharded.all_reduce_sum(r, items[0][0])
    preps: list[MatrixStep] = []
    for i, (p, state, g32, checked) in enumerate(items):
        if not (propagates or checked) and _nonfinite(p, env.names[p], group, state, g32):
            continue
        prep = _ready(p, group, state, r[i], own[i], env, kernel=False)
        if prep is not None:
            preps.append(prep)
    if not preps:
        return
    stacked = r if len(preps) == len(items) else None
    preps, u = _bucket_moments((gi,) + key, group, preps, env, stacked)
    if not preps:
        return
    coefs = [_finish(group, x, ux, weight=False) for x, ux in zip(preps, u if len(preps) > 1 else [u])]
    if len(preps) == 1:
        kernels.decay_back_project(sharded.local(preps[0].param), u, preps[0].basis, side, *coefs[0])
        return
    if len(preps) != len(items):
        bases = torch.stack([x.basis for x in preps])
    kernels.decay_back_project_stacked([sharded.local(x.param) for x in preps], u, bases, side, [d for d, _ in coefs],
                                       [c for _, c in coefs])


def _finish(group: dict[str, Any], x: MatrixStep, u: torch.Tensor, weight: bool = True) -> Optional[tuple[float, float]]:
    """The per-matrix part of a step after the moments (``u = M / D``): the step counters, the
    weight update ``W_t = (1 − lr wd) W_{t−1} − lr/(1 − β₁ᵗ) · scale · U P`` (App. B; torch order;
    the official order under compat) and the update record. ``weight=False``: the weight update is
    left to the caller (a stacked bucket), which gets ``(d, coef)``."""
    p, state, basis, side = x.param, x.state, x.basis, x.side
    lr, wd, eps, scale = float(group["lr"]), group["weight_decay"], group["eps"], group["scale"]
    b1, b2 = group["betas"]
    state.step += 1
    state.v_step += 1
    state.view_steps += int(state.on_view)
    t = state.step
    decay = 1.0 - lr * wd
    if group["galore_torch_compat"]:
        step_size = lr
        if group["correct_bias"]:
            step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        # official order, update then decay: W <- d (W - step scale U P) = d W - d step scale U P
        d = decay if wd > 0.0 else 1.0
        if state.record.on:
            update_record.record(state, u, -step_size * scale, d, after=True)
        return _update_weight(p, group, state, u, basis, side, d, -step_size * scale * d, weight)
    coef = -lr / (1.0 - b1**t) * scale
    coef_u = coef * x.v_bias
    cold = None
    cold_v = state.cold_v
    if cold_v is not None:
        state.cold_step += 1
        if state.record.on and state.record.cold is not None:  # U_cold only feeds the record
            cold = (state.exp_avg, cold_v.sqrt().add_(eps * x.cold_bias), coef * x.cold_bias)
        if group["track_cold"]:
            step_diagnostics.observe_ratio(state, state.exp_avg_sq, state.v_weight, cold_v, x.v_bias, x.cold_bias,
                                           x.cold_cap, eps)
    if state.record.on:
        update_record.record(state, u, coef_u, decay, after=False, cold=cold)
    return _update_weight(p, group, state, u, basis, side, decay, coef_u, weight)


def _update_weight(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, u: torch.Tensor,
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
