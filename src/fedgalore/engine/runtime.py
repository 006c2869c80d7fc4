"""What one process needs to run clients: :class:`Runtime` (paper Algorithm 1, operator T).

A :class:`Runtime` holds the task, the prepared model (built once), the method and the
partition, all built deterministically from the run's config. The server's loop owns one (the
sequential backend trains on it); a Ray actor or a Flower SuperNode builds its own from the same
resolved config — the method objects and payloads are the same in every process. A client's job
(:class:`ClientJob`) and result (:class:`ClientResult`) hold only integers and serialised
payloads (safetensors bytes): that is all that crosses a process boundary. Inside one process
(the sequential backend) the payloads are handed over as objects instead, each side working on
its own copy of the tensors (:func:`fedgalore.protocol.payload.transfer`: what decoding the
bytes would give), and the ledger counts the bytes the codec would write
(:func:`~fedgalore.protocol.payload.encoded_size`).
"""
from __future__ import annotations

import math
import time
import traceback
from typing import Callable, Sequence

import numpy as np
import torch

from fedgalore.job.clients import Clients, resolve_clients, site_ids, split_clients
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.job.resolve import method_options, resolve_method
from fedgalore.engine.jobs import ClientJob, ClientResult
from fedgalore.engine.site_policy import SimulatedSites, admit
from fedgalore.engine.stages import compose
from fedgalore.federated.client import ClientError
from fedgalore.engine.start_adapter import continues_adapter, merge_start_adapter, start_adapter_of
from fedgalore.federated.seeding import BATCHES, DROPOUT, client_seed
from fedgalore.federated.site_ranks import site_ranks
from fedgalore.methods.base import Method, build_method
from fedgalore.methods.lora_common import matrix_shape
from fedgalore.protocol.payload import Payload, decode, encode, transfer
from fedgalore.protocol.state import ClientContext
from fedgalore.protocol.train_config import TrainConfig
from fedgalore.privacy.view import ServerView, SiteRefusal, view_of
from fedgalore.tasks import Task, get_task, resolve_target_modules
from fedgalore.tasks.base import head_parameters, subset_examples

__all__ = ["Runtime", "ClientJob", "ClientResult"]


class Runtime:
    """Task + prepared model + method + partition, built deterministically from a config."""

    def __init__(self, cfg: FederatedConfig, parts: Sequence[np.ndarray] | None = None, task: Task | None = None, method: Method | None = None,
                 clients: Clients | None = None):
        self.task = task if task is not None else get_task(cfg.task.name, **cfg.task.options)
        #: the clients' training parts (and held-out parts, names), the validation pool (fedgalore.job.clients);
        #: ``clients`` given: a nodes deployment's server, whose parts are stand-ins of the nodes' sizes
        self.clients = clients if clients is not None else split_clients(cfg, self.task, parts)
        #: the config as recorded (config.yaml, the run's identity): as given, a natural partition's client count filled in
        self.recorded_cfg = resolve_clients(cfg, self.clients)
        #: the config as it runs (and as workers get it): sites that per-site settings name by name as their ids
        self.cfg = cfg = site_ids(self.recorded_cfg, self.clients)
        self.method = (resolve_method(method, cfg) if method is not None
                       else build_method(cfg.method.name, cfg.method.rank, method_options(cfg)))
        #: each site's rank (federation.site_ranks), given to the method before it prepares the model
        self.site_ranks = site_ranks(cfg.federation.site_ranks, len(self.clients.parts), cfg.method.rank)
        self.method.use_site_ranks(self.site_ranks)
        model = self.task.build_model()
        start = start_adapter_of(self.task)  # task.options.model a PEFT adapter (fedgalore.engine.start_adapter)
        if start is not None and not continues_adapter(self.method):
            merge_start_adapter(model, start)
        self.target_modules = resolve_target_modules(model, self.task.target_modules, exclude=self.task.head_modules)
        self.head_params = head_parameters(model, self.task.head_modules)
        self._check_rank(model)
        self.device = torch.device(cfg.device)
        #: per-client stores that last the run (a backend whose clients keep state sets a dict; None: stateless)
        self.client_state: dict[int, dict] | None = None
        self.model = self.method.setup(model.to(self.device), self.target_modules, self.head_params)
        if start is not None and continues_adapter(self.method):
            self.method.start_from(self.model, start.factors, start.scaling)  # type: ignore[attr-defined]
        self.train_data = self.task.train_set()
        #: training examples held out from every client for model selection (federation.validation_fraction)
        self.validation_idx = self.clients.validation_idx
        self.parts = self.clients.parts
        sizes = [len(p) for p in self.parts]
        tc: TrainConfig = cfg.train
        mean_steps = self._steps_for(int(round(sum(sizes) / len(sizes))), tc)
        self.steps_per_round = max(mean_steps, 1)
        #: the round's stages this process runs on its clients (record-level DP-SGD, SCAFFOLD, client-level
        #: DP's clipping and noise: fedgalore.engine.stages), composed from the config; the server's loop adds its own
        self.stages = compose(cfg, self)
        #: what may leave this process's sites (fedgalore.privacy.view): applied in :meth:`execute`, the one place
        #: every backend runs a client, right before the upload is serialised
        self.view: ServerView = view_of(cfg)
        #: the simulated sites' own policies and ledgers (fedgalore.engine.site_policy; None: none). A Flower
        #: node sets None and brings its own guard with each job (``execute(site=...)``)
        self.site_policies = SimulatedSites.build(cfg, [self.clients.name(i) for i in range(len(self.parts))])

    def _check_rank(self, model: torch.nn.Module) -> None:
        mods = dict(model.named_modules())
        smallest = min(min(matrix_shape(mods[m])) for m in self.target_modules)
        if self.cfg.method.rank > smallest:
            raise ConfigError(
                f"method.rank={self.cfg.method.rank} exceeds the smallest adapted matrix dimension ({smallest}); "
                f"use method.rank<={smallest}"
            )
        if self.site_ranks and max(self.site_ranks) > smallest:
            raise ConfigError(
                f"federation.site_ranks: rank {max(self.site_ranks)} exceeds the smallest adapted matrix dimension "
                f"({smallest}); use ranks <= {smallest}"
            )

    def validation_set(self):
        """The task's own validation split, else the held-out training examples (``None`` when
        ``federation.validation_fraction`` is 0)."""
        own = self.task.validation_set()
        if own is not None:
            return own
        if len(self.validation_idx) == 0:
            return None
        return subset_examples(self.train_data, self.validation_idx)

    @staticmethod
    def _steps_for(n: int, tc: TrainConfig) -> int:
        """Micro-batches of a client with ``n`` examples per round: ``T · k`` for ``T`` =
        ``train.local_steps`` optimizer steps of ``k = train.grad_accum_steps`` micro-batches
        each, else ``⌈E · n / batch_size⌉`` for ``E`` local epochs."""
        if tc.local_steps is not None:
            return int(tc.local_steps) * max(int(tc.grad_accum_steps), 1)
        return int(math.ceil(float(tc.local_epochs) * n / tc.batch_size)) if n > 0 else 0

    def micro_batches(self, n: int) -> int:
        """Micro-batches per round of a client with ``n`` examples (:meth:`_steps_for` under ``train``)."""
        return self._steps_for(n, self.cfg.train)

    def batches(self, client: int, round_idx: int) -> tuple[Callable, int]:
        """This round's local mini-batches: E epochs (or T steps) of fresh permutations, unless a
        stage draws them (record-level DP's Poisson-sampled steps)."""
        drawn = self.stages.client_batches(self, client, round_idx)
        if drawn is not None:
            return drawn
        tc = self.cfg.train
        idx = self.parts[client]
        steps = self._steps_for(len(idx), tc)
        rng = np.random.default_rng(client_seed(self.cfg.seed, round_idx, client, BATCHES))
        need = steps * tc.batch_size
        order = []
        while sum(len(o) for o in order) < need and len(idx) > 0:
            order.append(idx[rng.permutation(len(idx))])
        flat = np.concatenate(order)[:need] if order else np.array([], dtype=int)
        if tc.local_steps is None:  # E epochs: the last batch may be partial
            flat = flat[: int(round(float(tc.local_epochs) * len(idx)))] if len(idx) else flat
        chunks = [flat[i : i + tc.batch_size] for i in range(0, len(flat), tc.batch_size)]

        def gen():
            for c in chunks:
                yield self.batch_of(c.tolist())

        return gen, len(chunks)

    def batch_of(self, indices: list[int]) -> dict:
        """The batch of these training examples."""
        if hasattr(self.train_data, "batch"):
            return self.train_data.batch(indices)
        return self.task.collate([self.train_data[int(i)] for i in indices])

    def _result(self, client: int, blob, error: str | None, t0: float, stats: dict | None = None) -> ClientResult:
        """The client's result as it leaves the site: its error text and time as the view declares
        (:meth:`~fedgalore.privacy.view.ServerView.client_error`, :meth:`~fedgalore.privacy.view.ServerView.client_seconds`)."""
        return ClientResult(client, blob, self.view.client_error(error), self.view.client_seconds(time.perf_counter() - t0),
                            stats or {}, origin="client")

    def site_guard(self, client: int):
        """Client ``client``'s own policy and ledger in a simulation (fedgalore.privacy.site.SiteGuard; None: none)."""
        return self.site_policies.guard(client) if self.site_policies is not None else None

    def execute(self, job: ClientJob, broadcast: bytes | Payload, on_step=None, client_state: dict | None = None,
                site=None) -> ClientResult:
        """Run operator T for one client on a serialised broadcast; never raises. ``client_state``:
        the client's own store when the caller keeps it (a Flower node's ``Context.state``),
        else this runtime's ``client_state`` entry for the client (None: stateless). ``site``: the
        site's own guard (a Flower node's), else :meth:`site_guard`'s.

        A :class:`Payload` broadcast (the caller runs in this process) is used through
        :func:`~fedgalore.protocol.payload.transfer` — exactly what decoding its bytes gives — and
        the upload comes back transferred too, instead of serialised."""
        t0 = time.perf_counter()
        ctx = None
        try:
            gen, steps = self.batches(job.client, job.round)
            ctx = ClientContext(
                round=job.round,
                total_rounds=job.total_rounds,
                client=job.client,
                round_seed=job.round_seed,
                num_examples=int(len(self.parts[job.client])),
                train=self.cfg.train,
                target_modules=self.target_modules,
                head_params=self.head_params,
                loss_fn=self.task.loss,
                batches=gen,
                steps=steps,
                steps_per_round=self.steps_per_round,
                on_step=on_step,
                device=self.device,
                diagnostics=bool(self.cfg.diagnostics),
                state=client_state if client_state is not None
                else None if self.client_state is None else self.client_state.setdefault(job.client, {}),
            )
            self.stages.client_start(ctx)  # e.g. DP-SGD attached to local training (privacy.record)
            seed = int(client_seed(self.cfg.seed, job.round, job.client, DROPOUT).generate_state(1)[0])
            devices = [self.device.index or 0] if self.device.type == "cuda" else []
            # Dropout draws from the global RNG. Fork it (restored on exit, so callers see no
            # side effect) and start it from a per-(round, client) state, so a client's training
            # is bit-identical whatever backend, order or resume point runs it.
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(torch.Generator().manual_seed(seed).get_state())
                if devices:  # a CUDA generator's state is (seed, offset), not a CPU generator's: seed it
                    with torch.cuda.device(devices[0]):
                        torch.cuda.manual_seed(seed)
                payload = transfer(broadcast) if isinstance(broadcast, Payload) else decode(broadcast)
                payload = self.stages.client_receive(payload, ctx)  # a stage's own entries out (SCAFFOLD's c − c_i)
                # the site's own policy and budget before it trains: a refusal is this client's one-line error
                turn = admit(self, job, payload, site if site is not None else self.site_guard(job.client))
                upload = self.method.client_update(self.model, payload, ctx)  # T
                upload = self.stages.client_release(upload, payload, ctx)  # as it leaves the site (DP, SCAFFOLD's c_i⁺)
                if turn is not None:  # in the site's ledger, fsynced, before the upload leaves
                    turn.record(upload)
            upload = self.view.release(upload)  # the declared fields only (fedgalore.privacy.view)
            blob = transfer(upload) if isinstance(broadcast, Payload) else encode(upload)
            return self._result(job.client, blob, None, t0, dict(upload.meta))
        except SiteRefusal as exc:  # the site declines on its own policy: its line quotes no data
            return ClientResult(job.client, None, str(exc).splitlines()[0], 0.0, {}, origin="site")
        except ClientError as exc:
            return self._result(job.client, None, str(exc), t0)
        except Exception as exc:  # a failing client must not take the federation down
            return self._result(job.client, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", t0)
        finally:
            if ctx is not None:
                self.stages.client_close(ctx)  # e.g. Opacus' hooks off the shared model, also after an error
