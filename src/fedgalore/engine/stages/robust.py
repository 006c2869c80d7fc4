"""Robust aggregation (``federation.robust``) as a round stage: between collecting the valid
uploads and the method's operator A, the server drops — or, for coordinate-wise statistics,
replaces — what a hostile site could use to steer the model.

The rules themselves are pure functions in :mod:`fedgalore.federated.robust`; this stage feeds them
what each method can compare:

* ``norm_filter`` (and ``norm_factor`` as a pre-filter with any kind): ‖ΔW_i‖_F from the Gram
  matrix of the clients' effective updates, ``G_ij = Σ_matrices ⟨ΔW_i, ΔW_j⟩_F``, computed from their
  factors (:meth:`~fedgalore.methods.base.Method.update_terms`: ``r × r`` products, never ``m × n``
  where the factors suffice); an upload with ‖ΔW_i‖ > factor · median_j ‖ΔW_j‖ is dropped.
* ``krum``: Krum / Multi-Krum (Blanchard et al. 2017) on ``D_ij = G_ii + G_jj − 2 G_ij``; the
  ``to_keep`` selected uploads are aggregated by the method's own A with their weights renormalised.
* ``trimmed_mean`` / ``median`` (dense methods, :attr:`~fedgalore.methods.traits.MethodTraits.coordinate_uploads`):
  the coordinate-wise statistic of every uploaded tensor, unweighted (Flower's FedTrimmedAvg /
  FedMedian, Yin et al. 2018), becomes the one upload A applies, with weight 1 — for FedAvg-Full,
  whose A is ``Σ p_i x_i``, that applies the statistic itself.

Every dropped client gets ``robust_excluded`` (the reason) in ``clients.jsonl``; the round's
diagnostics record ``robust_kept`` / ``robust_excluded`` counts and the norms' median.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from fedgalore.engine.stages.base import Attempt, Contribution, RoundStage, RunView
from fedgalore.federated import robust
from fedgalore.federated.guards import RobustConfig
from fedgalore.methods.base import Method
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ServerState

__all__ = ["RobustOutcome", "apply_robust", "Robust"]


@dataclass
class RobustOutcome:
    """What A gets after the robust rule: ``keep`` indexes the round's valid uploads (all of them
    for a coordinate-wise statistic, which returns ``combined``: the one upload A applies with
    weight 1); ``excluded``: index → one-line reason; ``diag``: numbers for the round's diagnostics."""

    keep: list[int]
    excluded: dict[int, str] = field(default_factory=dict)
    combined: Payload | None = None
    diag: dict[str, float] = field(default_factory=dict)


def _coordinatewise(cfg: RobustConfig, uploads: Sequence[Payload]) -> Payload:
    """The coordinate-wise statistic of every (dense) entry over the uploads."""
    entries = {}
    for key in uploads[0].entries:
        ts = []
        for u in uploads:
            e = u.entries[key]
            if not isinstance(e, Dense):
                raise TypeError(f"federation.robust.kind={cfg.kind}: entry {key!r} is a {type(e).__name__}, not a dense tensor")
            ts.append(e.tensor)
        entries[key] = Dense(robust.coordinate_median(ts) if cfg.kind == "median" else robust.trimmed_mean(ts, cfg.beta))
    meta = {k: v for k, v in uploads[0].meta.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    return Payload(entries, meta)


def apply_robust(cfg: RobustConfig, method: Method, state: ServerState, uploads: Sequence[Payload]) -> RobustOutcome:
    """Apply ``federation.robust`` to one round's valid uploads (module docstring). ``state`` is
    the server state the clients started from (before A)."""
    k = len(uploads)
    keep = list(range(k))
    out = RobustOutcome(keep)
    factor = cfg.factor
    gram = None
    if factor is not None or cfg.kind == "krum":
        gram = robust.gram([method.update_terms(state, u) for u in uploads])
        norms = [math.sqrt(max(float(gram[i, i]), 0.0)) for i in range(k)]
        out.diag["robust_norm_median"] = float(statistics.median(norms)) if k else 0.0
    if factor is not None:
        kept = robust.norm_filter(norms, factor)
        median = out.diag["robust_norm_median"]
        for i in keep:
            if i not in kept:
                out.excluded[i] = (f"update norm {norms[i]:.4g} > federation.robust norm_factor {factor:g} × the round's "
                                   f"median {median:.4g}")
        keep = [i for i in keep if i in kept]
    if cfg.kind == "krum":
        f = cfg.num_malicious
        if len(keep) - f - 2 < 1:
            for i in keep:
                out.excluded[i] = (f"federation.robust krum: {len(keep)} upload(s) left, fewer than num_malicious + 3 = {f + 3}; "
                                   "nothing can be trusted this round")
            keep = []
        else:
            sub = gram[keep][:, keep]
            dist = robust.sq_distances(sub)
            scores = robust.krum_scores(dist, f)
            chosen = {keep[j] for j in robust.krum_select(dist, f, min(cfg.to_keep, len(keep)))}
            for j, i in enumerate(keep):
                if i not in chosen:
                    out.excluded[i] = (f"not among the {cfg.to_keep} upload(s) Krum keeps (score {float(scores[j]):.4g}, "
                                       f"num_malicious={f})")
            keep = sorted(chosen)
    elif cfg.kind in ("trimmed_mean", "median") and keep:
        out.combined = _coordinatewise(cfg, [uploads[i] for i in keep])
    out.keep = keep
    out.diag.update({"robust_kept": float(len(keep)), "robust_excluded": float(len(out.excluded))})
    return out


class Robust(RoundStage):
    """``federation.robust`` between collect and A (module doc): the dropped clients' records get
    ``robust_excluded``; a coordinate-wise statistic comes back as the one upload A applies, with
    weight 1 (its clients all counted in it)."""

    name = "robust"
    server_only = True

    def __init__(self, cfg: RobustConfig, run: RunView) -> None:
        self.cfg, self.run = cfg, run

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "Robust | None":
        return None if cfg.federation.robust is None else cls(cfg.federation.robust, run)

    def screen(self, att: Attempt, state: ServerState) -> None:
        if not att.kept:
            return
        out = apply_robust(self.cfg, self.run.method, state, [item.upload for item in att.kept])
        for i, why in out.excluded.items():
            c = att.kept[i].clients[0]
            rec = att.record_of(c)
            if rec is not None:
                rec["robust_excluded"] = why
            self.run.say(f"round {att.round + 1}: client {self.run.runtime.clients.name(c)} excluded by federation.robust ({why})")
        if out.combined is not None:
            att.kept = [Contribution(out.combined, [c for i in out.keep for c in att.kept[i].clients], 1.0)]
        else:
            att.kept = [att.kept[i] for i in out.keep]
        att.diag.update(out.diag)
