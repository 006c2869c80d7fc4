"""Client-level differential privacy across sites (DP-FedAvg): clipping and noising what a client
uploads, and the federation's accountant (docs/privacy.md "Client-level DP").

The mechanism (McMahan et al. 2018, "Learning differentially private recurrent language models",
Alg. 1 with fixed clipping; the Gaussian mechanism on the sum of clipped updates):

* **what is released.** An upload is a :class:`~fedgalore.protocol.payload.Payload`; its numeric
  content is every tensor of its entries (:func:`slots`): a dense delta, LoRA factors, the
  coefficient blocks of GaLore update terms on *seeded* bases, the head, FedGaLore's second-moment
  blocks (``moment/…``). A data-driven basis (an RSVD basis in a GaLore term, a moment view's own
  basis) is the top singular vectors of the client's gradient — a release no clipping bounds —
  so it is refused (:class:`DataDrivenBasis`).
* **the change.** Each tensor is released relative to a *public* reference — what the client
  would upload had it not trained (the broadcast's value for methods that upload absolute factors
  or heads, zero for methods that upload changes; ``Method.release_reference``). The reference
  does not affect the guarantee (it is public), only the utility: clipping the change, not the
  absolute factors, keeps the global model's magnitude.
* **clip.** The update change Δ_i (all non-moment tensors together) is scaled by
  ``min(1, C/‖Δ_i‖₂)``; the moment blocks together by ``min(1, C_m/‖v_i‖₂)`` (their own release).
* **noise.** The sum of the clipped changes carries N(0, σ²C²) per coordinate: added once by the
  server (``central``: :func:`shared_noise`, the same draw split over the uploads that hold a
  coordinate, so their uniform mean is exactly ``(Σ clip(Δ_i) + z)/k``) or by each client
  (``distributed``: N(0, σ²C²/K) each, so the sum of K carries σ; under secure aggregation the
  server sees only that sum). A method whose aggregate is not a uniform mean of the uploads
  (FLoRA's stacking, LoRA-FAIR's correction, FedGaLore's AJIVE on individual moment views) uses
  each upload on its own, so each upload carries the whole N(0, σ²C²) (``individual``) — the
  same guarantee per client, √k times the noise in the mean. Noised moments are clamped at 0
  (post-processing).

The accountant (:func:`client_epsilon`): the server samples K of the M clients without
replacement each round (fedgalore.federated.sampling), so the adjacency is *replace one client*
(M is public): the sum's L2 sensitivity is 2C, the Gaussian event's noise multiplier σ/2, and the
subsampling is Wang, Balle & Kasiviswanathan 2019's sampling without replacement (dp-accounting's
``SampledWithoutReplacementDpEvent`` under ``REPLACE_ONE``); K = M is no sampling. Two releases of
the same sampled clients in one round (update σ_u, moments σ_m) are one Gaussian mechanism with
σ = (σ_u⁻² + σ_m⁻²)^(-1/2) (:func:`combined_multiplier`). ε(δ) by dp-accounting's RDP accountant.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Sequence

import torch

from fedgalore.privacy.accounting import solve_noise
from fedgalore.protocol.payload import Dense, Entry, GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank

__all__ = ["DataDrivenBasis", "slots", "is_moment", "clip_upload", "add_noise", "shared_noise", "combined_multiplier",
           "client_epsilon", "calibrate_client_noise", "Slot"]

#: a released tensor: (entry key, part name)
Slot = tuple[str, str]


class DataDrivenBasis(ValueError):
    """An upload carries a data-driven basis, which client-level DP cannot protect."""


def is_moment(key: str) -> bool:
    """Whether an upload entry is FedGaLore's second-moment release."""
    return key.startswith("moment/")


def _entry_parts(key: str, e: Entry) -> list[tuple[str, torch.Tensor]]:
    if isinstance(e, Dense):
        return [("tensor", e.tensor)]
    if isinstance(e, LowRank):
        return [("left", e.left), ("right", e.right)]
    if isinstance(e, SeededLowRank):
        return [(f"coef@{e.seed}:{e.side}", e.coef)]
    if isinstance(e, GaLoreUpdate):
        if e.decay != 0.0:
            raise DataDrivenBasis(f"{key}: a GaLore update with a weight-decay term (decay·W0 is outside the clip)")
        out = []
        for t in e.terms:
            if not isinstance(t, SeededLowRank):
                raise DataDrivenBasis(f"{key}: a GaLore update term on a data-driven (RSVD) basis")
            out.append((f"coef@{t.seed}:{t.side}", t.coef))
        return out
    if isinstance(e, MomentView):
        if e.basis is not None:
            raise DataDrivenBasis(f"{key}: a second-moment view on the client's own basis")
        return [("moment", e.moment)]
    raise DataDrivenBasis(f"{key}: an entry of kind {type(e).__name__} (not released under client-level DP)")


def slots(upload: Payload) -> dict[Slot, torch.Tensor]:
    """Every tensor the upload releases, by slot (module doc); raises :class:`DataDrivenBasis`."""
    return {(k, part): t for k, e in upload.entries.items() for part, t in _entry_parts(k, e)}


def _rebuild(key: str, e: Entry, new: dict[str, torch.Tensor]) -> Entry:
    def cast(part: str, like: torch.Tensor) -> torch.Tensor:
        return new[part].to(like.dtype)

    if isinstance(e, Dense):
        return Dense(cast("tensor", e.tensor))
    if isinstance(e, LowRank):
        return LowRank(cast("left", e.left), cast("right", e.right))
    if isinstance(e, SeededLowRank):
        return SeededLowRank(cast(f"coef@{e.seed}:{e.side}", e.coef), e.seed, e.side, e.shape, e.frame)
    if isinstance(e, GaLoreUpdate):
        terms = tuple(SeededLowRank(cast(f"coef@{t.seed}:{t.side}", t.coef), t.seed, t.side, t.shape, t.frame) for t in e.terms)
        return GaLoreUpdate(e.decay, terms, e.shape)
    if isinstance(e, MomentView):
        return MomentView(cast("moment", e.moment).clamp_min(0), e.side, e.shape, None, e.seed, e.weight, e.frame)
    raise DataDrivenBasis(key)


def _reference(ref: Entry | None, key: str, part: str, like: torch.Tensor) -> torch.Tensor | None:
    if ref is None:
        return None
    try:
        parts = dict(_entry_parts(key, ref))
    except DataDrivenBasis:
        return None
    t = parts.get(part)
    return t.float() if t is not None and tuple(t.shape) == tuple(like.shape) else None


def clip_upload(upload: Payload, reference: Callable[[str], Entry | None], clip: float, moment_clip: float | None,
                withhold_moments: bool = False) -> tuple[dict[Slot, torch.Tensor], dict[Slot, torch.Tensor], dict[str, float]]:
    """``(references, clipped changes, stats)`` of one upload (module doc, "the change", "clip"):
    the update slots' changes scaled together to L2 norm ≤ ``clip``, the moment slots' together to
    ≤ ``moment_clip`` (dropped with ``withhold_moments``). ``stats``: the norms before clipping
    (private: the caller decides whether they leave the client)."""
    refs: dict[Slot, torch.Tensor] = {}
    changes: dict[Slot, torch.Tensor] = {}
    for slot, t in slots(upload).items():
        key, part = slot
        if withhold_moments and is_moment(key):
            continue
        r = _reference(reference(key), key, part, t) if not is_moment(key) else None
        refs[slot] = r if r is not None else torch.zeros(t.shape, dtype=torch.float32)
        changes[slot] = t.float() - refs[slot]
    stats = {}
    for name, pick, bound in (("update", lambda k: not is_moment(k), clip), ("moment", is_moment, moment_clip)):
        group = [s for s in changes if pick(s[0])]
        if not group:
            continue
        norm = math.sqrt(sum(float(changes[s].double().pow(2).sum()) for s in group))
        stats[f"{name}_norm"] = norm
        if bound is not None and norm > bound:
            f = bound / norm
            for s in group:
                changes[s] = changes[s] * f
    return refs, changes, stats


def add_noise(upload: Payload, refs: dict[Slot, torch.Tensor], changes: dict[Slot, torch.Tensor],
              noise: Callable[[Slot, torch.Size], torch.Tensor | None]) -> Payload:
    """The released upload: each slot's reference + clipped change + ``noise(slot, shape)`` (None:
    no noise), entries rebuilt in their own dtype; moment slots not in ``changes`` (withheld) are
    dropped, with their entries."""
    entries: dict[str, Entry] = {}
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for (key, part), c in changes.items():
        z = noise((key, part), c.shape)
        by_key.setdefault(key, {})[part] = refs[(key, part)] + c + (z if z is not None else 0.0)
    for key, e in upload.entries.items():
        if key in by_key:
            entries[key] = _rebuild(key, e, by_key[key])
    return Payload(entries, dict(upload.meta))


def shared_noise(changes: Sequence[dict[Slot, torch.Tensor]], std: float, draw: Callable[[torch.Size, float], torch.Tensor],
                 select: Callable[[Slot], bool]) -> list[dict[Slot, torch.Tensor]]:
    """Central noise on the sum (module doc): one draw z ~ N(0, std²) per selected slot
    (``draw(shape, std)``: fedgalore.privacy.randomness.gaussian on the run's DP stream), split
    evenly over the uploads that hold it (``z/n`` each), so the uniform mean of the k uploads
    carries exactly ``z/k``. Slots are drawn in sorted order."""
    holders: dict[Slot, list[int]] = {}
    for i, ch in enumerate(changes):
        for s in ch:
            if select(s):
                holders.setdefault(s, []).append(i)
    out: list[dict[Slot, torch.Tensor]] = [{} for _ in changes]
    for s in sorted(holders):
        idx = holders[s]
        shape = changes[idx[0]][s].shape
        z = draw(shape, float(std))
        for i in idx:
            out[i][s] = z / len(idx)
    return out


def combined_multiplier(sigmas: Iterable[float]) -> float:
    """σ of one Gaussian mechanism equivalent to releasing several Gaussian mechanisms of the same
    input with noise multipliers ``sigmas`` (each at its own sensitivity): ``(Σ σ_j⁻²)^(-1/2)``; 0
    when one of them is 0 (no noise: ε = ∞)."""
    sig = [float(s) for s in sigmas]
    if any(s <= 0 for s in sig):
        return 0.0
    return sum(s ** -2 for s in sig) ** -0.5 if sig else math.inf


def _event(sigma: float, population: int, sample: int, rounds: int):
    import dp_accounting

    gauss = dp_accounting.GaussianDpEvent(sigma / 2.0)  # replace-one: the sum's sensitivity is 2C
    one = gauss if sample >= population else dp_accounting.SampledWithoutReplacementDpEvent(int(population), int(sample), gauss)
    return dp_accounting.SelfComposedDpEvent(one, int(rounds))


def client_epsilon(history: Sequence[Sequence[float]], population: int, delta: float) -> float:
    """ε(δ) of the federation after the rounds in ``history`` — ``(σ, K, rounds)`` entries: rounds
    in which K of the ``population`` M clients were sampled without replacement and the sum of
    their clipped uploads carried noise multiplier σ (module doc; replace-one adjacency) — by
    dp-accounting's RDP accountant. 0 without rounds, ∞ with σ = 0."""
    import dp_accounting
    from absl import logging as absl_logging
    from dp_accounting import rdp

    hist = [(float(s), int(k), int(n)) for s, k, n in history if int(n) > 0]
    if not hist:
        return 0.0
    if any(s <= 0 for s, _, _ in hist):
        return math.inf
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        acc.compose(dp_accounting.ComposedDpEvent([_event(s, population, k, n) for s, k, n in hist]))
        return float(acc.get_epsilon(float(delta)))
    finally:
        absl_logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=256)
def calibrate_client_noise(target_epsilon: float, delta: float, population: int, sample: int, rounds: int,
                           moment_ratio: float | None = None, tolerance: float = 0.01) -> float:
    """σ (the update's noise multiplier) whose ``rounds`` rounds spend at most ``target_epsilon``
    and no more than ``tolerance`` below it. ``moment_ratio``: the moment release's σ_m = ratio·σ
    rides along (its σ combines with σ, :func:`combined_multiplier`); None: no second release. A
    budget no σ ≤ 10⁴ meets is a ``ValueError``."""
    def eps(sigma: float) -> float:
        eff = sigma if moment_ratio is None else combined_multiplier([sigma, moment_ratio * sigma])
        return client_epsilon([(eff, sample, rounds)], population, delta)

    sigma = solve_noise(eps, target_epsilon, tolerance, limit=1e4)
    if sigma is None:
        raise ValueError(f"no noise multiplier reaches ε={target_epsilon:g} at δ={delta:g} over {rounds} rounds of "
                         f"{sample} of {population} clients")
    return sigma
