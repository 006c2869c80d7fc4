"""What protects the aggregate: ``federation.secure_aggregation`` and ``federation.robust``.

* **Secure aggregation** (``federation.secure_aggregation``): Flower's SecAgg+ (Bell et al. 2020,
  "Secure single-server aggregation with (poly)logarithmic overhead"; Flower's
  ``SecAggPlusWorkflow`` on the server and ``secaggplus_mod`` on each ClientApp — Flower's own
  implementation, fedgalore.flower.secagg). Each client uploads ``[w_i, w_i·x_i]`` quantised and
  masked; the server learns only ``Σ w_i x_i / Σ w_i``. It therefore needs a method whose operator A
  is a weighted *sum* of what clients upload (:meth:`fedgalore.methods.base.Method.
  secure_aggregation_problem` says, per method and options, why not), and it excludes anything the
  server would need to see per client (robust aggregation, ``federation.max_update_norm`` /
  ``clip_update_norm``, central client-level DP noise). Deployments only (the Flower backend).
* **Robust aggregation** (``federation.robust``): the server drops or down-weights a hostile site's
  upload before A (fedgalore.federated.robust; the round loop's seam fedgalore.engine.stages.robust).

Both are plain dataclasses checked with one-line :class:`~fedgalore.typed.ConfigError` messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedgalore.federated.sites import is_site_id, is_site_name
from fedgalore.typed import ConfigError

__all__ = ["SecureAggregationConfig", "RobustConfig", "AttackConfig", "ROBUST_KINDS", "DENSE_ONLY_KINDS", "ATTACK_KINDS"]

#: federation.robust.kind values
ROBUST_KINDS = ("trimmed_mean", "median", "krum", "norm_filter")
#: coordinate-wise statistics: defined on dense uploads only (the coordinates of two clients' low-rank
#: factors are not the same coordinates — A_i and A_j span different subspaces)
DENSE_ONLY_KINDS = ("trimmed_mean", "median")
#: federation.attack.kind values
ATTACK_KINDS = ("scale", "sign_flip")


@dataclass
class SecureAggregationConfig:
    """``federation.secure_aggregation``: Flower SecAgg+ parameters (``SecAggPlusWorkflow``'s)."""

    #: shares each client's secrets are split into (int > 2, or a float share of the round's clients)
    num_shares: float = 1.0
    #: shares needed to reconstruct a secret (int < num_shares, or a float share of num_shares)
    reconstruction_threshold: float = 0.67
    #: every uploaded value is clipped to [-clipping_range, clipping_range] before quantisation
    clipping_range: float = 8.0
    #: quantisation levels over [-clipping_range, clipping_range] (error per value ≤ clipping_range / quantization_range)
    quantization_range: int = 2**22
    #: masks are drawn mod this (a power of 2 above quantization_range · clients)
    modulus_range: int = 2**32
    #: the largest weight w_i a client may carry (its example count, or 1 under client-level DP); null:
    #: the largest client size of the federation
    max_weight: float | None = None

    def check(self, path: str = "federation.secure_aggregation") -> "SecureAggregationConfig":
        s, t = self.num_shares, self.reconstruction_threshold
        if not (isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 and math.isfinite(s)):
            raise ConfigError(f"{path}.num_shares={s!r} must be an integer > 2 or a share in (0, 1] of the round's clients")
        if isinstance(s, float) and not float(s).is_integer() and s > 1:
            raise ConfigError(f"{path}.num_shares={s!r}: a share of the round's clients must be in (0, 1]; give an integer > 2 for a count")
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 and math.isfinite(t)):
            raise ConfigError(f"{path}.reconstruction_threshold={t!r} must be an integer >= 2 or a share in (0, 1]")
        if self.count(s) and self.count(t) and int(t) >= int(s):
            raise ConfigError(f"{path}.reconstruction_threshold={int(t)} must be below num_shares={int(s)}")
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ConfigError(f"{path}.clipping_range={self.clipping_range!r} must be a positive number (e.g. 8.0)")
        q, mod = self.quantization_range, self.modulus_range
        if not (isinstance(q, int) and q > 1):
            raise ConfigError(f"{path}.quantization_range={q!r} must be an integer > 1 (e.g. 4194304 = 2**22)")
        if not (isinstance(mod, int) and mod > q and mod & (mod - 1) == 0 and mod <= 2**32):
            raise ConfigError(f"{path}.modulus_range={mod!r} must be a power of 2 above quantization_range and at most 2**32")
        if self.max_weight is not None and not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise ConfigError(f"{path}.max_weight={self.max_weight!r} must be a positive number or null (the largest client size)")
        return self

    def min_survivors(self, clients: int) -> int:
        """The fewest of ``clients`` nodes whose masked uploads SecAgg+ can still unmask into a sum:
        a survivor's mask needs ``reconstruction_threshold`` of its ``num_shares`` shares, so fewer
        survivors than that release nothing (the privacy accountant's worst case)."""
        k = max(int(clients), 1)
        shares = int(self.num_shares) if self.count(self.num_shares) else max(int(math.ceil(float(self.num_shares) * k)), 1)
        t = self.reconstruction_threshold
        need = int(t) if self.count(t) else int(math.ceil(float(t) * shares))
        return max(1, min(k, need))

    @staticmethod
    def count(x: float) -> bool:
        """True when ``x`` is a count (an integer above 1), False for a share in (0, 1]."""
        return float(x).is_integer() and x > 1

    def flower_value(self, x: float) -> int | float:
        """What Flower's SecAggPlusWorkflow takes: an int for a count, a float for a share."""
        return int(x) if self.count(x) else float(x)

    def quantization_error(self) -> float:
        """Worst-case error of one dequantised value of one client's upload: one quantisation step,
        ``2·clipping_range / quantization_range`` (stochastic rounding: unbiased, |error| below one step)."""
        return 2.0 * self.clipping_range / self.quantization_range


@dataclass
class RobustConfig:
    """``federation.robust``: what the server does against a hostile site (fedgalore.federated.robust).

    ``trimmed_mean`` / ``median``: coordinate-wise over the clients (as Flower's FedTrimmedAvg /
    FedMedian: unweighted), dense methods only. ``krum``: the ``to_keep`` uploads closest to their
    ``K − f − 2`` nearest neighbours (Krum for 1, Multi-Krum above), aggregated by the method's own
    A — for every method, on the clients' reconstructed updates ΔW_i compared through their factors.
    ``norm_filter``: drop uploads whose ‖ΔW_i‖_F exceeds ``norm_factor`` × the round's median.
    ``norm_factor`` set with another kind: that filter runs first."""

    kind: str = "norm_filter"
    #: trimmed_mean: the share of clients cut from each end, per coordinate (Flower's proportiontocut)
    beta: float = 0.2
    #: krum: f, the number of hostile sites tolerated (needs K − f − 2 >= 1)
    num_malicious: int = 1
    #: krum: uploads kept (1: Krum; > 1: Multi-Krum)
    to_keep: int = 1
    #: norm_filter (or a pre-filter with the other kinds): keep ‖ΔW_i‖ <= norm_factor · median_j ‖ΔW_j‖
    norm_factor: float | None = None

    def check(self, path: str = "federation.robust") -> "RobustConfig":
        if self.kind not in ROBUST_KINDS:
            raise ConfigError(f"{path}.kind={self.kind!r} must be one of {', '.join(ROBUST_KINDS)}")
        if not (0.0 <= self.beta < 0.5):
            raise ConfigError(f"{path}.beta={self.beta!r} must be in [0, 0.5) (the share cut from each end, e.g. 0.2)")
        if not (isinstance(self.num_malicious, int) and self.num_malicious >= 0):
            raise ConfigError(f"{path}.num_malicious={self.num_malicious!r} must be an integer >= 0")
        if not (isinstance(self.to_keep, int) and self.to_keep >= 1):
            raise ConfigError(f"{path}.to_keep={self.to_keep!r} must be an integer >= 1 (1: Krum; more: Multi-Krum)")
        if self.norm_factor is not None and not (math.isfinite(self.norm_factor) and self.norm_factor > 0):
            raise ConfigError(f"{path}.norm_factor={self.norm_factor!r} must be a positive number (e.g. 3.0) or null")
        return self

    @property
    def factor(self) -> float | None:
        """The norm filter's factor: ``norm_factor``, or 3.0 for ``kind: norm_filter``."""
        if self.norm_factor is not None:
            return float(self.norm_factor)
        return 3.0 if self.kind == "norm_filter" else None

    def min_clients(self) -> int:
        """The fewest uploads a round needs for this rule to be defined (Krum: f + 3)."""
        if self.kind == "krum":
            return max(self.num_malicious + 3, self.to_keep)
        return 1


@dataclass
class AttackConfig:
    """``federation.attack`` (simulations only): hostile sites, to measure a defence. Each listed
    client's upload is replaced, as it arrives, by one whose update is ``factor`` times its own
    (``scale``, default ×50) or ``−factor`` times it (``sign_flip``, default ×−1): exactly, through
    the method's own scaling where its update is linear in the upload (FedAvg-Full, FedGaLore); for
    factored uploads (the LoRA family) each uploaded tensor's change from what the client started
    from is scaled (fedgalore.engine.stages.attack)."""

    #: the hostile sites: client ids, or the sites' names where the partition names them (fedgalore.federated.sites)
    clients: list[int | str] = field(default_factory=lambda: [0])
    kind: str = "scale"
    #: null: 50 for scale, 1 for sign_flip
    factor: float | None = None

    def check(self, path: str = "federation.attack") -> "AttackConfig":
        if self.kind not in ATTACK_KINDS:
            raise ConfigError(f"{path}.kind={self.kind!r} must be one of {', '.join(ATTACK_KINDS)}")
        if not isinstance(self.clients, (list, tuple)) or not self.clients \
                or not all(is_site_id(c) or is_site_name(c) for c in self.clients):
            raise ConfigError(f"{path}.clients={self.clients!r} must be a non-empty list of client ids (e.g. [0]) "
                              "or site names (natural, files and nodes partitions: fedgalore partition lists them)")
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"{path}.factor={self.factor!r} must be a positive number (sign_flip negates it)")
        return self

    @property
    def multiplier(self) -> float:
        """The factor the hostile clients' updates are multiplied by."""
        f = float(self.factor) if self.factor is not None else (50.0 if self.kind == "scale" else 1.0)
        return -f if self.kind == "sign_flip" else f
