"""FedGaLore (paper §5, Algorithm 1) and its ablations FedGaLore⁻ (no sync) and mean sync.

T: GaLoreAdamW (:class:`fedgalore.optim.GaLoreAdamW`) on every adapted weight matrix, AdamW on
the head; the projection seed s_k is broadcast, the optimizer's second moment is warm-started
from the server's synchronised state v̄_k projected onto the client's first basis, and the
client uploads (i) its exact low-rank update record ΔW_i = decay·W̄ + Σ_q U_iq P_q
(coefficients + seeds for seeded bases) and (ii) its final projected second moment ṽ_i with its
basis identity (Algorithm 1, lines 8–9).

A: FedAvg, θ̄_{k+1} = θ̄_k + Σ_i p̃_i Δθ_i (line 11). Terms on the same seeded basis are summed
in coefficient space first, (Σ_i p̃_i U_iq) P_q, so the aggregate stays factored.

S: matrix views V_i = ṽ_i R_iᵀ and v̄_{k+1} = Σ_i p̃_i (μ_i + J_i) from AJIVE
(:func:`fedgalore.sync.synchronize_moments`, lines 12–13), kept factored and broadcast.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch import nn

from fedgalore.federated.client import local_train
from fedgalore.federated.payload import (
    Dense,
    Factored,
    GaLoreUpdate,
    LowRank,
    MomentView,
    Payload,
    SeededLowRank,
)
from fedgalore.methods.base import (
    ClientContext,
    MethodError,
    RoundContext,
    ServerState,
    load_params,
    named_params,
    register,
)
from fedgalore.methods.fedavg_full import DenseTargetsMethod

_SYNC_MODES = ("none", "mean", "mean_svd", "ajive")


def aggregate_galore_updates(
    updates: Sequence[GaLoreUpdate], weights: Sequence[float], w0: torch.Tensor
) -> torch.Tensor:
    """Σ_i p_i ΔW_i for exact GaLore update records, ΔW_i = a_i W0 + Σ_q term_iq.

    Seeded terms that share a seed (same basis P) are combined as (Σ_i p_i U_iq) P before the
    single back-projection; data-driven terms are lifted one by one. Computed in fp32.
    """
    out = torch.zeros(w0.shape, dtype=torch.float32)
    seeded: dict[tuple[int, str], tuple[torch.Tensor, SeededLowRank]] = {}
    decay = 0.0
    for upd, p in zip(updates, weights):
        decay += float(p) * upd.decay
        for term in upd.terms:
            if isinstance(term, SeededLowRank):
                key = (term.seed, term.side)
                acc = seeded.get(key)
                coef = term.coef.float() * float(p)
                seeded[key] = (coef if acc is None else acc[0] + coef, term)
            else:
                out.add_(term.materialize(), alpha=float(p))
    for coef, term in seeded.values():
        out += SeededLowRank(coef, term.seed, term.side, term.shape).materialize()
    if decay != 0.0:
        out.add_(w0.float(), alpha=decay)
    return out


@register
class FedGaLore(DenseTargetsMethod):
    name = "fedgalore"
    summary = "GaLore-AdamW clients (seeded SVD→random projectors) + FedAvg + AJIVE sync of projected second moments"
    default_sync = "ajive"
    #: variants pin their sync mode; a ``sync`` option from a shared config does not override it
    fixed_sync: str | None = None

    def __init__(
        self,
        rank: int = 8,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        proj_type: str = "std",
        projector: str = "rsvd_then_random",
        adaptive_proj_steps: int = 1,
        moment_transfer: str = "squared",
        sync: str | None = None,
        joint_rank: int | str | None = None,
        sync_center: bool = True,
        galore_torch_compat: bool = False,
        **options: Any,
    ) -> None:
        sync = self.fixed_sync or (self.default_sync if sync is None else sync)
        if sync not in _SYNC_MODES:
            raise MethodError(f"method option sync={sync!r} must be one of {', '.join(_SYNC_MODES)}")
        if update_proj_gap < 1:
            raise MethodError("method option update_proj_gap (tau) must be >= 1")
        super().__init__(
            rank,
            update_proj_gap=update_proj_gap,
            scale=scale,
            proj_type=proj_type,
            projector=projector,
            adaptive_proj_steps=adaptive_proj_steps,
            moment_transfer=moment_transfer,
            sync=sync,
            joint_rank=joint_rank,
            sync_center=sync_center,
            galore_torch_compat=galore_torch_compat,
            **options,
        )
        self.sync = sync
        self.joint_rank = rank if joint_rank is None else joint_rank
        extra = set(options) - {"adaptive_scope", "rsvd_oversample", "rsvd_niter", "nonfinite"}
        if extra:
            raise MethodError(f"unknown fedgalore option(s) {sorted(extra)}")

    def _galore_group(self, named: list[tuple[str, nn.Parameter]], ctx: ClientContext) -> dict[str, Any]:
        o = self.options
        group = {
            "params": named,
            "rank": self.rank,
            "update_proj_gap": o["update_proj_gap"],
            "scale": o["scale"],
            "proj_type": o["proj_type"],
            "projector": o["projector"],
            "adaptive_proj_steps": o["adaptive_proj_steps"],
            "moment_transfer": o["moment_transfer"],
        }
        for k in ("adaptive_scope", "rsvd_oversample", "rsvd_niter", "nonfinite"):
            if k in o:
                group[k] = o[k]
        return group

    # ------------------------------------------------------------------ T
    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {k: Dense(v) for k, v in state.params.items()}
        for n in self.targets:
            key = f"moment/{n}"
            if f"{key}/left" in state.extras:
                entries[key] = Factored(state.extras[f"{key}/left"], state.extras[f"{key}/core"], state.extras[f"{key}/right"])
        return Payload(entries, {"round": ctx.round, "round_seed": ctx.round_seed})

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        from fedgalore.optim import GaLoreAdamW

        start = {n: broadcast[n].materialize() for n in self.targets + self.heads}
        load_params(model, start)
        params = named_params(model, self.targets + self.heads)
        tc = ctx.train
        groups = [self._galore_group([(n, params[n]) for n in self.targets], ctx)]
        if self.heads:
            groups.append({"params": [(n, params[n]) for n in self.heads], "lr": tc.head_lr or tc.lr})
        opt = GaLoreAdamW(
            groups,
            lr=tc.lr,
            betas=tc.betas,
            eps=tc.eps,
            weight_decay=tc.weight_decay,
            galore_torch_compat=self.options["galore_torch_compat"],
        )
        opt.set_projection_seed(int(broadcast.meta.get("round_seed", ctx.round_seed)))
        if self.options.get("adaptive_scope", "round") == "global":
            # the paper's "data-driven early, random later" over the whole federation: refreshes a
            # client would have made in earlier rounds at the nominal local step count (stateless,
            # identical for every client, so from round ⌈S/refreshes per round⌉ on all bases are seeded)
            per_round = -(-ctx.steps_per_round // int(self.options["update_proj_gap"]))
            opt.set_global_refresh_offset(ctx.round * per_round)
        if self.sync != "none":
            for n in self.targets:
                key = f"moment/{n}"
                if key in broadcast:
                    f = broadcast[key]
                    assert isinstance(f, Factored)
                    opt.load_second_moment(n, f.left, f.core, f.right)
        opt.mark()
        stats = local_train(model, opt, ctx, params.values())
        entries: dict[str, Any] = dict(opt.export_update())
        for n in self.heads:
            entries[n] = Dense(params[n].detach().float() - start[n].float())
        if self.sync != "none":
            beta2 = float(tc.betas[1])
            for n, st in opt.export_state().items():
                view = st.moment_view()  # the basis travels only when it is data-driven
                if not st.warm and st.step > 0:
                    # upload an estimate of E[g̃²]: a cold EMA is biased low by (1 − β2^t); a
                    # warm-started one already is an estimate (it was never bias-corrected)
                    view = MomentView(view.moment / (1.0 - beta2 ** st.step), view.side, view.shape, view.basis, view.seed)
                entries[f"moment/{n}"] = view
        return Payload(entries, {"num_examples": ctx.num_examples, **stats})

    # ------------------------------------------------------------------ A
    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext):
        applied = {}
        for n in self.targets:
            delta = aggregate_galore_updates([u[n] for u in uploads], weights, state.params[n])  # type: ignore[misc]
            state.params[n] += delta
            applied[n] = delta
        self.average_heads(state, uploads, weights)
        return applied

    def validate_upload(self, state, upload, ctx):
        """Seeded bases must come from this round's seed chain; ranks must not exceed r."""
        from fedgalore.optim import derive_seed

        identity = self.options["projector"] == "identity"
        for n in self.targets:
            upd = upload[n]
            if not isinstance(upd, GaLoreUpdate):
                return f"{n}: expected a GaLore update record, got {type(upd).__name__}"
            # term q belongs to refresh q, so its seed (if seeded) is derive_seed(s_k, name, q)
            valid = {derive_seed(ctx.round_seed, n, q) for q in range(len(upd.terms) + 1)}
            for term in upd.terms:
                rank = term.coef.shape[1] if isinstance(term, SeededLowRank) and term.side == "right" else (
                    term.coef.shape[0] if isinstance(term, SeededLowRank) else term.left.shape[1])
                if not identity and rank > self.rank:
                    return f"{n}: update rank {rank} exceeds method.rank={self.rank}"
                if isinstance(term, SeededLowRank):
                    if term.seed not in valid:
                        return f"{n}: basis seed {term.seed} does not belong to round seed {ctx.round_seed}"
            mv = upload.entries.get(f"moment/{n}")
            if mv is not None and mv.seed is not None:
                if mv.seed not in valid:
                    return f"moment/{n}: basis seed {mv.seed} does not belong to round seed {ctx.round_seed}"
        return None

    def scale_upload(self, upload, factor):
        entries: dict[str, Any] = {}
        for k, e in upload.entries.items():
            if isinstance(e, GaLoreUpdate):
                terms = tuple(
                    LowRank(t.left * factor, t.right) if isinstance(t, LowRank) else SeededLowRank(t.coef * factor, t.seed, t.side, t.shape)
                    for t in e.terms
                )
                entries[k] = GaLoreUpdate(e.decay * factor, terms, e.shape)
            elif isinstance(e, Dense):
                entries[k] = Dense(e.tensor * factor)
            else:
                entries[k] = e  # second-moment views are state, not update
        return Payload(entries, dict(upload.meta))

    def client_deltas(self, state, upload):
        return {n: upload[n].materialize(state.params[n]) for n in self.targets}  # type: ignore[call-arg]

    # ------------------------------------------------------------------ S
    def synchronize(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext):
        if self.sync == "none":
            return {}
        from fedgalore.sync import synchronize_moments

        diags: dict[str, list[float]] = {}
        for j, n in enumerate(self.targets):
            views = [u[f"moment/{n}"] for u in uploads]
            with warnings.catch_warnings():
                # client views are exactly rank r, so AJIVE lowers ranks it cannot use every round;
                # expected, and recorded in the diagnostics (joint_rank, state_rank)
                warnings.simplefilter("ignore", RuntimeWarning)
                res = synchronize_moments(
                    views,  # type: ignore[arg-type]
                    weights,
                    mode=self.sync,
                    joint_rank=self.joint_rank,
                    center=self.options["sync_center"],
                    seed=(ctx.round_seed + j) % (2**63),
                )
            key = f"moment/{n}"
            if res.state is not None:
                state.extras[f"{key}/left"] = res.state.left.float()
                state.extras[f"{key}/core"] = res.state.core.float()
                state.extras[f"{key}/right"] = res.state.right.float()
            for k, v in res.diagnostics.items():
                if isinstance(v, (int, float)):
                    diags.setdefault(k, []).append(float(v))
        return {k: sum(v) / len(v) for k, v in diags.items()}



@register
class FedGaLoreMinus(FedGaLore):
    name = "fedgalore_minus"
    summary = "FedGaLore without second-moment synchronisation (paper's FedGaLore⁻ ablation)"
    fixed_sync = "none"


@register
class FedGaLoreMean(FedGaLore):
    name = "fedgalore_mean"
    summary = "FedGaLore with plain weighted-mean second-moment sync (ablation)"
    fixed_sync = "mean"
