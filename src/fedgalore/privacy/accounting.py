"""Per-site privacy accounting of DP-SGD: ε(δ) over every noisy step a site took (docs/privacy.md).

A site's history is a list of ``(σ, q, steps)``: ``steps`` optimizer steps of the Poisson-sampled
Gaussian mechanism with noise multiplier σ and sampling rate q (each example in each step with
probability q, independently; :func:`fedgalore.privacy.dpsgd.poisson_steps`). The steps of every
round the site took part in compose; ε(δ) comes from Opacus' accountants (:func:`epsilon`:
``rdp`` — Rényi DP of the sampled Gaussian mechanism, Mironov et al. 2019, converted to (ε, δ)
by Balle et al. 2020's bound; ``prv`` — privacy random variables, Gopi et al. 2021). The
adjacency is add/remove one record of the site, as those analyses assume.

:func:`reference_epsilon` computes the same quantity with Google's ``dp-accounting`` (RDP with
Opacus' orders, or its PLD accountant for ``prv``): the tests check the two agree to 2 %.
:func:`calibrate_noise` finds the σ whose ε over the planned steps is at most the target and
within 0.01 of it (Opacus' ``get_noise_multiplier``, made fast for RDP). :func:`site_schedule` is what a site with
``n`` examples runs: its q, steps per round, planned rounds and σ.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

from fedgalore.privacy.config import RecordPrivacy
from fedgalore.typed import ConfigError

__all__ = ["History", "merge_history", "epsilon", "reference_epsilon", "calibrate_noise", "bisect_noise", "solve_noise", "SiteSchedule",
           "site_schedule", "target_problem", "MAX_CALIBRATED_SIGMA", "sample_rate"]

#: (noise multiplier σ, sampling rate q, steps)
History = Sequence[Sequence[float]]


def merge_history(history: Iterable[Sequence[float]]) -> list[list[float]]:
    """The history with consecutive entries of the same (σ, q) merged (their steps added) and
    empty ones dropped: the composition is the same."""
    out: list[list[float]] = []
    for sigma, q, steps in history:
        if int(steps) <= 0:
            continue
        if out and out[-1][0] == float(sigma) and out[-1][1] == float(q):
            out[-1][2] += int(steps)
        else:
            out.append([float(sigma), float(q), int(steps)])
    return out


def _opacus_accountant(name: str):
    from opacus.accountants import PRVAccountant, RDPAccountant

    if name == "rdp":
        return RDPAccountant()
    if name == "prv":
        return PRVAccountant()
    raise ValueError(f"accountant must be rdp or prv, got {name!r}")


def epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """ε(δ) of a site that ran ``history`` (module doc), by Opacus' ``rdp`` or ``prv``
    accountant; 0 for no steps, ∞ when a step had σ = 0. RDP: ``RDPAccountant.get_epsilon``'s
    computation (the test checks they agree), each (σ, q)'s per-step RDP computed once."""
    hist = merge_history(history)
    if not hist:
        return 0.0
    if any(s <= 0 for s, _, _ in hist):
        return math.inf
    with warnings.catch_warnings():  # "optimal order is the smallest alpha" at large ε; PRV's log(0) at q = 1
        warnings.simplefilter("ignore")
        if accountant == "rdp":
            # RDPAccountant.get_privacy_spent, with each (σ, q)'s per-step RDP computed once (RDP adds over steps)
            from opacus.accountants.analysis import rdp as analysis
            from opacus.accountants.rdp import RDPAccountant

            rdp = sum(int(n) * _rdp_per_step(s, q) for s, q, n in hist)
            return float(analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=float(delta))[0])
        acc = _opacus_accountant(accountant)
        acc.history = [(s, q, int(n)) for s, q, n in hist]
        return float(acc.get_epsilon(delta=float(delta)))


@functools.lru_cache(maxsize=4096)
def _rdp_per_step(sigma: float, q: float):
    """Opacus' RDP of one step of the sampled Gaussian mechanism at its default orders."""
    from opacus.accountants.analysis import rdp as analysis
    from opacus.accountants.rdp import RDPAccountant

    return analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)


def reference_epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """ε(δ) of the same history by ``dp-accounting`` (the cross-check of :func:`epsilon`): its
    ``RdpAccountant`` on Opacus' RDP orders for ``rdp``, its ``PLDAccountant`` for ``prv``."""
    import dp_accounting
    from absl import logging as absl_logging
    from dp_accounting import pld, rdp
    from opacus.accountants.rdp import RDPAccountant

    hist = merge_history(history)
    if not hist:
        return 0.0
    if any(s <= 0 for s, _, _ in hist):
        return math.inf
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), int(n))
        for s, q, n in hist])
    acc = (rdp.RdpAccountant(orders=list(RDPAccountant.DEFAULT_ALPHAS)) if accountant == "rdp"
           else pld.PLDAccountant(value_discretization_interval=1e-3))
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # orders whose series does not converge are dropped, with a warning each
    try:
        acc.compose(event)
        return float(acc.get_epsilon(float(delta)))
    finally:
        absl_logging.set_verbosity(verbosity)


#: the RDP orders of the first, fast search of :func:`calibrate_noise` (a subset of Opacus' defaults)
_SEARCH_ORDERS = [1.25, 1.5, 1.75] + list(range(2, 64))


@functools.lru_cache(maxsize=4096)
def calibrate_noise(target_epsilon: float, delta: float, rate: float, steps: int, accountant: str = "rdp",
                    tolerance: float = 0.01) -> float:
    """σ such that ``steps`` steps at sampling rate ``rate`` spend at most ``target_epsilon``, and
    no more than ``tolerance`` below it, by :func:`epsilon` (Opacus' accountant).

    ``prv``: Opacus' ``get_noise_multiplier``. ``rdp``: the same search (``get_noise_multiplier``)
    first on a subset of Opacus' RDP orders — fast; the ε of the σ it finds is an upper bound of
    the ε at all orders, so that σ meets the target — then a bisection with :func:`epsilon` (all
    orders) between 0.8 × that σ and it, to the tolerance (Opacus' fractional orders are slow to
    evaluate: its search on all of them takes 5–35 s per site). A budget too small for any σ is a
    ``ValueError`` saying so."""
    from opacus.accountants.utils import get_noise_multiplier

    steps = max(int(steps), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if accountant != "rdp":
                return float(get_noise_multiplier(target_epsilon=float(target_epsilon), target_delta=float(delta),
                                                  sample_rate=float(rate), steps=steps, accountant=accountant,
                                                  epsilon_tolerance=tolerance))
            hi = float(get_noise_multiplier(target_epsilon=float(target_epsilon), target_delta=float(delta),
                                            sample_rate=float(rate), steps=steps, accountant="rdp",
                                            epsilon_tolerance=tolerance, alphas=_SEARCH_ORDERS))
        except ValueError as exc:
            raise ValueError(f"no noise multiplier reaches ε={target_epsilon:g} at δ={delta:g} over {steps} steps "
                             f"of sampling rate {rate:.4g} ({exc})") from None

    def eps(sigma: float) -> float:
        return epsilon([(sigma, rate, steps)], delta, "rdp")

    if target_epsilon - eps(hi) <= tolerance:
        return hi
    lo = 0.8 * hi
    while eps(lo) <= target_epsilon:  # (all orders allow much less noise: widen downwards)
        hi, lo = lo, 0.8 * lo
    return bisect_noise(eps, target_epsilon, lo, hi, tolerance)


def bisect_noise(eps, target_epsilon: float, lo: float, hi: float, tolerance: float) -> float:
    """The smallest noise multiplier in ``(lo, hi]`` found by bisection whose ``eps(σ)`` is at most
    ``target_epsilon`` and within ``tolerance`` of it (``eps`` decreasing in σ; ``eps(hi)`` must
    meet the target): shared by the record-level and client-level calibrations."""
    while target_epsilon - eps(hi) > tolerance and hi - lo > 1e-6 * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def solve_noise(eps, target_epsilon: float, tolerance: float = 0.01, limit: float = 1e4) -> float | None:
    """The noise multiplier whose ``eps(σ)`` (decreasing in σ) spends at most ``target_epsilon`` and
    no more than ``tolerance`` below it: σ doubled from 1 until it meets the target, then
    :func:`bisect_noise`; None when no σ ≤ ``limit`` meets it (the caller says why in its words)."""
    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2.0
        if hi > limit:
            return None
    return bisect_noise(eps, target_epsilon, lo, hi, tolerance)


def sample_rate(num_examples: int, batch_size: int, grad_accum_steps: int = 1) -> float:
    """q: the Poisson sampling rate of a site with ``num_examples`` examples, whose expected
    batch per optimizer step is ``batch_size × grad_accum_steps`` examples (1 when that is all
    of them)."""
    if num_examples <= 0:
        return 0.0
    return min(1.0, batch_size * max(int(grad_accum_steps), 1) / num_examples)


@dataclass(frozen=True)
class SiteSchedule:
    """What DP-SGD runs at one site: q, optimizer steps per round, the rounds σ is planned for
    and σ (:func:`site_schedule`)."""

    num_examples: int
    sample_rate: float
    steps_per_round: int
    rounds: int
    planned_rounds: float
    planned_steps: int
    noise_multiplier: float

    def planned_epsilon(self, record: RecordPrivacy) -> float:
        """ε(δ) the site spends over its planned steps."""
        return epsilon([(self.noise_multiplier, self.sample_rate, self.planned_steps)], record.delta, record.accountant)

    def epsilon_every_round(self, record: RecordPrivacy) -> float:
        """ε(δ) the site spends if it takes part in every one of the run's rounds (the most it can)."""
        return epsilon([(self.noise_multiplier, self.sample_rate, self.rounds * self.steps_per_round)], record.delta,
                       record.accountant)


def site_schedule(record: RecordPrivacy, num_examples: int, batch_size: int, grad_accum_steps: int, steps_per_round: int,
                  rounds: int, participation: float) -> SiteSchedule:
    """The schedule of a site with ``num_examples`` examples and ``steps_per_round`` optimizer
    steps per round in a run of ``rounds`` rounds where it takes part with probability
    ``participation`` (clients_per_round / num_clients). Planned rounds: ``participation ·
    rounds`` (``calibration: expected``) or ``rounds`` (``every_round``); with
    ``target_epsilon`` σ is calibrated to spend it over ``⌈planned rounds · steps per round⌉``
    steps (a target no σ meets is a :class:`ConfigError`), else σ is ``noise_multiplier``."""
    q, planned_rounds, planned_steps = _planned(record, num_examples, batch_size, grad_accum_steps, steps_per_round,
                                                rounds, participation)
    if record.target_epsilon is not None and planned_steps > 0:
        try:
            sigma = calibrate_noise(float(record.target_epsilon), float(record.delta), q, planned_steps, record.accountant)
        except ValueError as exc:  # a budget no σ meets: the user's to change, in one line
            raise ConfigError(_unreachable(exc, num_examples)) from None
    else:
        sigma = float(record.noise_multiplier or 0.0)
    return SiteSchedule(int(num_examples), q, int(steps_per_round), int(rounds), planned_rounds, planned_steps, sigma)


def _planned(record: RecordPrivacy, num_examples: int, batch_size: int, grad_accum_steps: int, steps_per_round: int,
             rounds: int, participation: float) -> tuple[float, float, int]:
    """``(q, planned rounds, planned steps)`` of a site (:func:`site_schedule`)."""
    q = sample_rate(num_examples, batch_size, grad_accum_steps)
    planned_rounds = float(rounds) * (float(participation) if record.calibration == "expected" else 1.0)
    planned_steps = max(int(math.ceil(planned_rounds * steps_per_round - 1e-9)), 1) if steps_per_round > 0 else 0
    return q, planned_rounds, planned_steps


def _unreachable(exc: Exception, num_examples: int) -> str:
    return (f"privacy.record.target_epsilon: {exc}, for a site of {int(num_examples)} examples; raise target_epsilon or "
            "lower federation.rounds")


#: the largest σ a calibration tries (Opacus' ``get_noise_multiplier`` gives up beyond it)
MAX_CALIBRATED_SIGMA = 1e6


def target_problem(record: RecordPrivacy, num_examples: int, batch_size: int, grad_accum_steps: int,
                   steps_per_round: int, rounds: int, participation: float) -> str | None:
    """Why no σ calibrates this site to ``record.target_epsilon`` — even σ = 10⁶ over its planned
    steps spends more — as one line, or None (also without a target). Cheap (one accountant
    evaluation, no search): the run checks every site size with it before anything trains."""
    if record.target_epsilon is None:
        return None
    q, _, planned_steps = _planned(record, num_examples, batch_size, grad_accum_steps, steps_per_round, rounds,
                                   participation)
    if planned_steps <= 0:
        return None
    least = epsilon([(MAX_CALIBRATED_SIGMA, q, planned_steps)], record.delta, record.accountant)
    if least <= float(record.target_epsilon):
        return None
    return _unreachable(ValueError(f"no noise multiplier reaches ε={float(record.target_epsilon):g} at "
                                   f"δ={float(record.delta):g} over {planned_steps} steps of sampling rate {q:.4g} (even "
                                   f"σ = {MAX_CALIBRATED_SIGMA:g} spends ε = {least:.3g})"), num_examples)
