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

__all__ = ["NOTHING_PROTECTED", "RELEASE_KINDS", "record_statement", "not_protected", "release_record", "summary_line",
           "mechanism"]

NOTHING_PROTECTED = ("Nothing was protected: no differential privacy was on (privacy.record unset). Every upload "
                     "(updates, second moments, data-driven bases, the head, metrics, counts) reached the server as "
                     "computed from the sites' raw data.")

RELEASE_KINDS = ("update", "moment", "basis", "head", "control_variate", "metrics", "counts")

_WHAT = {
    "update": "the update (GaLore update record, LoRA factors or dense deltas)",
    "moment": "FedGaLore's projected second moment",
    "basis": "data-driven projector bases (RSVD of the gradient)",
    "head": "the classifier head's change",
    "control_variate": "SCAFFOLD's control variate c_i",
}


def mechanism(record: RecordPrivacy, support: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DP-SGD mechanism as ``privacy.json`` records it (σ per site is in the site records)."""
    seeded = not record.secure_mode
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
        "secure_mode": record.secure_mode,
        "randomness": ("seeded from the run's seed, round and client (reproducible, for simulation): whoever knows the "
                       "seed can regenerate the noise and the sampling, so the guarantee holds only against parties "
                       "who do not; set privacy.record.secure_mode: true in a deployment") if seeded
        else "noise and sampling from OS entropy, Opacus' secure Gaussian sampling (torchcsprng not used)",
        "per_sample_gradients": dict(support) if support else None,
    }


def record_statement(record: RecordPrivacy) -> str:
    """The statement of a run with record-level DP."""
    how = (f"σ calibrated per site to ε = {record.target_epsilon:g} over its "
           f"{'expected' if record.calibration == 'expected' else 'every'} round(s)" if record.target_epsilon is not None
           else f"σ = {record.noise_multiplier:g}")
    text = (f"Record-level differential privacy (DP-SGD) at each site: every example's gradient clipped to "
            f"C = {record.max_grad_norm:g} each local step, Gaussian noise ({how}), Poisson sampling. Each site's "
            f"records are protected at (ε, δ = {record.delta:g}) with ε per site in 'sites' (Opacus "
            f"{record.accountant.upper()} accountant over every step of every round it took part in); everything "
            "the site uploads from its training is post-processing of the privatised gradients.")
    if not record.secure_mode:
        text += (" The noise is seeded from the run's seed (reproducible): the guarantee holds only against parties "
                 "who do not know it.")
    return text


def not_protected(record: RecordPrivacy | None) -> list[str]:
    """What the run did not protect (plainly, for ``privacy.json``)."""
    if record is None:
        return ["everything: no differential privacy was on"]
    out = ["which sites took part in which round (DP does not hide participation)",
           "a site's data as a whole (record-level DP protects rows; client-level DP, issue 41's second part, is not on)",
           "each site's number of examples (num_examples is sent exact; the site's size is treated as public)"]
    if record.release_metrics:
        out.append("the clients' training losses (privacy.record.release_metrics: true sends them in the clear)")
    if not record.secure_mode:
        out.append("against anyone who knows the run's seed (the noise is seeded; privacy.record.secure_mode: false)")
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
        return "privacy: none — nothing was protected (no differential privacy)"
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
            + ("" if mech.get("secure_mode") else "; noise seeded from the run's seed") + ")")
