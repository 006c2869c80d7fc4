"""FedGaLore (paper §5, Algorithm 1) and its ablations FedGaLore⁻ (no sync) and mean sync.

T: GaLoreAdamW (:class:`fedgalore.optim.GaLoreAdamW`) on every adapted weight matrix, AdamW on
the head; the projection seed s_k is broadcast, the optimizer's second moment is warm-started
from the server's synchronised state v̄_k, and the client uploads (i) its exact low-rank update
record ΔW_i = decay·W̄ + Σ_q U_iq P_q (coefficients + seeds for seeded bases) and (ii) its final
projected second moment ṽ_i as a :class:`MomentView` (Algorithm 1, lines 8–10).

A: FedAvg, θ̄_{k+1} = θ̄_k + Σ_i p̃_i Δθ_i (line 11). Terms on the same seeded basis are summed
in coefficient space first, (Σ_i p̃_i U_iq) P_q, so the aggregate stays factored.

S: AJIVE (or mean) on the views V_i = ṽ_i Bᵀ over one shared basis B, v̄_{k+1} = Σ_i p̃_i (μ_i +
J_i) kept as coordinates on B (:func:`fedgalore.sync.synchronize_moments`, lines 12–14).

Projector schedule (option ``projector_schedule``; paper §4 "SVD-to-random projectors": data-driven
projectors in early local epochs, a seeded random projector in later ones; App. E). ``epoch``
(default): the client's GaLoreAdamW refreshes a data-driven (RSVD) basis at local steps 0, τ, 2τ, …
of its first ``adaptive_epochs`` local epochs, then switches to the round's seeded basis R_k =
``seeded_basis(basis_seed(s_k, name, 0))`` (``client_protocol.view_seed``) and keeps it to the end of
the round (:func:`fedgalore.federated.client.epoch_switch_step`). So with E ≥ 2 every client ends
the round on R_k: its second-moment view is already on Algorithm 1's shared basis and is uploaded
as it is (paper mode: the raw buffer, exactly). ``share``: the same with the first
``adaptive_share`` of the round's local steps (budgets of ``train.local_steps``, which have no
epochs). ``steps`` (the default before the epoch schedule): refreshes every τ steps, the first ``adaptive_proj_steps``
data-driven — with τ longer than a client-round (τ = 50 / 200 against 1–27 local steps) no client
ever left its RSVD basis, and every upload was moved onto the unrelated R_k (the review kept
6.8 % of ‖ṽ‖ in paper mode). Per round the diagnostics record ``view_step_share`` (share of local
steps run on R_k), ``upload_kept`` (share of ‖ṽ‖ the upload's move to the view basis keeps; 1
when none is needed) and ``warm_kept`` (share of ‖v̄‖ — of ‖c̄∘v̄‖ in the aligned protocol — that
the next round's warm start keeps when it moves v̄ from R_k onto the client's first, RSVD basis:
R_k and R_{k+1} differ with the round seed, so most of v̄ is lost there; that is Algorithm 1's
per-round seed, not a defect of ours; ``first_basis: synced``, next, is a non-paper mode that keeps it).

``first_basis: synced`` (study option; default ``adaptive`` = Algorithm 1) is NOT the paper's
Algorithm 1, which refreshes data-driven bases first (App. E "SVD-to-random projectors"). It exists
because that order leaves the sync little to act on: the warm start moves v̄ from its view basis B
onto an unrelated RSVD basis and keeps a few per cent of it (``prior_retained`` ~2 % in our offline
text-task measurements, ~11 % on ``tiny_text`` at rank 4). For the feature-skew study, with
``synced`` a client that received v̄ runs the data-driven phase (the first ``adaptive_epochs`` local
epochs, the ``share`` schedule's ``adaptive_share``) on B itself — R_{k−1} under ``paper`` /
``view_basis: seeded``, the consensus basis otherwise (under the epoch schedule every client ends on
R_k, so the views share it and B is R_{k−1} there too) — held without refreshes (GaLoreAdamW group
key ``hold_warm_basis``), so the warm start is exact (``prior_retained`` = 1, ``warm_kept`` = 1 to
fp32 rounding; paper mode still clamps v̄'s negative entries); then it switches to R_k and uploads
there as before. Round 1 (no v̄) and a matrix without a state are unchanged. Nothing new travels:
B is what the client already receives with v̄ (a seed, or the consensus matrix); the record's term
on a seeded B is that seed (``validate_upload`` accepts the seed of the state the server
broadcast), on a consensus B the matrix, as an RSVD term's basis would be. At a lower site rank B
is the leading block of v̄'s frame (the site keeps that block's share of v̄). Refused
(:data:`REFUSED_COMBINATIONS`) without a sync and without a data-driven phase (a projector other
than ``*_then_random``, ``projector_schedule: steps``, ``adaptive_epochs``/``adaptive_share`` 0).

Two protocols for the second moment (method option ``moment_protocol``; docs/design.md §3.1–3.2;
the rules for the moment and its evidence: :mod:`fedgalore.protocol.second_moment`):

* ``paper`` — Algorithm 1 as written:
  line 3: the client's GaLoreAdamW state starts from the synchronised buffer v̄, re-projected onto
  its first basis by App. B's linear buffer reprojection and clamped at 0
  (``second_moment.warm_paper``); AdamW then runs as a freshly initialised optimizer, its bias
  correction counting this round's steps (``bias_correction="steps"``);
  line 6: in-round refreshes move the buffers linearly (``moment_transfer`` resolves to
  ``linear``, App. B);
  line 10: the upload is the raw projected buffer ṽ_T (``export_moments(buffer=True)``), no
  evidence; under the epoch schedule every client ends the round on R_k and sends ṽ_T exactly; a
  client whose last basis is not R_k (``projector_schedule: steps``) moves ṽ there by
  ``moment_transfer`` first (the paper does not say what such a client sends: our reading);
  line 13: the views V_i = ṽ_i R_kᵀ on the round's seeded basis R_k (``client_protocol.view_seed``:
  seed s_k and the parameter only), identical for every client; the upload carries the seed;
  line 12–14: v̄ = AJIVE's joint component (+ the centring mean; AJIVE's k = r), pooled with the
  client weights p̃_i (:func:`fedgalore.sync.synchronize_moments`; the paper does not state the
  combination weights: p̃_i, as its FedAvg).
  Deviations from Algorithm 1 and App. B, all of them (an earlier version of this docstring
  listed only (a) and (b)):

  (a) what a client whose last basis is not R_k uploads (line 10, above; none under the epoch
      schedule);
  (b) the combination weights of the sync, p̃_i (the paper's FedAvg weights; it states none);
  (c) the clamp after the linear move: App. B writes ṽ ← ṽ C, which can make entries negative
      (no square root); we clamp them at 0 (``second_moment.move``/``warm_paper``). At the epoch
      schedule's RSVD → R_k switch this literal rule leaves many coordinates of ṽ at 0 while m̃
      moves with C, and the next steps are much larger than a cold start's
      (tests/optim/test_epoch_schedule.py; benchmarks/RESULTS.md §5.5);
  (d) AJIVE centres the views; the centring mean is added back, v̄ = Σ p̃_i (μ_i + J_i);
  (e) R_k is the seeded basis of local refresh 0, ``basis_seed(s_k, name, 0)``, whatever the
      refresh index at which a client switches to it (the paper: "the projector is fully
      determined by an integer seed");
  (f) ε placement: torch AdamW's, ε added after the bias correction, M / (√(V/(1−β₂ᵗ)) + ε), i.e.
      ε·√(1−β₂ᵗ) in App. B's form √ṽ + ε with the correction in the step size
      (``galore_torch_compat`` restores App. B's / HF's placement);
  (g) decoupled weight decay W ← (1 − η_t λ) W with the scheduled rate η_t, not bias-corrected
      (App. B's η_t "includes the AdamW step size (with bias correction when enabled)" for both
      terms);
  (h) the epoch schedule's readings: with E = 1 the shipped configs take half an epoch
      data-driven (``adaptive_epochs: 0.5``), and a client whose first-epoch boundary falls in its
      last step runs that step on R_k, so every client ends on it.
  (An earlier variant of ours uploaded a debiased estimate and then skipped the bias correction at
  the warm start; its ~20x larger first steps were ours, not the paper's, and it is gone: CHANGELOG.md, 2026-11-25.)
* ``aligned`` (default; ours) — keeps the preconditioner across the round boundary: each
  coordinate carries its evidence c (``bias_correction="weight"``; uploads are estimates V/c with
  c), the server pools estimates weighted by p̃_i c_i (a client with no evidence for a coordinate
  does not move it; AJIVE's joint subspace weights each view by its evidence too,
  :func:`fedgalore.sync.moments.evidence_weights`), the warm start is exact on the basis v̄ is
  expressed in and moves to the
  client's first basis by the in-round (sign-invariant, ``squared``) rule, evidence included — a
  direction the prior does not cover gets its scale from the fresh gradients — and, with
  ``cold_cap`` (default), no coordinate ever steps larger than a cold start would
  (``GaLoreAdamW`` ``cap_to_cold``: the denominator uses max(V̂, V̂_cold)). ``view_basis`` picks
  B: ``seeded`` (R_k, as the paper) or ``consensus`` (the top-r principal subspace of the clients'
  own data-driven bases, computed by the server and broadcast with v̄).

``sync: aggregate`` (ours, for client-level DP; :meth:`FedGaLore._sync_from_aggregate`): no
moment upload at all — v̄'s *shape* on R_k is the squared aggregated update block, each client
puts it at its own gradient scale at its first step (``GaLoreAdamW`` ``warm_scale="gradient"``);
under ``privacy.client`` that is post-processing of the noised sum (no second release).

Per round the diagnostics record, averaged over the round's clients: ``warm_clamped`` (share of
warm-start entries clamped at 0), ``prior_retained`` (aligned: share of the prior weight that
the move to the first basis kept), ``v_warm_cold_ratio`` (median of V̂ / V̂_cold at the round's
end, V̂_cold a shadow cold start fed the same gradients), ``client_update_norm_precond`` and
``client_update_norm_cold`` (‖Σ_q C_q P_q‖_F of the update with the warm and the shadow cold
second moment) and their ratio ``update_norm_vs_cold``; and the worst client's distribution of
|U|/|U_cold| over every coordinate and step (``update_ratio_max``, ``update_ratio_p99``) with the
mean share above 1 (``update_ratio_above``).
"""
from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch
from torch import nn

from fedgalore.federated.client import epoch_switch_step, local_train, optimizer_steps
from fedgalore.federated.robust import update_terms as robust_update_terms
from fedgalore.federated.diagnostics import FactoredDelta
from fedgalore.methods.downlink_mixin import DOWNLINK_HELP, FactoredDownlink
from fedgalore.methods.base import MethodError, MethodOptions, load_params, named_params, option, register, register_preset
from fedgalore.methods.fedavg_full import DenseTargetsMethod
from fedgalore.methods.traits import MethodTraits
from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank
from fedgalore.optim.galore_adamw import (
    ADAPTIVE_SCOPES,
    BUCKET_GEMMS,
    GALORE_DEFAULTS,
    LOW_PRECISION,
    MOMENT_TRANSFERS,
    NONFINITE_POLICIES,
    PROJECTORS,
    GaLoreAdamW,
)
from fedgalore.optim import client_protocol
from fedgalore.optim.projector import PROJ_TYPES, resolve_side
from fedgalore.protocol import downlink
from fedgalore.protocol.bases import basis_seed, frame_of, padded_sum
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState
from fedgalore.sync.moments import MODES as _MOMENT_SYNC_MODES, nested_views
from fedgalore.sync.batched import synchronize_moments_many

_PROTOCOLS = ("paper", "aligned")
_SCHEDULES = ("epoch", "share", "steps")
_VIEW_BASES = ("seeded", "consensus")
#: option first_basis: the data-driven phase on RSVD refreshes (Algorithm 1) or on v̄'s view basis (not the paper)
_FIRST_BASES = ("adaptive", "synced")
#: S's modes: the moment sync's (fedgalore.sync.moments), and ``aggregate`` (v̄ from the aggregated update)
_SYNC_MODES = _MOMENT_SYNC_MODES + ("aggregate",)
#: per-client numbers the optimizer reports (upload meta) and the round's diagnostics average
_CLIENT_DIAGS = ("warm_clamped", "prior_retained", "warm_kept", "warm_rescale", "view_step_share", "upload_kept", "v_warm_cold_ratio",
                 "client_update_norm_precond", "client_update_norm_cold", "update_ratio_above")
#: per-client numbers the round reports as their maximum over clients (the worst client)
_CLIENT_MAX_DIAGS = ("update_ratio_max", "update_ratio_p99")


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


@dataclass(frozen=True)
class FedGaLoreOptions(MethodOptions):
    """FedGaLore's options: the client optimizer's GaLore keys (paper App. B, App. E) and the
    server's second-moment protocol (§5, docs/design.md §3.1–3.2); the study options last (their
    comment block). Ranges: :meth:`__post_init__`; the combinations refused:
    :data:`REFUSED_COMBINATIONS` (checked by :meth:`FedGaLore.resolve_options`)."""

    update_proj_gap: int = option(200, "τ: optimizer steps between projector refreshes (epoch schedule: in the data-driven phase)")
    scale: float = option(0.25, "GaLore scale α of the back-projected update")
    proj_type: Literal[PROJ_TYPES] = option("std", "side of the basis: std projects the smaller dimension")
    projector: Literal[PROJECTORS] = option("rsvd_then_random", "basis kind; *_then_random: data-driven first, then seeded random (App. E)")
    projector_schedule: Literal[_SCHEDULES] = option(
        "epoch", "when *_then_random switches to seeded bases — epoch: data-driven for the first adaptive_epochs local "
                 "epochs, then the round's seeded basis R_k to the round's end, so every client ends on R_k (paper §4, "
                 "App. E); share: the same with the first adaptive_share of the round's local steps (for train.local_steps "
                 "budgets); steps: after adaptive_proj_steps refreshes every update_proj_gap steps (never reaches R_k)")
    adaptive_epochs: float = option(1.0, "epoch schedule: local epochs on data-driven (RSVD) bases before R_k (0: R_k from the start)")
    adaptive_share: float = option(0.5, "share schedule: share of the round's local steps on data-driven bases before R_k")
    moment_transfer: Literal[MOMENT_TRANSFERS] | None = option(
        None, "how the moments move when the basis changes (null: linear for moment_protocol=paper, App. B; squared otherwise)")
    rsvd_oversample: int = option(GALORE_DEFAULTS["rsvd_oversample"], "oversampling of the randomised SVD")
    rsvd_niter: int = option(GALORE_DEFAULTS["rsvd_niter"], "power iterations of the randomised SVD")
    nonfinite: Literal[NONFINITE_POLICIES] = option("raise", "a non-finite gradient: raise, or skip that parameter's step")
    low_precision: Literal[LOW_PRECISION] = option(
        "compensated", "bf16/fp16 weights: compensated (keep what each step's rounding lost, 2 bytes per entry, and add it "
                       "back), master (an fp32 master copy, 4 bytes per entry) or off (the rounding is lost: the client's "
                       "weights move less than the update it uploads)")
    bucket_gemm: Literal[BUCKET_GEMMS] = option(
        "auto", "the GEMMs of the matrices of one shape: stacked (one bmm projects them, one back-projects), per_matrix, "
                "or auto (stacked on CUDA for matrices under 2^22 entries, where kernel launches dominate; per matrix on "
                "the CPU, where the stacked form measured 1.4-4.4x slower, benchmarks/RESULTS.md §1.2)")
    compile_moments: bool = option(
        False, "torch.compile the moment step of each bucket (inductor; one fused kernel on a GPU; no recompilation "
               "across steps; needs a C++ compiler on the CPU and measured no gain there)")
    sync: Literal[_SYNC_MODES] | None = option(
        None, "second-moment sync S (null: ajive; the ablations pin theirs). aggregate: no moment upload; the server "
              "builds v̄'s shape on R_k from the round's aggregated update (zero extra release under privacy.client) "
              "and each client puts it at its own gradient scale")
    joint_rank: int | Literal["auto"] | None = option(None, "AJIVE joint rank k (null: the rank r; auto: Wedin/random-direction bounds)")
    moment_protocol: Literal[_PROTOCOLS] = option("aligned", "paper: Algorithm 1 as written; aligned: estimates with their evidence across rounds")
    view_basis: Literal[_VIEW_BASES] | None = option(None, "shared view basis B (null: seeded for paper, consensus for aligned)")
    downlink: Literal["auto", "dense", "factored"] = option("auto", DOWNLINK_HELP)

    # --- study options: reference and ablation switches of our studies (benchmarks/, tests); no
    # shipped config (conf/) sets them and a run keeps their defaults. The steps schedule's refresh
    # count and scope (the steps schedule), AJIVE's centring and batching, the aligned protocol's cap,
    # the official optimizer's rule, and the non-paper first basis of the feature-skew study. Keys as
    # before: method.options.<name>.
    adaptive_proj_steps: int = option(1, "steps schedule: data-driven refreshes before the seeded random ones (S)")
    adaptive_scope: Literal[ADAPTIVE_SCOPES] = option(GALORE_DEFAULTS["adaptive_scope"], "count those refreshes per round or over the whole run (global)")
    sync_center: bool = option(True, "AJIVE centres each view (the mean joins the synchronised state)")
    sync_batched: bool = option(True, "run S on same-shape matrices together (batched linear algebra, the same "
                                      "equations and decisions; false: one matrix at a time, the reference)")
    cold_cap: bool = option(True, "aligned: no coordinate steps larger than a cold start (denominator max(V̂, V̂_cold)); "
                                  "false = the uncapped prior")
    galore_torch_compat: bool = option(False, "the official galore_torch update rule (needs moment_protocol=paper when synced)")
    first_basis: Literal[_FIRST_BASES] = option(
        "adaptive", "bases of the data-driven phase (adaptive_epochs / adaptive_share) — adaptive: RSVD refreshes, as "
                    "Algorithm 1 (App. E); synced (NOT the paper; ours, for the feature-skew study): a client holding a "
                    "synchronised v̄ runs that phase on v̄'s view basis B (R_{k-1} or the consensus basis), so the warm "
                    "start keeps v̄ whole (prior_retained 1 instead of a few %), then switches to R_k as usual")

    def __post_init__(self) -> None:
        if self.update_proj_gap < 1:
            raise MethodError("option update_proj_gap (tau) must be >= 1")
        if not (isinstance(self.adaptive_epochs, (int, float)) and math.isfinite(self.adaptive_epochs) and self.adaptive_epochs >= 0):
            raise MethodError(f"option adaptive_epochs must be a number >= 0, got {self.adaptive_epochs!r}")
        if not (isinstance(self.adaptive_share, (int, float)) and 0.0 <= self.adaptive_share <= 1.0):
            raise MethodError(f"option adaptive_share must be a number in [0, 1], got {self.adaptive_share!r}")


class _Resolving(NamedTuple):
    """The options with their method-dependent defaults resolved, as the refusals read them."""

    o: FedGaLoreOptions
    sync: str
    view_basis: str
    transfer: str
    schedule: str


#: FedGaLore's cross-option refusals, in the order they are checked: (refused when, why and what to set).
#: The options' own ranges are checked by FedGaLoreOptions.__post_init__.
REFUSED_COMBINATIONS: tuple[tuple[Callable[[_Resolving], bool], str], ...] = (
    (lambda r: r.o.moment_protocol == "paper" and r.view_basis != "seeded",
     "moment_protocol='paper' synchronises on the round's seeded basis R_k: use view_basis='seeded' (or moment_protocol='aligned')"),
    (lambda r: r.o.galore_torch_compat and r.o.moment_protocol == "aligned" and r.sync != "none",
     "galore_torch_compat reproduces the official optimizer, which has no prior weights: use moment_protocol='paper'"),
    (lambda r: r.o.moment_protocol == "aligned" and r.sync != "none" and r.transfer == "linear",
     "moment_transfer='linear' cannot move the aligned protocol's per-coordinate evidence "
     "(V C / c is no longer an average of old estimates): use moment_transfer='squared', "
     "or moment_protocol='paper'"),
    (lambda r: r.sync == "aggregate" and r.o.moment_protocol != "aligned",
     "sync='aggregate' puts a shape prior at each client's own gradient scale, which needs the "
     "aligned protocol's estimates: use moment_protocol='aligned' (or another sync)"),
    (lambda r: r.sync == "aggregate" and r.o.view_basis not in (None, "seeded"),
     "sync='aggregate' builds v̄ on the round's seeded basis R_k (no client views to fit a "
     "consensus basis to): use view_basis='seeded' (or leave it null)"),
    (lambda r: r.sync == "aggregate" and r.o.projector != "random"
     and not (r.o.projector.endswith("_then_random") and r.schedule != "steps"),
     "sync='aggregate' reads v̄ from the aggregated update's block on R_k, which only a round "
     "that ends on R_k has: use projector='random', or a *_then_random projector with "
     "projector_schedule epoch or share"),
    (lambda r: r.schedule != "steps" and r.o.adaptive_scope == "global",
     "adaptive_scope='global' counts data-driven refreshes across rounds, which only the steps "
     "schedule has: set projector_schedule: steps (or adaptive_scope: round)"),
    # first_basis: synced (not the paper) replaces the data-driven phase's bases by v̄'s view basis
    (lambda r: r.o.first_basis == "synced" and r.sync == "none",
     "first_basis='synced' runs the data-driven phase on the synchronised state's basis, and without "
     "a sync (sync: none, fedgalore_minus) there is none: use first_basis='adaptive'"),
    (lambda r: r.o.first_basis == "synced" and not r.o.projector.endswith("_then_random"),
     "first_basis='synced' replaces the data-driven phase of a *_then_random projector, which this "
     "projector does not have: use projector='rsvd_then_random' (or first_basis='adaptive')"),
    (lambda r: r.o.first_basis == "synced" and r.schedule == "steps",
     "first_basis='synced' holds v̄'s basis through the epoch or share schedule's data-driven phase, "
     "which projector_schedule='steps' does not have: use projector_schedule epoch or share (or first_basis='adaptive')"),
    (lambda r: r.o.first_basis == "synced" and (r.o.adaptive_epochs if r.schedule == "epoch" else r.o.adaptive_share) == 0,
     "first_basis='synced' replaces the data-driven phase, which adaptive_epochs=0 (epoch schedule) or "
     "adaptive_share=0 (share schedule) leaves empty: give it a phase (or first_basis='adaptive')"),
)


def refuse_combinations(resolving: _Resolving) -> None:
    """The first of :data:`REFUSED_COMBINATIONS` that ``resolving`` meets, as a :class:`MethodError`."""
    for refused, why in REFUSED_COMBINATIONS:
        if refused(resolving):
            raise MethodError(why)


@register
class FedGaLore(FactoredDownlink, DenseTargetsMethod):
    name = "fedgalore"
    summary = "GaLore-AdamW clients (seeded SVD→random projectors) + FedAvg + AJIVE sync of projected second moments"
    options_class = FedGaLoreOptions
    #: 2: the second-moment fixes — paper mode is Algorithm 1 as written, the aligned mode caps steps
    #: at the cold start's, the server pools estimates by their evidence; 3: the epoch schedule is
    #: the default, AJIVE's joint subspace from evidence-weighted views (benchmarks/RESULTS.md §5.1)
    behaviour_version = 3
    default_sync = "ajive"
    #: sites at different ranks (federation.site_ranks): each client's GaLore rank is its site's, every
    #: seeded basis the leading block of the rank-frame_rank frame (nested), and A sums the records exactly
    #: (docs/design.md, "A rank per site")
    #: with weight decay the record carries decay·W0 beside its terms, outside client-level DP's clipped change
    #: (fedgalore.engine.stages.client_dp refuses train.weight_decay > 0 under privacy.client);
    #: one update term per projector refresh (⌈steps/τ⌉) and the evidence 1 − β₂^T: the upload follows the steps;
    #: every upload entry is a change averaged by A (DenseTargetsMethod); without decay W moves by low-rank terms;
    #: the moments follow the option sync (:meth:`traits_for`; the class's: the default sync, ajive)
    traits = MethodTraits(downlink="factored", moments="uploaded", decay_in_upload=True, dp_aggregate="mean",
                          site_ranks=True, optimizer="galore_adamw", exact_low_rank=True, upload_follows_steps=True)

    @classmethod
    def traits_for(cls, options: MethodOptions) -> MethodTraits:
        """:attr:`traits` with the moments of the option ``sync``: none (``none``), built from the
        aggregate (``aggregate``), else uploaded views."""
        t = super().traits_for(options)
        sync = getattr(options, "sync", None) or cls.default_sync
        return replace(t, moments="none" if sync == "none" else "from_aggregate" if sync == "aggregate" else "uploaded")

    @classmethod
    def resolve_options(cls, options: FedGaLoreOptions, rank: int) -> FedGaLoreOptions:
        """Sync mode (the option, else ajive; the ablations' names pin it: :func:`register_preset`),
        view basis (by protocol) and joint rank (= r) filled in; the protocol's combinations checked."""
        o = options
        sync = cls.default_sync if o.sync is None else o.sync
        view_basis = o.view_basis or ("seeded" if o.moment_protocol == "paper" else "consensus")
        transfer = o.moment_transfer or ("linear" if o.moment_protocol == "paper" else "squared")
        schedule = o.projector_schedule if o.projector.endswith("_then_random") else "steps"  # one phase: nothing to switch
        refuse_combinations(_Resolving(o, sync, view_basis, transfer, schedule))
        if sync == "aggregate":
            view_basis = "seeded"
        return replace(o, sync=sync, view_basis=view_basis, moment_transfer=transfer, projector_schedule=schedule,
                       joint_rank=rank if o.joint_rank is None else o.joint_rank)

    @property
    def synced(self) -> bool:
        return self.options.sync != "none"

    @property
    def uploads_moments(self) -> bool:
        """Whether clients upload second-moment views (every synchronised mode but ``aggregate``)."""
        return self.synced and self.options.sync != "aggregate"

    def _galore_group(self, named: list[tuple[str, nn.Parameter]], diagnostics: bool = True, seeded_from_step: int = -1,
                      rank: int | None = None) -> dict[str, Any]:
        """The client optimizer's GaLore group. ``diagnostics`` (the run's switch): the shadow
        cold second moment feeds only the diagnostics (``update_norm_vs_cold``,
        ``v_warm_cold_ratio``); the update is the same bits without it. ``seeded_from_step``:
        the epoch schedule's switch to ``R_k`` (-1: the steps schedule). ``rank``: the site's
        (``federation.site_ranks``; default :attr:`rank`); with site ranks every seeded basis is
        the leading block of the rank-:attr:`frame_rank` frame (``frame_rank``: nested bases)."""
        o = self.options
        return {
            "seeded_from_step": seeded_from_step if o.projector_schedule != "steps" else -1,
            "params": named,
            "rank": self.rank if rank is None else int(rank),
            "frame_rank": self.frame_rank if self.site_ranks else None,
            "update_proj_gap": o.update_proj_gap,
            "scale": o.scale,
            "proj_type": o.proj_type,
            "projector": o.projector,
            "adaptive_proj_steps": o.adaptive_proj_steps,
            "adaptive_scope": o.adaptive_scope,
            "moment_transfer": o.moment_transfer,
            "rsvd_oversample": o.rsvd_oversample,
            "rsvd_niter": o.rsvd_niter,
            "nonfinite": o.nonfinite,
            "low_precision": o.low_precision,
            # FedGaLore⁻ starts cold every round: AdamW's rule (bit-identical to earlier runs)
            "bias_correction": "weight" if self.aligned else "steps",
            "cap_to_cold": self.aligned and o.cold_cap,
            "track_cold": self.synced and not o.galore_torch_compat and diagnostics,
            "warm_scale": "gradient" if o.sync == "aggregate" else "absolute",
            "bucket_gemm": o.bucket_gemm,
            # first_basis: synced (not the paper): the data-driven phase on the warm start's basis B
            "hold_warm_basis": o.first_basis == "synced" and seeded_from_step >= 0 and o.projector_schedule != "steps",
        }

    @property
    def aligned(self) -> bool:
        """The aligned protocol with a synchronised state (estimates with evidence, module doc)."""
        return self.synced and self.options.moment_protocol == "aligned"

    # ------------------------------------------------------------------ T
    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {k: Dense(v) for k, v in state.params.items()}
        for n in self.targets:
            if n in state.moments:
                entries[f"moment/{n}"] = state.moments[n]
        meta: dict[str, Any] = {"round": ctx.round, "round_seed": ctx.round_seed}
        meta.update(self.downlink_meta(state))
        return Payload(entries, meta)

    # factored downlink (methods/downlink_mixin.py): the adapted matrices travel as chains
    def downlink_names(self) -> list[str]:
        return list(self.targets)

    def downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in named_params(model, self.targets).items()}

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        start = self.start_matrices(broadcast, ctx.state)  # W_k: dense, or the client's copy + the chain
        start.update({n: broadcast[n].materialize() for n in self.heads})
        load_params(model, start)
        params = named_params(model, self.targets + self.heads)
        tc = ctx.train
        switch, total = -1, optimizer_steps(ctx.steps, tc.grad_accum_steps)
        if self.options.projector_schedule == "epoch":  # data-driven for the first adaptive_epochs epochs, then R_k
            switch = epoch_switch_step(ctx.num_examples, tc.batch_size, tc.grad_accum_steps, self.options.adaptive_epochs, total)
        elif self.options.projector_schedule == "share":  # ... for the first adaptive_share of the round's steps
            switch = max(0, min(math.ceil(self.options.adaptive_share * total - 1e-9), total - 1))
        groups = [self._galore_group([(n, params[n]) for n in self.targets], diagnostics=ctx.diagnostics, seeded_from_step=switch,
                                     rank=self.rank_of(ctx.client))]
        if self.heads:
            groups.append({"params": [(n, params[n]) for n in self.heads], "lr": tc.head_lr or tc.lr})
        opt = GaLoreAdamW(
            groups,
            lr=tc.lr,
            betas=tc.betas,
            eps=tc.eps,
            weight_decay=tc.weight_decay,
            galore_torch_compat=self.options.galore_torch_compat,
            compile_moments=self.options.compile_moments,
        )
        opt.set_projection_seed(int(broadcast.meta.get("round_seed", ctx.round_seed)))
        if self.options.adaptive_scope == "global":
            # the paper's "data-driven early, random later" over the whole federation: refreshes a
            # client would have made in earlier rounds at the nominal local step count (stateless,
            # identical for every client, so from round ⌈S/refreshes per round⌉ on all bases are seeded)
            per_round = -(-optimizer_steps(ctx.steps_per_round, tc.grad_accum_steps) // self.options.update_proj_gap)
            opt.set_global_refresh_offset(ctx.round * per_round)
        if self.synced:
            for n in self.targets:
                view = broadcast.entries.get(f"moment/{n}")
                if view is not None:
                    if not isinstance(view, MomentView):
                        raise MethodError(f"broadcast entry moment/{n} is a {type(view).__name__}, expected a MomentView")
                    if self.options.sync == "aggregate":
                        # a shape without evidence of its own: the evidence a client's round of these
                        # steps would carry, 1 − β₂^T (the optimizer rescales it to this client's gradient)
                        view = replace(view, weight=torch.full((view.rank,), 1.0 - tc.betas[1] ** max(total, 1)))
                    client_protocol.load_second_moment(opt, n, view)
        client_protocol.mark(opt)
        stats = local_train(model, opt, ctx, params.values())
        updates = client_protocol.export_update(opt)
        entries: dict[str, Any] = dict(updates)
        for n in self.heads:
            entries[n] = Dense(params[n].detach().float().cpu() - start[n].float())
        meta: dict[str, Any] = {"num_examples": ctx.num_examples, **stats}
        if self.uploads_moments:
            seeded = self.options.view_basis == "seeded"
            # Algorithm 1 line 10: the raw buffer (paper); the estimate with its evidence (aligned).
            # A client that ends the round on R_k (epoch schedule) sends it as it is: no move.
            views = client_protocol.export_moments(opt, {n: client_protocol.view_seed(opt, n) for n in self.targets}
                                                   if seeded else None, buffer=not self.aligned)
            for n, view in views.items():
                entries[f"moment/{n}"] = _share_basis(view, updates[n])
        if ctx.diagnostics:
            meta.update(_client_diagnostics(client_protocol.moment_diagnostics(opt)))
            if self.synced:
                meta.update(client_protocol.update_ratio_summary(opt))
        return Payload(entries, meta)
    # ------------------------------------------------------------------ A
    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext):
        """θ̄_{k+1} = θ̄_k + Σ_i p̃_i Δθ_i (Alg. 1 line 11). The sum is kept as one factored record
        (:func:`fedgalore.protocol.downlink.weighted_update`) and applied to W by the same function
        a client of the factored downlink applies it with (:func:`~fedgalore.protocol.downlink.apply_update`),
        whatever the downlink: the server's W is bit-identical under ``downlink: dense`` and
        ``factored``. ``factored`` also keeps the record in the server's chain."""
        updates = {n: downlink.weighted_update([u[n] for u in uploads], weights) for n in self.targets}  # type: ignore[misc]
        applied = self.apply_round_update(state, updates, delta=ctx.diagnostics, factored=not ctx.diagnostics_exact)
        self.average_heads(state, uploads, weights)
        return applied

    def released_coordinates(self, model: nn.Module, steps: int) -> int:
        """d on seeded bases (``projector: random``, what client-level DP requires): per adapted m×n
        matrix one r×n (left) or m×r (right) coefficient block per projector refresh — ⌈steps/τ⌉ of
        them —, and the head dense; not the m·n entries the model trains."""
        params = named_params(model, self.targets + self.heads)
        terms = max(-(-int(steps) // int(self.options.update_proj_gap)), 1)
        d = sum(int(params[n].numel()) for n in self.heads)
        for n in self.targets:
            rows, cols = (int(x) for x in params[n].shape[-2:])
            d += terms * int(self.rank) * (cols if resolve_side((rows, cols), self.options.proj_type) == "left" else rows)
        return d

    def client_dp_problem(self, moments: str) -> str | None:
        """Under client-level DP every basis a client's upload uses must be public: the projector
        must be the seeded ``random`` one (a data-driven RSVD/SVD basis is the top singular vectors
        of the client's gradient) and the moment views on the seeded R_k. A synchronised variant
        needs its moment release (``moments: noised``); FedGaLore⁻ releases none."""
        o = self.options
        if o.projector != "random":
            return (f"privacy.client needs public (seeded) bases, but method.options.projector={o.projector!r} sends "
                    "data-driven bases (the top singular vectors of the client's gradient); set method.options.projector: "
                    "random")
        if self.synced and o.view_basis != "seeded":
            return (f"privacy.client: method.options.view_basis={o.view_basis!r} puts the moment views on a basis fitted to "
                    "the clients' data; set method.options.view_basis: seeded")
        if self.uploads_moments and moments == "withheld":
            return (f"privacy.client.moments=withheld: method {self.name!r} synchronises second moments from the clients' "
                    "uploads; use method fedgalore_minus (no moment release), method.options.sync: aggregate (v̄ from the "
                    "noised aggregate: no release), or privacy.client.moments: noised")
        return None

    def validate_upload(self, state, upload, ctx):
        """Seeded bases must come from this round's seed chain (moment views: the round's view
        basis R_k under ``view_basis='seeded'``; update terms under ``first_basis: synced`` also
        the seeded view basis of the state the server broadcast, ``state.moments``); ranks must
        not exceed r; second-moment estimates and weights must be non-negative."""
        identity = self.options.projector == "identity"
        for n in self.targets:
            upd = upload[n]
            if not isinstance(upd, GaLoreUpdate):
                return f"{n}: expected a GaLore update record, got {type(upd).__name__}"
            # term q belongs to refresh q, so its seed (if seeded) is basis_seed(s_k, name, q)
            valid = {basis_seed(ctx.round_seed, n, q) for q in range(len(upd.terms) + 1)}
            # first_basis: synced: the data-driven phase ran on v̄'s seeded view basis, the one broadcast
            held = state.moments.get(n) if self.options.first_basis == "synced" else None
            terms_valid = valid | {int(held.seed)} if isinstance(held, MomentView) and held.basis is None and held.seed is not None else valid
            for term in upd.terms:
                rank = term.coef.shape[1] if isinstance(term, SeededLowRank) and term.side == "right" else (
                    term.coef.shape[0] if isinstance(term, SeededLowRank) else term.left.shape[1])
                if not identity and rank > self.frame_rank:
                    return f"{n}: update rank {rank} exceeds the largest site rank {self.frame_rank}"
                if isinstance(term, SeededLowRank):
                    if term.seed not in terms_valid:
                        return f"{n}: basis seed {term.seed} does not belong to round seed {ctx.round_seed}"
                    if term.frame is not None and (not self.site_ranks or term.frame != self.frame_rank):
                        return f"{n}: seeded frame {term.frame} is not this federation's ({self.frame_rank if self.site_ranks else 'none'})"
            mv = upload.entries.get(f"moment/{n}")
            if mv is None:
                continue
            if not self.uploads_moments:
                return f"moment/{n}: sync={self.options.sync!r} takes no second-moment upload"
            if not isinstance(mv, MomentView):
                return f"moment/{n}: expected a MomentView, got {type(mv).__name__}"
            if self.options.view_basis == "seeded":
                if mv.basis is not None or mv.seed != basis_seed(ctx.round_seed, n, 0):
                    return f"moment/{n}: must be on the round's seeded view basis R_k (seed {basis_seed(ctx.round_seed, n, 0)})"
            elif mv.basis is None and mv.seed not in valid:
                return f"moment/{n}: basis seed {mv.seed} does not belong to round seed {ctx.round_seed}"
            if mv.weight is not None and bool((mv.weight < 0).any()):
                return f"moment/{n}: negative prior weights"
            if bool((mv.moment < 0).any()):
                return f"moment/{n}: a second-moment estimate must be >= 0"
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

    def client_delta_factors(self, state, upload):
        """Each record ``ΔW_i = a_i W_k + Σ_q L_q R_q`` in factors, its decay term on ``W_k`` (``state.params``)."""
        return {n: FactoredDelta.of([t.factors() for t in upload[n].terms], tuple(upload[n].shape), upload[n].decay,
                                    state.params[n]) for n in self.targets}

    def update_terms(self, state, upload):
        """Each record ``ΔW_i = a_i W_k + Σ_q term_iq`` as its factored terms plus the decay's
        dense term on ``W_k`` (federation.robust compares them through their factors)."""
        return {n: robust_update_terms(upload[n], state.params[n]) for n in self.targets}

    @classmethod
    def secure_aggregation_problem(cls, options) -> str | None:
        """Under secure aggregation the server sees only ``Σ p_i x_i``: the update records are such
        a sum only on *public* seeded bases (``projector: random``: every client's refresh ``q`` uses
        the same seeded basis, so the coefficient blocks add up; a data-driven basis is the client's
        own and would be released in the clear), and S must read the uploads through that sum:
        ``none`` (FedGaLore⁻), ``aggregate`` (v̄ from the aggregated R_k block) or ``mean`` under
        ``moment_protocol: paper`` (Σ p_i ṽ_i on R_k). AJIVE fits a joint subspace to each view,
        and the aligned protocol's mean pools views by each client's evidence (a ratio of sums)."""
        o = options
        if o.projector != "random":
            return (f"federation.secure_aggregation sums the clients' update records, which add up only on public seeded "
                    f"bases; method.options.projector={o.projector!r} gives each client its own data-driven basis (sent in "
                    "the clear); set method.options.projector: random")
        if o.sync in ("ajive", "mean_svd"):
            return (f"federation.secure_aggregation: method.options.sync={o.sync} fits a subspace to each client's moment view, "
                    "which secure aggregation hides; use sync: aggregate (v̄ from the summed update), method fedgalore_minus, "
                    "or sync: mean with moment_protocol: paper")
        if o.sync == "mean" and o.moment_protocol != "paper":
            return ("federation.secure_aggregation: sync=mean under moment_protocol=aligned pools the views by each client's "
                    "evidence (a ratio of sums, not a sum); use moment_protocol: paper, sync: aggregate, or method fedgalore_minus")
        return None

    # ------------------------------------------------------------------ S
    def synchronize(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext):
        if not self.synced:
            return _round_client_diagnostics(uploads)  # FedGaLore⁻: the projector schedule's share only
        diags: dict[str, list[float]] = {}
        if self.options.sync == "aggregate":
            return self._finish_diagnostics(self._sync_from_aggregate(state, uploads, weights, ctx), uploads)
        with warnings.catch_warnings():
            # client views are exactly rank r, so AJIVE lowers ranks it cannot use every round;
            # expected, and recorded in the diagnostics (joint_rank, state_rank)
            warnings.simplefilter("ignore", RuntimeWarning)
            results = synchronize_moments_many(
                [nested_views([u[f"moment/{n}"] for u in uploads], weights) for n in self.targets],  # type: ignore[misc]
                weights,
                mode=self.options.sync,
                joint_rank=self.options.joint_rank,
                center=self.options.sync_center,
                seeds=[(ctx.round_seed + j) % (2**63) for j in range(len(self.targets))],
                diagnostics=ctx.diagnostics,
                batched=self.options.sync_batched,
            )
            for n, res in zip(self.targets, results):
                if res.state is not None:
                    st = res.state
                    # a seeded state is on the federation's frame (nested bases: site ranks), else its own rank's draw
                    frame = frame_of(st.rank, self.frame_rank) if st.basis is None and self.site_ranks else None
                    state.moments[n] = MomentView(st.moment.float(), st.side, st.shape,
                                                  None if st.basis is None else st.basis.float(), st.seed,
                                                  None if st.weight is None else st.weight.float(), frame)
                for k, v in res.diagnostics.items():
                    if isinstance(v, (int, float)):
                        diags.setdefault(k, []).append(float(v))
        return self._finish_diagnostics({k: sum(v) / len(v) for k, v in diags.items()}, uploads)

    @staticmethod
    def _finish_diagnostics(out: dict[str, float], uploads: Sequence[Payload]) -> dict[str, float]:
        """S's own diagnostics with the round's client numbers and the warm/cold update-norm ratio."""
        out.update(_round_client_diagnostics(uploads))
        if out.get("client_update_norm_cold"):
            out["update_norm_vs_cold"] = out["client_update_norm_precond"] / out["client_update_norm_cold"]
        return out

    def _sync_from_aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float],
                             ctx: RoundContext) -> dict[str, float]:
        """``sync: aggregate`` — S from what A already released (ours; the paper's S pools client views).

        For each target the aggregated coefficient block on the round's seeded basis R_k,
        ``C̄ = Σ_i p̃_i C_i`` (the R_k term of each client's record; every client ends the round on
        R_k under ``projector: random`` or the epoch/share schedule), gives the state
        ``v̄ = C̄∘C̄ / mean(C̄∘C̄) + floor`` on R_k (``floor = 1e-3``: no coordinate without a prior) —
        a *shape*: Adam's update M̂/√V̂ is scale-free, so the aggregate carries no gradient units;
        each client puts it at its own scale at its first step (``GaLoreAdamW`` ``warm_scale=
        "gradient"``) with the evidence its round's steps would carry. Under ``privacy.client`` the
        uploads were clipped and noised before A, so v̄ is post-processing of the released sum:
        no second release, nothing added to ε (the noise's own E[z²] flattens the shape towards
        uniform, i.e. towards FedGaLore⁻; it is not subtracted). A target with no R_k term in any
        upload keeps its previous state (``aggregate_missing`` counts them)."""
        missing = 0
        for n in self.targets:
            seed = basis_seed(ctx.round_seed, n, 0)
            total: torch.Tensor | None = None
            side, shape, frame = "right", None, None
            for u, w in zip(uploads, weights):
                for t in u[n].terms:  # type: ignore[union-attr]
                    if isinstance(t, SeededLowRank) and t.seed == seed:
                        part = t.coef.float() * float(w)  # nested bases (site ranks): the blocks add zero-padded
                        total = part if total is None else padded_sum(total, part, t.side)
                        side, shape, frame = t.side, t.shape, (t.rank if t.frame is None else t.frame)
            if total is None or shape is None:
                missing += 1
                continue
            sq = total * total
            mean = float(sq.mean())
            if not (mean > 0 and math.isfinite(mean)):
                missing += 1
                continue
            state.moments[n] = MomentView(sq / mean + _AGGREGATE_FLOOR, side, tuple(shape), None, seed, None,
                                          frame_of(sq.shape[1 if side == "right" else 0], frame))
        return {"aggregate_missing": float(missing)}


#: ``sync: aggregate``: the floor added to the normalised shape (mean 1), so no coordinate is without a prior
_AGGREGATE_FLOOR = 1e-3


def _share_basis(view: MomentView, update: GaLoreUpdate) -> MomentView:
    """The view with its basis replaced by the identical basis tensor of an update term, so the
    wire format stores the client's data-driven basis once (it is in both entries)."""
    if view.basis is None:
        return view
    for term in reversed(update.terms):
        b = term.right if (isinstance(term, LowRank) and view.side == "right") else (
            term.left if isinstance(term, LowRank) else None)
        if b is not None and b.shape == view.basis.shape and torch.equal(b, view.basis):
            return MomentView(view.moment, view.side, view.shape, b, view.seed, view.weight, view.frame)
    return view


def _round_client_diagnostics(uploads: Sequence[Payload]) -> dict[str, float]:
    """The round's view of its clients' numbers: the mean over clients of :data:`_CLIENT_DIAGS`,
    the maximum of :data:`_CLIENT_MAX_DIAGS` (the worst client)."""
    out: dict[str, float] = {}
    for key in _CLIENT_DIAGS + _CLIENT_MAX_DIAGS:
        vals = [float(u.meta[key]) for u in uploads if isinstance(u.meta.get(key), (int, float))]
        if vals:
            out[key] = max(vals) if key in _CLIENT_MAX_DIAGS else sum(vals) / len(vals)
    return out


def _client_diagnostics(per_param: dict[str, dict[str, float]]) -> dict[str, float]:
    """One client's moment diagnostics over its GaLore matrices: means of the warm-start shares
    (and of ``sync: aggregate``'s rescale factors),
    the projector schedule's share of steps on ``R_k`` and the upload's kept share, the median of
    the per-matrix V̂/V̂_cold medians, and the update norms over all matrices."""
    out: dict[str, float] = {}
    for key in ("warm_clamped", "prior_retained", "warm_kept", "warm_rescale", "view_step_share", "upload_kept"):
        vals = [d[key] for d in per_param.values() if key in d]
        if vals:
            out[key] = sum(vals) / len(vals)
    ratios = [d["v_ratio_median"] for d in per_param.values() if "v_ratio_median" in d and math.isfinite(d["v_ratio_median"])]
    if ratios:
        out["v_warm_cold_ratio"] = statistics.median(ratios)
    if any("update_norm" in d for d in per_param.values()):
        out["client_update_norm_precond"] = math.sqrt(sum(d.get("update_norm", 0.0) ** 2 for d in per_param.values()))
        out["client_update_norm_cold"] = math.sqrt(sum(d.get("update_norm_cold", 0.0) ** 2 for d in per_param.values()))
    return out


# the paper's ablations: FedGaLore with its S pinned (a shared method.options pool's ``sync`` does not override it)
register_preset("fedgalore_minus", FedGaLore, {"sync": "none"},
                "FedGaLore without second-moment synchronisation (paper's FedGaLore⁻ ablation)",
                # 2: the epoch schedule is the default (the earlier second-moment fixes touched only
                # the synchronised state and left this variant unchanged)
                behaviour_version=2)
register_preset("fedgalore_mean", FedGaLore, {"sync": "mean"},
                "FedGaLore with plain weighted-mean second-moment sync (ablation)")
