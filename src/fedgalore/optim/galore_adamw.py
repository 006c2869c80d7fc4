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
  warm-started by :func:`~fedgalore.optim.client_protocol.load_second_moment` is the synchronised *buffer* re-projected
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
the optimizer's creation and at :func:`~fedgalore.optim.client_protocol.mark`, fed the same gradients, moved like
``V``), so no coordinate ever steps larger than a cold start would: a prior that underestimates
``g²`` on a coordinate can no longer enlarge that coordinate's step (with prior weight ``c0`` the
first-step ratio ``|U| / |U_cold|`` reaches ``sqrt(1 + c0 / (1 - b2))`` otherwise). The
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
the round's view basis ``R_k`` (:func:`~fedgalore.optim.client_protocol.view_seed`: seed ``basis_seed(s_k, name, 0)``,
whatever the refresh index), and none after it — the round ends on ``R_k``, so
:func:`~fedgalore.optim.client_protocol.export_moments` sends the second moment unmoved. The caller (FedGaLore's T)
computes ``s`` from the client's local epochs (:func:`fedgalore.federated.client.epoch_switch_step`);
the optimizer knows steps, not epochs. Steps taken on ``R_k`` are counted
(:func:`~fedgalore.optim.client_protocol.moment_diagnostics`: ``view_step_share``; ``upload_kept``, ``warm_kept``).

Group key ``hold_warm_basis`` (default ``False``; NOT the paper's schedule, which refreshes
data-driven bases first — App. E "SVD-to-random projectors"; FedGaLore's ``first_basis: synced``):
with the epoch schedule, a matrix that holds a pending warm start runs the data-driven phase on the
warm start's own basis ``B`` (:func:`fedgalore.optim.schedule.held_basis`: the seeded ``B`` rebuilt
from its seed, or the matrix) and keeps it, unrefreshed, until the switch to ``R_k``: the warm start
then moves nothing (``prior_retained`` = 1 to fp32 rounding) instead of dropping the part of ``v̄``
an unrelated data-driven basis does not span. A matrix without a warm start refreshes as usual.

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
the same first moments would have made with it: :func:`~fedgalore.optim.client_protocol.moment_diagnostics` reports
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

The pieces (laid out as ``torch.optim.AdamW`` over its functional ``adamw``, with
optax-style typed state): this module is the ``torch.optim`` shell — groups and their validation,
names, checkpoints, pickling and ``rebind`` — over :mod:`fedgalore.optim.functional` (the step as
functions: each group's execution path chosen once per step, state creation, the refresh, the
``nonfinite`` policy) and :mod:`fedgalore.optim.state` (the typed per-parameter state,
:class:`~fedgalore.optim.state.GaLoreParamState`). The federated protocol's reads and writes
between steps (``mark``, ``export_update``, ``export_moments``, ``load_second_moment``, ...) are
:mod:`fedgalore.optim.client_protocol`. Smaller modules hold the algebra: :mod:`fedgalore.optim.kernels` (the projection and back-projection
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
multi-tensor ops (:func:`fedgalore.optim.functional.stacked_bucket_step`), the GPU's form (``B − 1`` fewer
launches per GEMM); ``auto`` stacks on CUDA below :data:`STACK_AUTO_MAX_NUMEL` entries and keeps
the CPU per matrix. ``GaLoreAdamW(compile_moments=...)`` compiles the moment step
(:func:`fedgalore.optim.bucket.compiled_moments`; per-step numbers as tensors, so steps, learning
rates and bias corrections never recompile). Both equal the eager per-matrix step to fp32
rounding (tests/optim/test_bucket_gemm.py, tests/optim/test_compiled_moments.py); their GPU gain is not
measured yet (no GPU lent); on the CPU they cost 1.4-4.4x (stacked) and 1.00-1.06x (compiled)
(benchmarks/RESULTS.md §1.2).

``state_dict()`` writes each typed state as tensors and plain Python numbers only (side as ``0=right,
1=left``; :func:`fedgalore.optim.state.to_plain`), so it loads with ``torch.load(weights_only=True)``. GaLore state
(moments, bases, update record) is always fp32, also for bf16 parameters.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

import fedgalore.optim.bucket as bucket
import fedgalore.optim.functional as F
import fedgalore.optim.sharded as sharded
from fedgalore.optim.client_protocol import GaLoreStateEntry, rebuild_delta
from fedgalore.optim.groups import (ADAPTIVE_SCOPES, BIAS_CORRECTIONS, BUCKET_GEMMS, GALORE_DEFAULTS, LOW_PRECISION,
                                    MOMENT_TRANSFERS, NONFINITE_POLICIES, PROJECTORS, WARM_SCALES, fill_galore_group, is_int)
from fedgalore.optim.state import (ADAM_WEIGHT_SHAPED, SHARDED, WEIGHT_SHAPED, AdamParamState, GaLoreParamState, ParamState,
                                   from_plain, map_tensors, to_plain)

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta", "PROJECTORS", "MOMENT_TRANSFERS", "ADAPTIVE_SCOPES", "NONFINITE_POLICIES",
           "GALORE_DEFAULTS", "LOW_PRECISION", "BIAS_CORRECTIONS", "BUCKET_GEMMS", "WARM_SCALES"]  # the group keys: fedgalore.optim.groups


class GaLoreAdamW(Optimizer):
    """AdamW with GaLore gradient-subspace groups (paper App. B; DESIGN §3.1): the ``torch.optim``
    shell over the functional step (:mod:`fedgalore.optim.functional`) and the typed state
    (:mod:`fedgalore.optim.state`); the federated protocol's reads and writes between steps are
    :mod:`fedgalore.optim.client_protocol`.

    Param groups with ``rank`` are GaLore groups (keys of the official package: ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type`` in ``std | reverse_std | left | right``, plus
    ``projector``, ``adaptive_proj_steps``, ``adaptive_scope``, ``moment_transfer``,
    ``rsvd_oversample``, ``rsvd_niter``; defaults in :data:`GALORE_DEFAULTS`). Groups without
    ``rank`` are plain AdamW with torch's conventions (``lr``, ``betas``, ``eps``,
    ``weight_decay``; defaults as ``torch.optim.AdamW``).

    Keys valid for every group: ``galore_torch_compat`` (official update rule), ``correct_bias``
    (compat only), ``projection_seed`` (round seed ``s_k``), ``global_refresh_offset``,
    ``nonfinite`` (``"raise"``: ``FloatingPointError`` naming the parameter; ``"skip"``: that
    parameter's update and state are left untouched for this step and the state's ``skipped``
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
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "galore_torch_compat": bool(galore_torch_compat), "correct_bias": bool(correct_bias),
                    "projection_seed": int(projection_seed), "global_refresh_offset": 0, "nonfinite": nonfinite}
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
        if "rank" in group:
            fill_galore_group(group, gi, names)

    def param_name(self, p: torch.Tensor) -> str:
        """The identity (name) used for ``p`` in seeds and exports."""
        return self._names[p]

    def param_by_name(self, name: str) -> torch.Tensor:
        """The parameter called ``name`` (``KeyError`` for an unknown name)."""
        if name not in self._by_name:
            raise KeyError(f"unknown parameter name {name!r}")
        return self._by_name[name]

    def galore_params(self) -> Iterable[tuple[str, torch.Tensor, dict[str, Any]]]:
        """Every GaLore parameter as ``(name, tensor, group)``, in group and parameter order."""
        for group in self.param_groups:
            if "rank" in group:
                for p in group["params"]:
                    yield self._names[p], p, group

    def param_state(self, p: torch.Tensor, group: dict[str, Any]) -> ParamState:
        """``p``'s typed state (:mod:`fedgalore.optim.state`), created at its first use."""
        return F.state_of(p, group, self._env())

    def _env(self) -> F.StepEnv:
        return F.StepEnv(self._names, self._buckets, self._compile, self.state)

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
                    if isinstance(st, (GaLoreParamState, AdamParamState)):
                        self.state[new] = self._moved_state(old, new, group, st, name)
                    del self._names[old]
                    self._names[new], self._by_name[name] = name, new
                params.append(new)
            group["params"] = params
        self._buckets = bucket.MomentBuckets()  # stacks of the old state's views

    def _moved_state(self, old: torch.Tensor, new: torch.Tensor, group: dict[str, Any], st: ParamState,
                     name: str) -> ParamState:
        """``old``'s state for ``new`` (:meth:`rebind`; :func:`fedgalore.optim.sharded.move_state`)."""
        src, dst = sharded.shard_dim(old, name), sharded.shard_dim(new, name)
        if src is not None and dst is not None:
            raise ValueError(f"rebind: parameter {name!r} is sharded before and after; rebind between a whole "
                             "tensor and its shards")
        p, dim = (new, dst) if src is None else (old, src)
        device = sharded.local(new).device
        if "rank" not in group:
            fields: tuple[str, ...] = ADAM_WEIGHT_SHAPED  # a plain group's moments: shaped like the weight
            moments = False
        else:
            moments = F.moments_sharded(p, name, group, st.side, dim)
            fields = (SHARDED if moments else ()) + WEIGHT_SHAPED
        return sharded.move_state(st, p, dim, fields, moments, to_shard=src is None, device=device)

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

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step over all groups (equations in the module docstring; paper App. B,
        Alg. 1 lines 4-9): each group by its functional step, on the path chosen for the group
        (:func:`fedgalore.optim.functional.galore_group_step`, :func:`~fedgalore.optim.functional.plain_group_step`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        env = self._env()
        for gi, group in enumerate(self.param_groups):
            if "rank" in group:
                F.galore_group_step(gi, group, env)
            else:
                F.plain_group_step(group, env)
        return loss

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict`` with each typed state as plain dicts of tensors and numbers
        (:func:`fedgalore.optim.state.to_plain`), so it loads with ``torch.load(weights_only=True)``."""
        out = super().state_dict()
        out["state"] = {k: to_plain(v) for k, v in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like ``Optimizer.load_state_dict`` but keeps state dtypes (fp32 GaLore state stays fp32)
        and restores the typed states (:func:`fedgalore.optim.state.from_plain`)."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        current = chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved, current))
        for k, v in state_dict["state"].items():
            if k in id_map:
                p = id_map[k]
                typed = from_plain(v) if isinstance(v, dict) and v else v  # ({}: a parameter never stepped)
                self.state[p] = map_tensors(typed, lambda x, d=p.device: x.detach().to(device=d, copy=True))
        self._buckets = bucket.MomentBuckets()
