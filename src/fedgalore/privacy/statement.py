"""What a run protected, in words: ``privacy.json``'s statement, the report's and the model card's line.

Every release type a client uploads is named (docs/design.md §9): ``update`` (the update
record, LoRA factors or dense deltas), ``moment`` (FedGaLore's projected second moment),
``basis`` (data-driven projector bases), ``head`` (the classifier head), ``control_variate``
(SCAFFOLD's c_i), ``metrics`` (training losses and the optimizer's diagnostics) and ``counts``
(examples and steps). :func:`release_record` says for one type whether it was clipped, its
sensitivity and σ; :func:`summary_line` is the one line the report and the model card print.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from fedgalore.privacy.config import RecordPrivacy
from fedgalore.privacy.randomness import RANDOMNESS_ENTROPY, RANDOMNESS_SEEDED

__all__ = ["NOT_AGAINST_CONFIG", "NOTHING_PROTECTED", "NOT_PROTECTED_REPRODUCIBLE", "CLIPPING_ONLY",
           "record_noised", "client_noised", "RELEASE_KINDS", "record_statement", "not_protected", "release_record", "summary_line",
           "mechanism", "client_statement", "client_mechanism", "client_release_record"]

NOTHING_PROTECTED = ("Nothing was protected: no differential privacy was on (privacy.record unset). Every upload "
                     "(updates, second moments, data-driven bases, the head, metrics, counts) reached the server as "
                     "computed from the sites' raw data.")

#: what privacy.reproducible: true leaves unprotected (privacy.json's not_protected, the statements)
NOT_AGAINST_CONFIG = ("anyone who holds the config — the server included — since every DP draw is seeded from the run's "
                      "seed (privacy.reproducible: true, for studies)")

#: the report's and the model card's words for privacy.reproducible (privacy.json: ``reproducible``)
NOT_PROTECTED_REPRODUCIBLE = "NOT protected against whoever holds the config (privacy.reproducible)"

#: the report's and the model card's words for a run whose every level ran with σ = 0
CLIPPING_ONLY = "NOT protected — clipping only (σ = 0: no noise, ε = ∞)"

RELEASE_KINDS = ("update", "moment", "basis", "head", "control_variate", "metrics", "counts")

_WHAT = {
    "update": "the update (GaLore update record, LoRA factors or dense deltas)",
    "moment": "FedGaLore's projected second moment",
    "basis": "data-driven projector bases (RSVD of the gradient)",
    "head": "the classifier head's change",
    "control_variate": "SCAFFOLD's control variate c_i",
}


def record_noised(record: RecordPrivacy | None) -> bool:
    """Whether ``privacy.record`` adds noise (σ > 0, or σ calibrated to a target ε): without noise
    DP-SGD only clips, and ε = ∞ — nothing is protected."""
    return record is not None and (record.target_epsilon is not None or float(record.noise_multiplier or 0) > 0)


def client_noised(release: Any) -> bool:
    """Whether client-level DP (the run's ClientRelease; None: off) adds noise (σ > 0)."""
    return release is not None and float(release.sigma) > 0


def mechanism(record: RecordPrivacy, support: Mapping[str, Any] | None = None, reproducible: bool = False) -> dict[str, Any]:
    """The DP-SGD mechanism as ``privacy.json`` records it (σ per site is in the site records)."""
    seeded = reproducible
    return {
        "level": "record",
        "name": "DP-SGD (Abadi et al. 2016) through Opacus: GradSampleModule per-example gradients, DPOptimizer "
                "around the method's own optimizer",
        "max_grad_norm": record.max_grad_norm,
        "noise_multiplier": record.noise_multiplier,
        "target_epsilon": record.target_epsilon,
        "calibration": record.calibration if record.target_epsilon is not None else None,
        "delta": record.delta,
        "accountant": f"opacus {record.accountant} ({'Rényi DP' if record.accountant == 'rdp' else 'privacy random variables'})",
        "adjacency": "add/remove one training example of a site",
        "sampling": "Poisson: each example joins each local step with probability q = batch_size·grad_accum_steps/n "
                    "(Opacus' UniformWithReplacementSampler); the engine's shuffled batches are not used",
        "reproducible": seeded,
        "randomness": RANDOMNESS_SEEDED if seeded else RANDOMNESS_ENTROPY,
        "per_sample_gradients": dict(support) if support else None,
    }


def record_statement(record: RecordPrivacy, reproducible: bool = False) -> str:
    """The statement of a run with record-level DP."""
    how = (f"σ calibrated per site to ε = {record.target_epsilon:g} over its "
           f"{'expected' if record.calibration == 'expected' else 'every'} round(s)" if record.target_epsilon is not None
           else f"σ = {record.noise_multiplier:g}")
    if not record_noised(record):
        return (f"Record-level clipping only (DP-SGD with privacy.record.noise_multiplier=0): every example's gradient "
                f"clipped to C = {record.max_grad_norm:g} each local step, no noise. NOT protected: ε = ∞ for every "
                "site (clipping bounds each example's influence but hides nothing).")
    text = (f"Record-level differential privacy (DP-SGD) at each site: every example's gradient clipped to "
            f"C = {record.max_grad_norm:g} each local step, Gaussian noise ({how}), Poisson sampling. Each site's "
            f"records are protected at (ε, δ = {record.delta:g}) with ε per site in 'sites' (Opacus "
            f"{record.accountant.upper()} accountant over every step of every round it took part in); everything "
            "the site uploads from its training is post-processing of the privatised gradients.")
    if reproducible:
        text += (" NOT protected against anyone who holds the config (the server included): every DP draw is seeded "
                 "from the run's seed (privacy.reproducible: true).")
    if record.target_epsilon is not None:
        text += " target_epsilon is a cap: a site whose next round would pass it is not trained again."
    return text


def not_protected(record: RecordPrivacy | None, reproducible: bool = False) -> list[str]:
    """What the run did not protect (plainly, for ``privacy.json``)."""
    if record is None:
        return ["everything: no differential privacy was on"]
    if not record_noised(record):
        return ["every record of every site: privacy.record.noise_multiplier=0 clips the gradients and adds no noise "
                "(ε = ∞)"]
    out = ["which sites took part in which round (DP does not hide participation)",
           "a site's data as a whole (record-level DP protects rows; client-level DP, privacy.client, is not on)",
           "each site's number of examples (num_examples is sent exact; the site's size is treated as public)"]
    if record.release_metrics:
        out.append("the clients' training losses (privacy.record.release_metrics: true sends them in the clear)")
    if reproducible:
        out.append(NOT_AGAINST_CONFIG)
    return out


def release_record(kind: str, record: RecordPrivacy | None, clip_update_norm: float | None = None) -> dict[str, Any]:
    """One release type of a round (module doc): protected or not, how, clipping, sensitivity, σ."""
    if record is None:
        clipped = clip_update_norm is not None and kind in ("update", "head")
        return {"protected": False, "clipped": clipped,
                "clip": (f"federation.clip_update_norm={clip_update_norm:g} scales whole uploads (no noise: not a DP "
                         "mechanism)") if clipped else None,
                "sensitivity": None, "noise_multiplier": None}
    if kind == "counts":
        return {"protected": False, "clipped": False, "sensitivity": None, "noise_multiplier": None,
                "how": "num_examples exact and the step counts (fixed by the config): the site's size is treated as public"}
    if kind == "metrics":
        if record.release_metrics:
            return {"protected": False, "clipped": False, "sensitivity": None, "noise_multiplier": None,
                    "how": "raw training losses in the clear (privacy.record.release_metrics: true); the optimizer's "
                           "diagnostics are post-processing of the privatised gradients"}
        return {"protected": True, "clipped": True, "sensitivity": record.max_grad_norm, "noise_multiplier": "per site",
                "how": "training losses withheld (privacy.record.release_metrics: false); what remains (the optimizer's "
                       "diagnostics) is post-processing of the privatised gradients"}
    return {"protected": True, "clipped": True, "sensitivity": record.max_grad_norm, "noise_multiplier": "per site",
            "how": f"{_WHAT.get(kind, kind)}: post-processing of the privatised gradients (DP-SGD; each example's "
                   "gradient clipped to C per step, sensitivity C of the step's sum under add/remove, N(0, σ²C²) added)"}


def _fmt_eps(e: float) -> str:
    return "∞" if not math.isfinite(e) else f"{e:.3g}"


def summary_line(doc: Mapping[str, Any] | None, upto_round: int | None = None) -> str:
    """One line from a run's ``privacy.json`` (None: a run from before privacy.json); with
    ``upto_round``, ε as spent by the end of that round (an export of an earlier round)."""
    if not doc:
        return "privacy: not recorded (a run from before privacy.json)"
    if not doc.get("protected"):
        if doc.get("mechanism") or doc.get("client"):  # DP was on with σ = 0
            return f"privacy: {CLIPPING_ONLY}"
        return "privacy: none — nothing was protected (no differential privacy)"
    client = doc.get("client")
    client_line = ""
    if client:
        eps = client.get("epsilon")
        if upto_round is not None:
            done = [r for r in doc.get("rounds") or [] if int(r.get("round", 0)) <= int(upto_round) and "client" in r]
            eps = done[-1]["client"].get("epsilon") if done else 0.0
        cm = client.get("mechanism") or {}
        eps_s = _fmt_eps(float(eps)) if isinstance(eps, (int, float)) else str(eps)
        client_line = (f"client-level DP-FedAvg ({cm.get('noise')} noise, C = {cm.get('clip')}, σ = "
                       f"{float(client.get('noise_multiplier') or 0):.3g}): ε ≤ {eps_s} for the federation at δ = "
                       f"{client.get('delta'):g}{f' by round {upto_round}' if upto_round is not None else ''}"
                       + (f"; {NOT_PROTECTED_REPRODUCIBLE}" if cm.get("reproducible") else ""))
        if not doc.get("mechanism"):
            return "privacy: " + client_line
    mech = doc.get("mechanism") or {}
    eps = doc.get("epsilon_max")
    sites = doc.get("sites") or {}
    if upto_round is not None:
        done = [r for r in doc.get("rounds") or [] if int(r.get("round", 0)) <= int(upto_round)]
        eps = done[-1].get("epsilon_max") if done else 0.0
        sites = {c: s for c, s in sites.items() if any(int(x) <= int(upto_round) for x in s.get("rounds") or [])}
    sigmas = sorted({s.get("noise_multiplier") for s in sites.values() if s.get("noise_multiplier") is not None})
    sigma = ("σ = " + (f"{sigmas[0]:.3g}" if len(sigmas) == 1 else f"{sigmas[0]:.3g}–{sigmas[-1]:.3g}")) if sigmas else (
        f"σ = {mech['noise_multiplier']:g}" if mech.get("noise_multiplier") is not None else "σ calibrated")
    accountant = str(mech.get("accountant", "?")).split(" (")[0].removeprefix("opacus ").upper()
    delta = mech.get("delta")
    return (f"privacy: record-level DP-SGD at each site (Opacus, Poisson sampling, {accountant} accountant): "
            f"ε ≤ {_fmt_eps(float(eps)) if eps is not None else '?'} per site at δ = {delta:g} "
            f"{f'by round {upto_round} ' if upto_round is not None else ''}(max over {len(sites)} site(s) that trained; C = {mech.get('max_grad_norm', float('nan')):g}, {sigma}"
            + (f"; {NOT_PROTECTED_REPRODUCIBLE}" if mech.get("reproducible") else "") + ")"
            + (f"; {client_line}" if client_line else ""))


# ---------------------------------------------------------------------- client-level (privacy.client)
# ``release`` below: the run's fedgalore.engine.stages.client_dp.ClientRelease (its ``client`` config,
# σ, σ_m, K, M and whether A is a mean), read by attribute so this module stays below the engine.

def client_mechanism(release: Any) -> dict[str, Any]:
    """The client-level mechanism as ``privacy.json`` records it."""
    c = release.client
    how = ("each client adds N(0, σ²C²/K) to its own clipped change (distributed), so the sum of the K uploads carries "
           "N(0, σ²C²) — under secure aggregation the server sees that sum only; without it, each upload alone carries "
           "σ/√K" if release.mean else "each client adds N(0, σ²C²) to its own clipped change (distributed): the method's "
           "aggregate uses each upload on its own") if c.noise == "distributed" else (
        "the server clips each upload and adds one N(0, σ²C²) draw to the sum (central; a trusted server)" if release.mean
        else "the server clips each upload and adds N(0, σ²C²) to each (central; the method's aggregate uses each upload on "
             "its own)")
    return {
        "level": "client",
        "name": "DP-FedAvg (McMahan et al. 2018) with fixed clipping: each client's upload change clipped to C, "
                "Gaussian noise on the sum, uniform weights",
        "clip": c.clip, "noise": c.noise, "how": how,
        "adaptive_clipping": None if c.adaptive_clipping is None else {
            "target_quantile": c.adaptive_clipping.target_quantile, "lr": c.adaptive_clipping.lr,
            "count_noise_multiplier": release.sigma_b, "update_noise_multiplier": release.sigma_update,
            "how": "Andrew et al. 2021: each client's bit 1[‖Δ_i‖ ≤ C] summed with N(0, σ_b²), C ← C·exp(−lr·(b̃ − γ)); "
                   "the update's noise σ_Δ = (σ⁻² − (2σ_b)⁻²)^(-1/2), so update and bits together are one Gaussian of σ "
                   "(its privacy cost is inside σ)"},
        "noise_multiplier": release.sigma, "target_epsilon": c.target_epsilon,
        "calibrated": c.noise_multiplier is None,
        "moments": (f"noised: each client's second-moment blocks clipped to C_m = {c.moment_clip:g}, N(0, σ_m²C_m²) each, "
                    f"σ_m = {release.sigma_m:.4g}; composed with the update as one Gaussian of σ = (σ⁻² + σ_m⁻²)^(-1/2); "
                    "AJIVE on the individual noised views is post-processing") if release.sigma_m is not None
        else ("not released: FedGaLore's v̄ is built from the noised aggregate (sync: aggregate; post-processing, "
              "no cost)" if getattr(release, "moments_from_aggregate", False) else "not released (withheld, or a method without a moment upload)"),
        "delta": c.delta,
        "accountant": "dp-accounting RDP: sampling K of M clients without replacement (Wang et al. 2019), replace-one "
                      "adjacency (sensitivity 2C), composed over the rounds",
        "adjacency": "replace one site's data (all of it) by another's; M is public",
        "sampling": f"K = {release.sample} of M = {release.num_clients} clients per round, uniformly without replacement",
        "epsilon_headline": ("one upload as the server sees it (distributed noise without secure aggregation: each upload "
                             "carries its own share of the noise only; no amplification, the server knows whom it sampled); "
                             "'epsilon_sum' is the aggregate's, what a recipient of the models faces")
        if release.server_sees_uploads else "the noised sum's (what the server and every recipient of the models see)",
        "reproducible": release.reproducible,
        "randomness": RANDOMNESS_SEEDED if release.reproducible else RANDOMNESS_ENTROPY,
    }


def client_statement(release: Any) -> str:
    """The statement of a run with client-level DP."""
    c = release.client
    how = (f"σ = {release.sigma:.4g} calibrated to ε = {c.target_epsilon:g} over the run's rounds" if c.noise_multiplier is None
           else f"σ = {release.sigma:g}" + (f", the run stopped before ε exceeds {c.target_epsilon:g}" if c.target_epsilon else ""))
    clip = (f"C (adaptive from {c.clip:g}, target quantile {c.adaptive_clipping.target_quantile:g})"
            if c.adaptive_clipping is not None else f"C = {c.clip:g}")
    if not client_noised(release):
        return (f"Client-level clipping only (DP-FedAvg with privacy.client.noise_multiplier=0): each client's whole upload "
                f"change clipped to {clip}, uniform weights, no noise. NOT protected: ε = ∞ (clipping bounds each site's "
                "influence but hides nothing).")
    text = (f"Client-level differential privacy (DP-FedAvg) across sites: each client's whole upload change clipped to "
            f"{clip}, Gaussian noise on their sum ({c.noise}; {how}), uniform weights. Each site's data as a whole "
            f"is protected at (ε, δ = {c.delta:g}) with ε in 'client' (dp-accounting RDP, K of M sampled without "
            "replacement, replace-one adjacency).")
    if release.sigma_m is not None:
        text += f" FedGaLore's second moments are a second release (C_m = {c.moment_clip:g}, σ_m = {release.sigma_m:.4g}), composed."
    elif getattr(release, "moments_from_aggregate", False):
        text += " FedGaLore's second-moment state is built from the noised aggregate (post-processing: nothing added to ε)."
    if release.server_sees_uploads:
        text += (" Distributed noise without secure aggregation: the server sees each upload with its own share of the "
                 "noise, so the headline ε is one upload's as the server sees it (epsilon_sum: the aggregate's).")
    if release.reproducible:
        text += (" NOT protected against anyone who holds the config (the server included): every DP draw is seeded from "
                 "the run's seed (privacy.reproducible: true).")
    return text


def client_release_record(kind: str, release: Any) -> dict[str, Any]:
    """One release type of a round under client-level DP."""
    c = release.client
    if kind == "counts":
        return {"protected": True, "clipped": False, "sensitivity": None, "noise_multiplier": None,
                "how": "withheld: no num_examples or step count leaves a client (the aggregate's weights are uniform)"}
    if kind == "metrics":
        return {"protected": not c.release_metrics, "clipped": False, "sensitivity": None, "noise_multiplier": None,
                "how": "raw training losses in the clear (privacy.client.release_metrics: true)" if c.release_metrics
                else "withheld: the training losses and the optimizer's diagnostics stay at the site; only the counts travel"}
    if kind == "moment":
        return {"protected": True, "clipped": True, "sensitivity": 2 * c.moment_clip,
                "noise_multiplier": release.sigma_m, "how": f"{_WHAT['moment']}: clipped to C_m, noised (composed)"}
    return {"protected": True, "clipped": True, "sensitivity": 2 * c.clip, "noise_multiplier": release.sigma,
            "how": f"{_WHAT.get(kind, kind)}: the client's change clipped jointly with its other tensors to C, Gaussian "
                   "noise (sensitivity 2C under replace-one)"}
