"""Record-level DP (``privacy.record``) as a round stage: each site's DP-SGD (Abadi et al. 2016;
Opacus) from the config.

:class:`SitePrivacy` is the side of every process that trains clients (:class:`~fedgalore.engine.
runtime.Runtime`): it checks up front what would make the guarantee false or the run fail —
``delta`` ≥ 1/n for a site, a model Opacus cannot make private, a loss that is not a mean over
examples — and gives each client-round its Poisson batches and its :class:`~fedgalore.privacy.
dpsgd.DPSGD` (σ per site: ``noise_multiplier``, or calibrated to ``target_epsilon``,
:func:`~fedgalore.privacy.accounting.site_schedule`). The server's per-site accountant is
:class:`~fedgalore.engine.stages.privacy_ledger.PrivacyLedger`.

:class:`RecordDP` is the stage: on the client it swaps the round's batches for Poisson-sampled
ones, attaches DP-SGD to local training (``ClientContext.privacy``); which upload fields leave (the raw
training losses only with ``privacy.record.release_metrics``) is the server view's (fedgalore.privacy.view).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from fedgalore.engine.stages.base import RoundStage
from fedgalore.federated.client import optimizer_steps
from fedgalore.federated.seeding import BATCHES, DP_NOISE, client_seed
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.privacy.accounting import SiteSchedule, site_schedule, target_problem
from fedgalore.privacy.config import RecordPrivacy
from fedgalore.privacy.randomness import dp_seed

__all__ = ["SitePrivacy", "RecordDP"]



class SitePrivacy:
    """DP-SGD for the clients a runtime trains (module doc). Build with :meth:`build`."""

    def __init__(self, cfg: FederatedConfig, record: RecordPrivacy, sizes: Sequence[int], steps: Sequence[int],
                 support: dict[str, list[str]]) -> None:
        self.cfg, self.record = cfg, record
        self.sizes = [int(n) for n in sizes]
        #: optimizer steps per round of each site
        self.steps = [int(t) for t in steps]
        #: which layers get Opacus' per-example rules and which torch.func (fedgalore.privacy.dpsgd.per_sample_support)
        self.support = support
        self._schedules: dict[int, SiteSchedule] = {}

    @classmethod
    def build(cls, cfg: FederatedConfig, task: Any, model: Any, sizes: Sequence[int],
              micro_batches: Callable[[int], int]) -> "SitePrivacy | None":
        """The runtime's DP-SGD, or None without ``privacy.record``. ``sizes``: each site's
        examples; ``micro_batches(n)``: a site's micro-batches per round. A setting under which
        the guarantee would not hold is a :class:`ConfigError` (one line saying what to change)."""
        record = cfg.privacy.record
        if record is None:
            return None
        try:
            from fedgalore.privacy.dpsgd import per_sample_support, wrap_problem
        except ImportError as exc:
            raise ConfigError(f"privacy.record needs Opacus and dp-accounting ({exc.name} is missing); install them with "
                              "pip install 'fedgalore[privacy]'") from None
        if getattr(task, "loss_items", None) is not None:
            raise ConfigError(f"privacy.record: task {task.name!r} averages its loss over tokens, so one example's gradient "
                              "depends on the others' lengths and the clipping bound would not hold; record-level DP needs "
                              "a per-example mean loss (text/image classification tasks)")
        why = wrap_problem(model)
        if why is not None:
            raise ConfigError(f"privacy.record: Opacus cannot compute private per-example gradients for method "
                              f"{cfg.method.name!r} on this model: {why}; freeze that layer or use another model")
        live = [(n, i) for i, n in enumerate(sizes) if n > 0]
        if live:
            n, i = min(live)
            if record.delta >= 1.0 / n:
                raise ConfigError(f"privacy.record.delta={record.delta:g} must be below 1/n = {1.0 / n:.3g} for the smallest "
                                  f"site ({n} examples, client {i}); set privacy.record.delta below that (e.g. 1e-5)")
        k = max(int(cfg.train.grad_accum_steps), 1)
        steps = [optimizer_steps(micro_batches(int(n)), k) for n in sizes]
        fed = cfg.federation
        participation = (fed.clients_per_round or len(sizes)) / max(len(sizes), 1)
        for n, t in sorted(set(zip(sizes, steps))):  # a target no σ meets: refused before anything trains
            why = target_problem(record, n, cfg.train.batch_size, k, t, fed.rounds, participation)
            if why is not None:
                raise ConfigError(why)
        return cls(cfg, record, sizes, steps, per_sample_support(model))

    # ------------------------------------------------------------------ per site
    def schedule(self, client: int) -> SiteSchedule:
        """Site ``client``'s q, steps and σ (calibrated once per process for ``target_epsilon``)."""
        if client not in self._schedules:
            fed, tc = self.cfg.federation, self.cfg.train
            m = len(self.sizes)
            participation = (fed.clients_per_round or m) / m
            self._schedules[client] = site_schedule(self.record, self.sizes[client], tc.batch_size, tc.grad_accum_steps,
                                                    self.steps[client], fed.rounds, participation)
        return self._schedules[client]

    def batches(self, part: np.ndarray, client: int, round_idx: int, make: Callable[[list[int]], dict]) -> tuple[Callable, int]:
        """This round's Poisson batches of a site whose examples are ``part`` (``T × k``
        micro-batches, possibly empty: ``{}``); ``make(indices)`` builds a batch."""
        sch = self.schedule(client)
        # the Poisson draws: OS entropy unless privacy.reproducible (fedgalore.privacy.randomness)
        seed = dp_seed(client_seed(self.cfg.seed, round_idx, client, BATCHES), self.cfg.privacy.reproducible)
        chunks = [part[c] for c in _poisson(len(part), sch.sample_rate, sch.steps_per_round,
                                            max(int(self.cfg.train.grad_accum_steps), 1), seed)]

        def gen():
            for c in chunks:
                yield make(c.tolist()) if len(c) else {}

        return gen, len(chunks)

    def client(self, client: int, round_idx: int) -> Any:
        """The :class:`~fedgalore.privacy.dpsgd.DPSGD` of one client-round."""
        from fedgalore.privacy.dpsgd import DPSGD

        sch = self.schedule(client)
        return DPSGD(noise_multiplier=sch.noise_multiplier, max_grad_norm=self.record.max_grad_norm,
                     sample_rate=sch.sample_rate, num_examples=sch.num_examples,
                     noise_seed=dp_seed(client_seed(self.cfg.seed, round_idx, client, DP_NOISE), self.cfg.privacy.reproducible),
                     secure_mode=not self.cfg.privacy.reproducible)



def _poisson(n: int, rate: float, steps: int, k: int, seed: int) -> list[np.ndarray]:
    from fedgalore.privacy.dpsgd import poisson_steps

    return poisson_steps(n, rate, steps, k, seed)


class RecordDP(RoundStage):
    """``privacy.record`` on the client (module doc): Poisson batches, DP-SGD in local training,
    the raw losses withheld."""

    name = "record_dp"

    def __init__(self, sites: SitePrivacy) -> None:
        #: the per-site DP-SGD schedules (the accountant reads them for the per-site cap)
        self.sites = sites

    @classmethod
    def build(cls, cfg: FederatedConfig, runtime: Any, run: Any) -> "RecordDP | None":
        sizes = [len(p) for p in runtime.parts]
        sites = SitePrivacy.build(cfg, runtime.task, runtime.model, sizes, runtime.micro_batches)
        return None if sites is None else cls(sites)

    def client_batches(self, runtime: Any, client: int, round_idx: int) -> tuple[Callable, int]:
        return self.sites.batches(runtime.parts[client], client, round_idx, runtime.batch_of)

    def client_start(self, ctx: Any) -> None:
        ctx.privacy = self.sites.client(ctx.client, ctx.round)  # DP-SGD in local_train (fedgalore.privacy.dpsgd)

    def client_close(self, ctx: Any) -> None:
        if ctx.privacy is not None:  # Opacus' hooks off the shared model, also after an error
            ctx.privacy.detach()
