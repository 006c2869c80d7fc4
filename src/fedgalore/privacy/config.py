"""``privacy:`` in the run configuration: record-level DP-SGD at each site and client-level DP
across sites (docs/privacy.md).

YAML::

    privacy:
      record:                    # DP-SGD at every site (Opacus); null / absent: no DP
        max_grad_norm: 1.0       # C: each example's gradient is clipped to this L2 norm, every step
        noise_multiplier: 1.0    # σ: Gaussian noise N(0, σ²C²) on the step's summed clipped gradients ...
        # target_epsilon: 8.0    # ... or give ε and σ is calibrated per site (not both)
        delta: 1.0e-5            # δ of the reported (ε, δ); must be < 1/n for every site's n examples
        accountant: rdp          # rdp | prv (Opacus' accountants)
        calibration: every_round # target_epsilon over all R rounds (a cap) | expected (K/M·R rounds; a site that would pass the target stops)
        release_metrics: false   # true: the clients' training losses travel in the clear (not protected)

      client:                    # DP-FedAvg across sites: whole uploads clipped, Gaussian noise on their sum
        clip: 0.1                # C: each client's upload change (its update, its head) clipped to this L2 norm
        noise_multiplier: 1.0    # σ: the sum of the clipped changes carries N(0, σ²C²) ...
        # target_epsilon: 8.0    # ... or give ε and σ is calibrated to spend it over the run's rounds; with both, ε caps the run
        delta: 1.0e-5            # δ; must be below 1/M (M: the number of sites)
        noise: central           # central: the server adds the noise | distributed: each client adds σ/√K of it
        moments: noised          # FedGaLore's second moments: noised (a second release, composed) | withheld
        moment_clip: 1.0         # C_m: each client's moment block clipped to this L2 norm (moments: noised)
        moment_noise_multiplier: null   # σ_m (null: σ)
        adaptive_clipping: null  # {target_quantile: 0.5, lr: 0.2, count_noise_multiplier: null}: C follows a norm quantile
        release_metrics: false   # true: the clients' training losses travel in the clear (not protected)

      sites_dir: null            # a simulation's sites' folders: DIR/<site>/fedgalore-policy.yaml and its ledger
      reproducible: false        # true (studies only): every DP draw seeded from the run's seed — NOT protected against
                                 # anyone who holds the config (the server); false: OS entropy (fedgalore.privacy.randomness)

Only the typed values and their checks live here; the mechanism is :mod:`fedgalore.privacy.dpsgd`,
the accounting :mod:`fedgalore.privacy.accounting`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fedgalore.typed import ConfigError

__all__ = ["RecordPrivacy", "ClientPrivacy", "AdaptiveClipping", "PrivacyConfig", "MAX_NOISE", "noise_problem", "ACCOUNTANTS", "CALIBRATIONS", "CLIENT_NOISE", "MOMENT_RELEASES"]

ACCOUNTANTS = ("rdp", "prv")
CALIBRATIONS = ("expected", "every_round")
CLIENT_NOISE = ("central", "distributed")
MOMENT_RELEASES = ("noised", "withheld")


def _num(v: object) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def _finite(v: object) -> bool:
    """A finite number (``true``/``false`` are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: the largest noise multiplier σ and noise std σ·C (per coordinate) a run accepts: beyond it the
#: output is all noise, and its squares (norms, the diagnostics' SVD) overflow float32 (3.4e38)
MAX_NOISE = 1e6


def noise_problem(path: str, sigma: float | None, clip: float, clip_key: str) -> str | None:
    """Why noise multiplier ``sigma`` (``path``) with clip ``clip`` (``clip_key``) is refused — σ or
    the noise std σ·C above :data:`MAX_NOISE` — as one line, or None."""
    if sigma is None or not _finite(sigma) or not _finite(clip):
        return None
    if sigma > MAX_NOISE or sigma * clip > MAX_NOISE:
        return (f"{path}={_num(sigma)} with {clip_key}={_num(clip)} gives noise of std σ·C = {sigma * clip:.3g} per "
                f"coordinate; σ and σ·C must be at most {MAX_NOISE:g} (beyond, the model is all noise and its norms "
                "overflow float32): lower the noise multiplier")
    return None


_SECURE_MODE_REMOVED = ("was removed: every DP draw now comes from OS entropy by default (secure); "
                        "privacy.reproducible: true seeds them for studies; drop the key")


@dataclass
class RecordPrivacy:
    """``privacy.record``: record-level differential privacy by DP-SGD at every site (module doc)."""

    #: keys of earlier versions and what to do instead (fedgalore.typed.from_plain)
    _removed_keys = {"secure_mode": _SECURE_MODE_REMOVED}

    #: C: the per-example clipping norm (L2 over every tensor the site trains, per optimizer step)
    max_grad_norm: float = 1.0
    #: σ: the noise multiplier (the noise's std is σ·C on the summed clipped gradients); or target_epsilon
    noise_multiplier: float | None = None
    #: ε to spend per site over the planned rounds; σ is calibrated to it (instead of noise_multiplier)
    target_epsilon: float | None = None
    #: δ of the (ε, δ) guarantee; must be below 1/n for every site (n: its training examples)
    delta: float = 1e-5
    #: Opacus' accountant: rdp (Rényi DP, Mironov et al.) or prv (privacy random variables, Gopi et al.)
    accountant: Literal["rdp", "prv"] = "rdp"
    #: target_epsilon: plan σ for every round (the worst case: the target is never passed) or for the site's expected
    #: participation (clients_per_round/num_clients of the rounds; a site whose next round would pass the target
    #: is not trained again). Either way target_epsilon is a cap (fedgalore.engine.stages.privacy_ledger.PrivacyLedger.site_stop)
    calibration: Literal["expected", "every_round"] = "every_round"
    #: true: each client's training-loss statistics (raw, NOT protected) are uploaded; false: withheld
    release_metrics: bool = False

    def check(self, path: str = "privacy.record") -> None:
        """Raise :class:`ConfigError` (one line, naming the key and the fix) on a bad value."""
        c, s, e, d = self.max_grad_norm, self.noise_multiplier, self.target_epsilon, self.delta
        if not (_finite(c) and c > 0):
            raise ConfigError(f"{path}.max_grad_norm={_num(c)} must be a positive number (the per-example clipping norm C, e.g. 1.0)")
        if s is not None and not (_finite(s) and s >= 0):
            raise ConfigError(f"{path}.noise_multiplier={_num(s)} must be a number >= 0 (0: clipping only, ε = ∞)")
        if e is not None and not (_finite(e) and e > 0):
            raise ConfigError(f"{path}.target_epsilon={_num(e)} must be a positive number (e.g. 8)")
        if s is None and e is None:
            raise ConfigError(f"{path} needs noise_multiplier (σ, e.g. 1.0) or target_epsilon (ε, e.g. 8); set one")
        if s is not None and e is not None:
            if s == 0:
                raise ConfigError(f"{path}.noise_multiplier=0 adds no noise, so no target_epsilon={e:g} can be met; "
                                  "drop noise_multiplier to calibrate σ to target_epsilon")
            raise ConfigError(f"{path}: give noise_multiplier or target_epsilon, not both (σ fixed, or calibrated to ε)")
        why = noise_problem(f"{path}.noise_multiplier", s, c, f"{path}.max_grad_norm")
        if why is not None:
            raise ConfigError(why)
        if not (_finite(d) and 0 < d < 1):
            raise ConfigError(f"{path}.delta={_num(d)} must be in (0, 1) and below 1/n for every site (e.g. 1e-5)")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"{path}.accountant={self.accountant!r} must be one of {', '.join(ACCOUNTANTS)}")
        if self.calibration not in CALIBRATIONS:
            raise ConfigError(f"{path}.calibration={self.calibration!r} must be one of {', '.join(CALIBRATIONS)}")


@dataclass
class AdaptiveClipping:
    """``privacy.client.adaptive_clipping``: the clip norm follows a quantile of the clients'
    update norms (Andrew et al. 2021, "Differentially private learning with adaptive clipping",
    geometric update): each round every client reports whether its change's norm was at most C
    (a bit, noised in the sum with σ_b), and C ← C·exp(−lr·(b̃ − target_quantile))."""

    #: γ: the share of clients whose change should be within C (e.g. 0.5: the median norm)
    target_quantile: float = 0.5
    #: η_C: the geometric learning rate of C
    lr: float = 0.2
    #: σ_b: the noise std of the sum of the bits (null: max(K/20, σ) — Andrew et al.'s K/20, at least σ)
    count_noise_multiplier: float | None = None

    def check(self, path: str) -> None:
        q, lr, sb = self.target_quantile, self.lr, self.count_noise_multiplier
        if not (_finite(q) and 0 < q < 1):
            raise ConfigError(f"{path}.target_quantile={_num(q)} must be in (0, 1) (e.g. 0.5: the median update norm)")
        if not (_finite(lr) and lr > 0):
            raise ConfigError(f"{path}.lr={_num(lr)} must be a positive number (e.g. 0.2)")
        if sb is not None and not (_finite(sb) and sb > 0):
            raise ConfigError(f"{path}.count_noise_multiplier={_num(sb)} must be a positive number (null: max(K/20, σ))")


@dataclass
class ClientPrivacy:
    """``privacy.client``: client-level differential privacy across sites (DP-FedAvg, McMahan et
    al. 2018): each client's upload change is clipped to ``clip``, the sum carries Gaussian noise
    N(0, σ²C²), the federation's accountant composes the rounds (fedgalore.privacy.client_dp)."""

    _removed_keys = {"secure_mode": _SECURE_MODE_REMOVED}

    #: C: the L2 norm each client's whole upload change (update and head, every tensor it sends) is clipped to
    clip: float = 0.1
    #: σ: the noise on the sum of the clipped changes has std σ·C; or target_epsilon
    noise_multiplier: float | None = None
    #: ε to spend over the run's rounds (σ calibrated to it); with noise_multiplier too: a cap that stops the run
    target_epsilon: float | None = None
    #: δ of the (ε, δ) guarantee; must be below 1/M (M: the number of sites)
    delta: float = 1e-5
    #: central: the server clips and adds the noise (trusted server) | distributed: each client clips and adds
    #: N(0, σ²C²/K) to its own upload (K: clients per round), so the sum carries σ — what secure aggregation needs
    noise: Literal["central", "distributed"] = "central"
    #: FedGaLore's second-moment upload: noised (clipped to moment_clip, noised, composed with the update) | withheld
    moments: Literal["noised", "withheld"] = "noised"
    #: C_m: the L2 norm each client's moment blocks (all of them together) are clipped to
    moment_clip: float = 1.0
    #: σ_m of the moment release (null: the update's σ)
    moment_noise_multiplier: float | None = None
    #: the clip norm adapted to a quantile of the update norms (``clip`` is its start); null: fixed
    adaptive_clipping: AdaptiveClipping | None = None
    #: true: each client's training-loss statistics (raw, NOT protected) are uploaded; false: withheld
    release_metrics: bool = False

    def check(self, path: str = "privacy.client") -> None:
        """Raise :class:`ConfigError` (one line, naming the key and the fix) on a bad value."""
        c, s, e, d = self.clip, self.noise_multiplier, self.target_epsilon, self.delta
        if not (_finite(c) and c > 0):
            raise ConfigError(f"{path}.clip={_num(c)} must be a positive number (the L2 norm each client's upload change "
                              "is clipped to, e.g. 0.1)")
        if s is None and e is None:
            raise ConfigError(f"{path} needs noise_multiplier (σ, e.g. 1.0) or target_epsilon (ε, e.g. 8); set one")
        if s is not None and not (_finite(s) and s >= 0):
            raise ConfigError(f"{path}.noise_multiplier={_num(s)} must be a number >= 0 (0: clipping only, ε = ∞)")
        if s is not None and s == 0 and e is not None:
            raise ConfigError(f"{path}.noise_multiplier=0 adds no noise, so target_epsilon={e:g} cannot be met; drop "
                              "noise_multiplier to calibrate σ to target_epsilon")
        if e is not None and not (_finite(e) and e > 0):
            raise ConfigError(f"{path}.target_epsilon={_num(e)} must be a positive number (e.g. 8)")
        why = noise_problem(f"{path}.noise_multiplier", s, c, f"{path}.clip")
        if why is not None:
            raise ConfigError(why)
        if not (_finite(d) and 0 < d < 1):
            raise ConfigError(f"{path}.delta={_num(d)} must be in (0, 1) and below 1/M for M sites (e.g. 1e-5)")
        if self.noise not in CLIENT_NOISE:
            raise ConfigError(f"{path}.noise={self.noise!r} must be one of {', '.join(CLIENT_NOISE)}")
        if self.moments not in MOMENT_RELEASES:
            raise ConfigError(f"{path}.moments={self.moments!r} must be one of {', '.join(MOMENT_RELEASES)}")
        mc, ms = self.moment_clip, self.moment_noise_multiplier
        if not (_finite(mc) and mc > 0):
            raise ConfigError(f"{path}.moment_clip={_num(mc)} must be a positive number (e.g. 1.0)")
        if ms is not None and not (_finite(ms) and ms > 0):
            raise ConfigError(f"{path}.moment_noise_multiplier={_num(ms)} must be a positive number (null: the update's σ)")
        if self.moments == "noised":
            why = (noise_problem(f"{path}.moment_noise_multiplier", ms, mc, f"{path}.moment_clip") if ms is not None else
                   noise_problem(f"{path}.noise_multiplier", s, mc, f"{path}.moment_clip"))
            if why is not None:
                raise ConfigError(why)
        if self.adaptive_clipping is not None:
            a = self.adaptive_clipping
            a.check(f"{path}.adaptive_clipping")
            if s is not None and s > 0 and a.count_noise_multiplier is not None and 2 * a.count_noise_multiplier <= s:
                raise ConfigError(f"{path}.adaptive_clipping.count_noise_multiplier={a.count_noise_multiplier:g} must exceed σ/2 "
                                  f"= {s / 2:g}: the bits' noise takes its share of σ (Andrew et al.: σ_Δ = (σ⁻² − (2σ_b)⁻²)^(-1/2)); "
                                  "raise it or leave it null")
            if s == 0:
                raise ConfigError(f"{path}.adaptive_clipping needs noise (noise_multiplier > 0): with σ = 0 the bits would "
                                  "travel in the clear; use a fixed clip")


@dataclass
class PrivacyConfig:
    """``privacy``: what the federation protects. ``record``: DP-SGD at each site; ``client``:
    DP-FedAvg across sites (None: nothing)."""

    record: RecordPrivacy | None = None
    client: ClientPrivacy | None = None
    #: true (studies only): every DP draw is seeded from the run's seed, round and client — reproducible, resumable
    #: bit for bit, and NOT protected against anyone who holds the config (the server); false: OS entropy
    #: (fedgalore.privacy.randomness). A Flower deployment refuses true.
    reproducible: bool = False
    #: a simulation's sites' own folders: ``DIR/<site>/fedgalore-policy.yaml`` (the site's policy, if any) and
    #: ``DIR/<site>/fedgalore-ledger.jsonl`` (its ledger across runs; fedgalore.privacy.site). Not sent to Flower
    #: nodes: a node's policy is its own (node config ``privacy-policy``)
    sites_dir: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether any differential privacy is on."""
        return self.record is not None or self.client is not None

    def check(self) -> None:
        """Check every part (:meth:`RecordPrivacy.check`, :meth:`ClientPrivacy.check`)."""
        if self.record is not None:
            self.record.check()
        if self.client is not None:
            self.client.check()
