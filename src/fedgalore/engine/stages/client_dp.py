"""Client-level DP in a run (``privacy.client``) as a round stage: where the clipping and the noise
happen, and what one round costs (docs/privacy.md "Client-level DP"; the mechanism: fedgalore.privacy.client_dp).

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
noise multiplier the round's release carries, for the accountant (fedgalore.engine.stages.privacy_ledger).

Nothing raw reaches the server's view (its declaration, :mod:`fedgalore.privacy.view`, and
:meth:`ClientRelease.build`'s refusals): every value a client sends is inside the clip and the noise, or a public constant of
the job (its id, the round, the downlink version); per-client counts (``num_examples``,
``steps``) and training statistics are withheld, a rule that reads a raw upload
(``federation.max_update_norm``, ``clip_update_norm``, ``robust``) and a GaLore weight-decay term
(``decay·W0``, outside the clip) are refused. Every draw comes from OS entropy unless
``privacy.reproducible`` (fedgalore.privacy.randomness).

Distributed noise without secure aggregation: the server sees each upload with σ/√K (a mean
method), not only their sum — :attr:`ClientRelease.server_sees_uploads`; the accountant's
headline ε is then what one upload costs as the server sees it (:meth:`upload_multiplier`, no
amplification: the server knows whom it sampled) and ``target_epsilon`` calibrates σ to it.

:class:`ClientDP` is the stage: uniform weights, the round's clip C stamped on the broadcast
(:data:`ROUND_CLIP`; adaptive clipping moves it, the accountant keeps it in the state:
:meth:`ClientRelease.clip_now`), the client's release (:meth:`ClientRelease.client_side`) and the
server's central noise (:meth:`ClientRelease.server_side`). ``privacy.client.clip`` is read in
:meth:`ClientRelease.clip_now` alone and reaches the clipping in two hops: the broadcast's
:data:`ROUND_CLIP`, then :func:`round_clip` on the client.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from fedgalore.engine.stages.base import Attempt, RoundStage, RunView
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.federated.client import optimizer_steps
from fedgalore.federated.seeding import DP_CLIENT_NOISE, client_seed
from fedgalore.privacy.client_dp import (DataDrivenBasis, add_noise, calibrate_client_noise, clip_upload,
                                         client_epsilon, combined_multiplier, is_moment, shared_noise)
from fedgalore.privacy.accounting import solve_noise
from fedgalore.privacy.config import ClientPrivacy, noise_problem
from fedgalore.privacy.randomness import dp_generator, gaussian
from fedgalore.privacy.signal import NoiseVsSignal, noise_vs_signal
from fedgalore.protocol.payload import Payload

__all__ = ["ClientRelease", "ClientDP", "ROUND_CLIP", "CLIENT_BOOK", "client_book", "round_clip"]

#: the broadcast's meta field with the round's clip norm C
ROUND_CLIP = "dp_clip"
#: ServerState.meta's key of the client-level accountant (history, ε, the adaptive clip)
CLIENT_BOOK = "privacy_client"


def client_book(state: Any) -> dict[str, Any]:
    """The client-level accountant kept in ``state.meta`` (checkpointed with the state)."""
    return state.meta.setdefault(CLIENT_BOOK, {"history": [], "pending": [], "epsilon": 0.0})


def round_clip(broadcast: Payload) -> float:
    """The round's clip norm C as the client got it (the broadcast's :data:`ROUND_CLIP`)."""
    return float(broadcast.meta[ROUND_CLIP])

#: the server's own noise stream (central noise): client_seed's client id 2³¹ + attempt (no client has it)
_SERVER = 2 ** 31


class ClientRelease:
    """Clipping and noise of client-level DP for one run (module doc). Build with :meth:`build`."""

    def __init__(self, cfg: FederatedConfig, client: ClientPrivacy, method: Any, num_clients: int) -> None:
        self.cfg, self.client, self.method = cfg, client, method
        self.num_clients = int(num_clients)
        fed = cfg.federation
        #: K: clients sampled per round
        self.sample = int(fed.clients_per_round or num_clients)
        traits = method.run_traits  # (fedgalore.methods.traits.MethodTraits)
        #: whether the uploads release second moments (traits.moments uploaded: FedGaLore's synchronised
        #: variants but sync: aggregate)
        self.moments = traits.moments == "uploaded" and client.moments == "noised"
        #: whether the method synchronises second moments without uploading any (traits.moments
        #: from_aggregate: FedGaLore's sync: aggregate): its state is post-processing of the noised sum
        self.moments_from_aggregate = traits.moments == "from_aggregate"
        self.mean = traits.dp_aggregate == "mean"
        #: distributed noise without secure aggregation: the server sees every noised upload, not only their sum
        self.server_sees_uploads = client.noise == "distributed" and cfg.federation.secure_aggregation is None
        #: draws from OS entropy (Opacus' secure Gaussian sampling) unless privacy.reproducible
        self.reproducible = bool(cfg.privacy.reproducible)
        self.sigma = self._sigma()
        why = noise_problem("privacy.client.noise_multiplier (calibrated to target_epsilon)", self.sigma, client.clip,
                            "privacy.client.clip")
        if why is not None:  # (a given σ was checked with the config)
            raise ConfigError(why)
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
            import opacus  # noqa: F401  (secure Gaussian sampling, fedgalore.privacy.randomness)
        except ImportError as exc:
            raise ConfigError(f"privacy.client needs dp-accounting and Opacus ({exc.name} is missing); install them with "
                              "pip install 'fedgalore[privacy]'") from None
        why = method.client_dp_problem(client.moments)
        if why is not None:
            raise ConfigError(why)
        if cfg.train.scaffold:
            raise ConfigError("privacy.client with train.scaffold: SCAFFOLD's control variates are a second, unclipped "
                              "release of each client's update; turn train.scaffold off")
        if cfg.federation.clip_update_norm is not None:
            raise ConfigError("privacy.client clips every upload to privacy.client.clip; drop federation.clip_update_norm "
                              "(two clippings of the same upload)")
        if cfg.federation.max_update_norm is not None:
            raise ConfigError("privacy.client with federation.max_update_norm: the server would measure each raw upload's norm "
                              "(logged, and deciding which uploads count); privacy.client.clip already bounds every upload — "
                              "drop federation.max_update_norm")
        if cfg.train.weight_decay > 0 and method.traits.decay_in_upload:
            raise ConfigError(f"privacy.client with train.weight_decay={cfg.train.weight_decay:g}: method {method.name!r} "
                              "uploads its weight decay as a term decay·W0 outside the clipped change (and decay reveals the "
                              "site's step count); set train.weight_decay=0")
        if method.traits.upload_follows_steps and cfg.train.local_steps is None:
            raise ConfigError(f"privacy.client with method {method.name!r} and train.local_epochs: its upload's size and "
                              "counts follow each site's step count (one update term per projector refresh), which "
                              "reveals the site's size; set train.local_steps (a fixed number of local steps per round)")
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
            if self.server_sees_uploads:  # the headline is one upload as the server sees it (module doc)
                return self._calibrate_server_view(float(c.target_epsilon), rounds)
            if self.moments and c.moment_noise_multiplier is not None:
                return _calibrate_with_fixed_moment(float(c.target_epsilon), c.delta, self.num_clients, self.sample,
                                                    rounds, float(c.moment_noise_multiplier))
            return calibrate_client_noise(float(c.target_epsilon), float(c.delta), self.num_clients, self.sample, rounds,
                                          1.0 if self.moments else None)
        except ValueError as exc:
            raise ConfigError(f"privacy.client.target_epsilon: {exc}; raise target_epsilon or lower federation.rounds") from None

    def noise_vs_signal(self, dim: int) -> NoiseVsSignal:
        """The round's noise in the released mean against the clip, for ``dim`` coordinates per
        client (:func:`fedgalore.privacy.signal.noise_vs_signal`: the update's σ_Δ, C at its start,
        K sampled, the method's aggregate a mean or not)."""
        return noise_vs_signal(self.sigma_update, self.client.clip, dim, self.sample, self.mean)

    def _share(self) -> float:
        """The divisor of a client's own noise under distributed noise: √K on a mean method (the sum of
        K shares carries σ), 1 when every upload is used on its own."""
        return math.sqrt(self.sample) if self.mean else 1.0

    def _upload_multiplier(self, sigma: float, sigma_m: float | None) -> float:
        return combined_multiplier([sigma / self._share()] + ([sigma_m] if sigma_m is not None else []))

    def upload_multiplier(self) -> float:
        """The noise multiplier of one noised upload as the server sees it (distributed noise): σ/√K
        on the update (with its clip bit: Andrew et al.'s split keeps the pair at σ/√K) combined
        with the moments' σ_m; σ/1 for a method whose uploads are used one by one."""
        return self._upload_multiplier(self.sigma, self.sigma_m)

    def _calibrate_server_view(self, target: float, rounds: int) -> float:
        """σ whose uploads, one per round for ``rounds`` rounds, cost at most ``target`` as the server
        sees each (no subsampling: the server knows whom it sampled)."""
        c = self.client

        def eps(sigma: float) -> float:  # σ_m as the run sets it: the fixed moment_noise_multiplier, else σ
            sm = (c.moment_noise_multiplier or sigma) if self.moments else None
            return client_epsilon([(self._upload_multiplier(sigma, sm), 1, rounds)], 1, c.delta)

        sigma = solve_noise(eps, target, limit=1e6)
        if sigma is None:
            raise ValueError(f"no noise multiplier reaches ε={target:g} at δ={c.delta:g} over {rounds} uploads as the "
                             "server sees them (distributed noise without secure aggregation)")
        return sigma

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

    def client_side(self, upload: Payload, broadcast: Payload | None, round_idx: int, client: int) -> Payload:
        """``noise: distributed``: the upload as the client releases it — its change clipped to the
        round's C (the broadcast's :data:`ROUND_CLIP`), its own share of the noise added (N(0, σ_Δ²C²/K) on
        a mean method, N(0, σ_Δ²C²) otherwise; the moments N(0, σ_m²C_m²)), with adaptive clipping
        its bit ``1[‖Δ‖ ≤ C]`` noised likewise (``dp_clip_bit``). ``central``: unchanged (the server clips
        and noises). Which meta fields leave is the server view's (fedgalore.privacy.view), applied after this."""
        if self.client.noise != "distributed":
            return upload
        clip = round_clip(broadcast) if broadcast is not None else self.client.clip  # no broadcast: the mechanism alone
        refs, changes, stats = self._clip(upload, broadcast, clip)
        g = dp_generator(client_seed(self.cfg.seed, round_idx, client, DP_CLIENT_NOISE), self.reproducible)
        share = self._share()
        std_u = self.sigma_update * clip / share
        std_m = (self.sigma_m or 0.0) * self.client.moment_clip

        def noise(slot, shape):
            std = std_m if is_moment(slot[0]) else std_u
            return self._draw(shape, std, g) if std > 0 else None

        out = add_noise(upload, refs, changes, noise)
        if self.sigma_b is not None:
            bit = float(stats.get("update_norm", 0.0) <= clip)
            out.meta["dp_clip_bit"] = bit + float(self._draw((), self.sigma_b / share, g))
        return out

    def _draw(self, shape, std: float, g: torch.Generator) -> torch.Tensor:
        """N(0, std²) of ``shape``: Opacus' secure sampling unless ``privacy.reproducible`` (the studies'
        seeded stream, one ``torch.randn`` draw as before)."""
        return gaussian(shape, std, g, secure=not self.reproducible)

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
        g = dp_generator(client_seed(self.cfg.seed, round_idx, _SERVER + int(attempt), DP_CLIENT_NOISE), self.reproducible)
        std_u, std_m = self.sigma_update * clip, (self.sigma_m or 0.0) * c.moment_clip
        shared = (shared_noise([ch for _, ch, _ in clipped], std_u, lambda shape, std: self._draw(shape, std, g),
                               lambda s: not is_moment(s[0]))
                  if self.mean and std_u > 0 else [{} for _ in clipped])
        out = []
        for u, (refs, changes, _), mine in zip(uploads, clipped, shared):
            def noise(slot, shape, mine=mine):
                if is_moment(slot[0]):
                    return self._draw(shape, std_m, g) if std_m > 0 else None
                if self.mean:
                    return mine.get(slot)
                return self._draw(shape, std_u, g) if std_u > 0 else None
            out.append(add_noise(u, refs, changes, noise))
        if self.sigma_b is not None:
            z_b = float(self._draw((), self.sigma_b, g))
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

    def clip_now(self, state: Any) -> float:
        """The clip norm C of the next round: the adaptive clip the accountant keeps in ``state``,
        else ``privacy.client.clip`` (the one place the config's clip is read)."""
        return float(client_book(state).get("clip", self.client.clip))

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


class ClientDP(RoundStage):
    """``privacy.client`` as a stage (module doc): uniform weights, the round's C on the broadcast,
    clipping and noise at the client (distributed) or at the server (central), nothing raw about a
    client in the server's records."""

    name = "client_dp"
    hides_clients = True

    def __init__(self, release: ClientRelease) -> None:
        self.mechanism = release

    @classmethod
    def build(cls, cfg: FederatedConfig, runtime: Any, run: RunView | None) -> "ClientDP | None":
        release = ClientRelease.build(cfg, runtime.method, len(runtime.parts))
        return None if release is None else cls(release)

    def signal(self, runtime: Any) -> NoiseVsSignal:
        """The noise the released mean will carry against the signal it hides, on ``runtime``'s
        model: d from the method (:meth:`~fedgalore.methods.base.Method.released_coordinates`) for
        the client with the most optimizer steps a round."""
        k = max(int(runtime.cfg.train.grad_accum_steps), 1)
        steps = max((optimizer_steps(runtime.micro_batches(len(p)), k) for p in runtime.parts), default=1)
        return self.mechanism.noise_vs_signal(runtime.method.released_coordinates(runtime.model, steps))

    def client_release(self, upload: Payload, broadcast: Payload, ctx: Any) -> Payload:
        return self.mechanism.client_side(upload, broadcast, ctx.round, ctx.client)

    def plan(self, att: Attempt, state: Any) -> None:
        att.weights = self.mechanism.uniform(len(att.clients))  # the sum's sensitivity is C

    def broadcast(self, bcast: Payload, state: Any) -> Payload:
        return Payload(bcast.entries, {**bcast.meta, ROUND_CLIP: self.mechanism.clip_now(state)})

    def release(self, att: Attempt, state: Any) -> None:  # central noise: the server clips and noises
        noised = self.mechanism.server_side([k.upload for k in att.kept], att.reference, att.round, att.number,
                                          self.mechanism.clip_now(state))
        for item, up in zip(att.kept, noised):
            item.upload = up
