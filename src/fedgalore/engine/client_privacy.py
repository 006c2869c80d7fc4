"""Client-level DP in a run (``privacy.client``): where the clipping and the noise happen, and what
one round costs (docs/privacy.md "Client-level DP"; the mechanism: fedgalore.privacy.client_dp).

:class:`ClientRelease` is built once per process from the config and the method. It checks up
front what would make the guarantee false — a method whose upload carries a data-driven basis
(``Method.client_dp_problem``), SCAFFOLD's control variates (another release, not clipped),
``delta`` ≥ 1/M — each one line saying what to change. Then:

* ``noise: distributed`` — :meth:`client_side`, in the process that trains the client (the
  runtime, right after T): the change from the broadcast is clipped and noised before the upload
  is serialised, so nothing unprotected leaves the site;
* ``noise: central`` — :meth:`server_side`, in the round loop after the uploads were validated:
  the server clips each upload and adds one noise draw to their sum
  (:func:`~fedgalore.privacy.client_dp.shared_noise`).

Under client-level DP the round's weights are uniform (``1/k``): weights proportional to the
sites' sizes would make the sum's sensitivity depend on them. :meth:`round_multiplier` is the
noise multiplier the round's release carries, for the accountant (fedgalore.engine.privacy_ledger).
"""
from __future__ import annotations

import math
import secrets
from typing import Any, Sequence

import numpy as np
import torch

from fedgalore.engine.config import ConfigError, FederatedConfig
from fedgalore.federated.seeding import DP_CLIENT_NOISE, client_seed
from fedgalore.privacy.client_dp import (DataDrivenBasis, add_noise, calibrate_client_noise, clip_upload,
                                         combined_multiplier, is_moment, shared_noise)
from fedgalore.privacy.config import ClientPrivacy
from fedgalore.protocol.payload import Payload

__all__ = ["ClientRelease", "KEPT_META"]

#: numeric upload meta that is released under client-level DP: counts fixed by the config and the job
KEPT_META = ("num_examples", "client", "round", "steps", "held_version", "version", "dp_clip_bit")
#: the server's own noise stream (central noise): client_seed's client id 2³¹ + attempt (no client has it)
_SERVER = 2 ** 31


def _generator(seq: np.random.SeedSequence, secure: bool) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63) if secure else int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
    return g


class ClientRelease:
    """Clipping and noise of client-level DP for one run (module doc). Build with :meth:`build`."""

    def __init__(self, cfg: FederatedConfig, client: ClientPrivacy, method: Any, num_clients: int) -> None:
        self.cfg, self.client, self.method = cfg, client, method
        self.num_clients = int(num_clients)
        fed = cfg.federation
        #: K: clients sampled per round
        self.sample = int(fed.clients_per_round or num_clients)
        #: whether the uploads release second moments (FedGaLore's synchronised variants but sync: aggregate)
        self.moments = bool(getattr(method, "uploads_moments", getattr(method, "synced", False))) and client.moments == "noised"
        #: whether the method synchronises second moments without uploading any (FedGaLore's sync:
        #: aggregate): its state is post-processing of the noised sum
        self.moments_from_aggregate = bool(getattr(method, "synced", False)) and not getattr(method, "uploads_moments", True)
        self.mean = getattr(method, "dp_aggregate", "individual") == "mean"
        self.sigma = self._sigma()
        #: σ_m of the moment release (None: none)
        self.sigma_m = (client.moment_noise_multiplier or self.sigma) if self.moments else None
        a = client.adaptive_clipping
        #: σ_b of the clip bits' sum (adaptive clipping; None: fixed clip)
        self.sigma_b = (a.count_noise_multiplier or max(self.sample / 20.0, self.sigma)) if a is not None else None
        #: σ_Δ: the update's own noise multiplier — σ, less the share the bits take (Andrew et al. 2021,
        #: Thm. 1: releasing the update with σ_Δ and the bits with σ_b is one Gaussian of σ when
        #: σ_Δ = (σ⁻² − (2σ_b)⁻²)^(-1/2); the bit's sensitivity is 1, the update's 2C, under replace-one)
        self.sigma_update = self.sigma
        if self.sigma_b is not None and self.sigma > 0:
            if 2 * self.sigma_b <= self.sigma:
                raise ConfigError(f"privacy.client.adaptive_clipping.count_noise_multiplier={self.sigma_b:g} must exceed "
                                  f"σ/2 = {self.sigma / 2:.4g} (σ calibrated to target_epsilon); raise it or leave it null")
            self.sigma_update = (self.sigma ** -2 - (2 * self.sigma_b) ** -2) ** -0.5

    @classmethod
    def build(cls, cfg: FederatedConfig, method: Any, num_clients: int) -> "ClientRelease | None":
        """The run's client-level DP, or None without ``privacy.client``; a setting under which
        the guarantee would not hold is a :class:`ConfigError`."""
        client = cfg.privacy.client
        if client is None:
            return None
        try:
            import dp_accounting  # noqa: F401
        except ImportError:
            raise ConfigError("privacy.client needs dp-accounting; install it with pip install 'fedgalore[privacy]'") from None
        why = method.client_dp_problem(client.moments)
        if why is not None:
            raise ConfigError(why)
        if cfg.train.scaffold:
            raise ConfigError("privacy.client with train.scaffold: SCAFFOLD's control variates are a second, unclipped "
                              "release of each client's update; turn train.scaffold off")
        if cfg.federation.clip_update_norm is not None:
            raise ConfigError("privacy.client clips every upload to privacy.client.clip; drop federation.clip_update_norm "
                              "(two clippings of the same upload)")
        if client.delta >= 1.0 / max(int(num_clients), 1):
            raise ConfigError(f"privacy.client.delta={client.delta:g} must be below 1/M = {1.0 / num_clients:.3g} for "
                              f"M = {num_clients} sites; set privacy.client.delta below that (e.g. 1e-5)")
        return cls(cfg, client, method, num_clients)

    # ------------------------------------------------------------------ σ
    def _sigma(self) -> float:
        """σ: ``noise_multiplier``, or calibrated to spend ``target_epsilon`` over the run's rounds
        with the moment release (σ_m = σ, or the fixed ``moment_noise_multiplier``) composed."""
        c = self.client
        if c.noise_multiplier is not None:
            return float(c.noise_multiplier)
        rounds = int(self.cfg.federation.rounds)
        try:
            if self.moments and c.moment_noise_multiplier is not None:
                return _calibrate_with_fixed_moment(float(c.target_epsilon), c.delta, self.num_clients, self.sample,
                                                    rounds, float(c.moment_noise_multiplier))
            return calibrate_client_noise(float(c.target_epsilon), float(c.delta), self.num_clients, self.sample, rounds,
                                          1.0 if self.moments else None)
        except ValueError as exc:
            raise ConfigError(f"privacy.client.target_epsilon: {exc}; raise target_epsilon or lower federation.rounds") from None

    def round_multiplier(self, received: int) -> float:
        """The noise multiplier of one round's release (both releases combined): σ on the sum for
        central noise and for individual uploads, σ·√(k/K) when only k of the K clients that each
        added σ/√K answered (distributed noise on a mean method)."""
        s = self.sigma
        if self.client.noise == "distributed" and self.mean:
            s = s * math.sqrt(max(int(received), 0) / self.sample) if received < self.sample else s
        parts = [s] + ([self.sigma_m] if self.sigma_m is not None else [])
        return combined_multiplier(parts)

    # ------------------------------------------------------------------ the mechanism
    def _clip(self, upload: Payload, broadcast: Payload | None, clip: float):
        c = self.client
        try:
            return clip_upload(upload, lambda key: self.method.release_reference(broadcast, key, upload), clip,
                               c.moment_clip, withhold_moments=not self.moments)
        except DataDrivenBasis as exc:
            raise ConfigError(f"privacy.client: the upload carries a data-driven basis ({exc}); client-level DP needs "
                              "public bases") from None

    def _redact(self, upload: Payload) -> Payload:
        """The upload's meta without what the client computed from its data (training losses, the
        optimizer's diagnostics: not protected by client-level DP), unless ``release_metrics``;
        the counts (:data:`KEPT_META`) and DP-SGD's own record (``dp_*``: σ, q, steps — fixed by the
        config, what the per-site accountant needs) stay; any other field, numeric or not, is withheld."""
        if self.client.release_metrics:
            return upload
        return Payload(upload.entries, {k: v for k, v in upload.meta.items() if k in KEPT_META or k.startswith("dp_")})

    def client_side(self, upload: Payload, broadcast: Payload | None, round_idx: int, client: int) -> Payload:
        """``noise: distributed``: the upload as the client releases it — its change clipped to the
        round's C (the broadcast's ``dp_clip``), its own share of the noise added (N(0, σ_Δ²C²/K) on
        a mean method, N(0, σ_Δ²C²) otherwise; the moments N(0, σ_m²C_m²)), with adaptive clipping
        its bit ``1[‖Δ‖ ≤ C]`` noised likewise (``dp_clip_bit``), the raw training losses and
        diagnostics withheld. ``central``: only the withholding (the server clips and noises)."""
        upload = self._redact(upload)
        if self.client.noise != "distributed":
            return upload
        clip = float(broadcast.meta.get("dp_clip", self.client.clip)) if broadcast is not None else self.client.clip
        refs, changes, stats = self._clip(upload, broadcast, clip)
        g = _generator(client_seed(self.cfg.seed, round_idx, client, DP_CLIENT_NOISE), self.client.secure_mode)
        share = math.sqrt(self.sample) if self.mean else 1.0
        std_u = self.sigma_update * clip / share
        std_m = (self.sigma_m or 0.0) * self.client.moment_clip

        def noise(slot, shape):
            std = std_m if is_moment(slot[0]) else std_u
            return torch.randn(shape, generator=g, dtype=torch.float32) * std if std > 0 else None

        out = add_noise(upload, refs, changes, noise)
        if self.sigma_b is not None:
            bit = float(stats.get("update_norm", 0.0) <= clip)
            out.meta["dp_clip_bit"] = bit + float(torch.randn((), generator=g)) * self.sigma_b / share
        return out

    def server_side(self, uploads: Sequence[Payload], broadcast: Payload | None, round_idx: int,
                    attempt: int = 0, clip: float | None = None) -> list[Payload]:
        """``noise: central``: the uploads A aggregates — each clipped to ``clip`` (the round's C),
        one N(0, σ_Δ²C²) draw on the sum split over them (a mean method) or N(0, σ_Δ²C²) each
        (individual); the moments N(0, σ_m²C_m²) each; with adaptive clipping each upload's bit
        ``1[‖Δ‖ ≤ C]`` plus its share z_b/k of one N(0, σ_b²) draw (``dp_clip_bit``: their sum is
        the noised count). ``distributed``: unchanged (the clients did it)."""
        if self.client.noise != "central" or not uploads:
            return list(uploads)
        c = self.client
        clip = float(c.clip if clip is None else clip)
        clipped = [self._clip(u, broadcast, clip) for u in uploads]
        g = _generator(client_seed(self.cfg.seed, round_idx, _SERVER + int(attempt), DP_CLIENT_NOISE), c.secure_mode)
        std_u, std_m = self.sigma_update * clip, (self.sigma_m or 0.0) * c.moment_clip
        shared = (shared_noise([ch for _, ch, _ in clipped], std_u, g, lambda s: not is_moment(s[0]))
                  if self.mean and std_u > 0 else [{} for _ in clipped])
        out = []
        for u, (refs, changes, _), mine in zip(uploads, clipped, shared):
            def noise(slot, shape, mine=mine):
                if is_moment(slot[0]):
                    return torch.randn(shape, generator=g, dtype=torch.float32) * std_m if std_m > 0 else None
                if self.mean:
                    return mine.get(slot)
                return torch.randn(shape, generator=g, dtype=torch.float32) * std_u if std_u > 0 else None
            out.append(add_noise(u, refs, changes, noise))
        if self.sigma_b is not None:
            z_b = float(torch.randn((), generator=g)) * self.sigma_b
            for o, (_, _, stats) in zip(out, clipped):
                o.meta["dp_clip_bit"] = float(stats.get("update_norm", 0.0) <= clip) + z_b / len(out)
        return out

    def next_clip(self, clip: float, bits: Sequence[float]) -> float:
        """Andrew et al.'s geometric update: ``C·exp(−lr·(b̃ − γ))`` with b̃ the noised share of
        clients within C (the sum of the uploads' noised bits over their number); ``clip`` itself
        without adaptive clipping or bits."""
        a = self.client.adaptive_clipping
        if a is None or not bits:
            return float(clip)
        share = sum(bits) / len(bits)
        return float(clip) * math.exp(-a.lr * (share - a.target_quantile))

    def uniform(self, k: int) -> list[float]:
        """The round's weights under client-level DP: ``1/k`` each."""
        return [1.0 / k] * k


def _calibrate_with_fixed_moment(target: float, delta: float, population: int, sample: int, rounds: int,
                                 sigma_m: float) -> float:
    """σ of the update when σ_m is fixed: the combined multiplier must be the one that spends
    ``target``; a σ_m too small for the target alone is a ``ValueError``."""
    eff = calibrate_client_noise(float(target), float(delta), population, sample, int(rounds), None)
    if sigma_m <= eff:
        raise ValueError(f"moment_noise_multiplier={sigma_m:g} alone spends more than ε={target:g} (it needs > {eff:.3g})")
    return (eff ** -2 - sigma_m ** -2) ** -0.5
