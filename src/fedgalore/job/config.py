"""Typed run configuration (``FederatedConfig``) with strict validation.

Library code takes these dataclasses; only :func:`load_config` (used by the CLI) parses YAML and
``key=value`` overrides (OmegaConf). Every user-facing value is checked up front — the method's
options too, against its options dataclass (:mod:`fedgalore.methods.base`) — and a bad one
raises :class:`ConfigError` with one line saying what is wrong and how to fix it.

YAML layout (``conf/pipeline/*.yaml``)::

    name: offline_text
    seed: 0
    task:       {name: offline_text, options: {max_length: 128}}
    method:     {name: fedgalore, rank: 8, options: {update_proj_gap: 200, sync: ajive}}
    federation: {num_clients: 20, clients_per_round: 5, rounds: 20, eval_every: 1,
                 partition: {kind: dirichlet, alpha: 0.5, min_size: 10},
                 server_optimizer: {name: fedavg}}        # fedavgm | fedadam | ... (docs/remedies.md)
    train:      {lr: 5.0e-5, batch_size: 32, local_epochs: 2, warmup_ratio: 0.06, ...}
    backend:    {name: sequential, options: {}}
    output:     {dir: runs, checkpoint_every: 1, keep_checkpoints: 2}
    privacy:    {record: {max_grad_norm: 1.0, noise_multiplier: 1.0, delta: 1.0e-5}}   # DP-SGD (docs/privacy.md)
    device: cpu
    diagnostics: true
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from fedgalore.federated.guards import AttackConfig, RobustConfig, SecureAggregationConfig
from fedgalore.federated.partition import PartitionConfig
from fedgalore.federated.partitioners import infers_clients
from fedgalore.federated.server_opt import ServerOptimizerConfig
from fedgalore.federated.site_ranks import SiteRanksConfig, site_ranks
from fedgalore.federated.sites import is_site_name
from fedgalore.methods.base import MethodOptions, available_methods, method_class, parse_options, split_options
from fedgalore.privacy.config import PrivacyConfig, RecordPrivacy
from fedgalore.federated.data_parallel import devices_problem
from fedgalore.federated.sharded_site import shard_problem
from fedgalore.protocol.train_config import TrainConfig
from fedgalore.typed import ConfigError, from_plain, to_plain

__all__ = [
    "ConfigError",
    "TaskConfig",
    "MethodConfig",
    "FederationConfig",
    "BackendConfig",
    "OutputConfig",
    "ExportConfig",
    "PrivacyConfig",
    "RecordPrivacy",
    "FederatedConfig",
    "load_config",
    "config_difference",
]


@dataclass
class TaskConfig:
    name: str = "offline_text"
    options: dict[str, Any] = field(default_factory=dict)
    #: "module:Class" of a task object passed to ``fedgalore.run(cfg, task=...)`` in code, as a run's
    #: config.yaml records it (None: the registered task ``name``); such a config needs that object again
    object: str | None = None


@dataclass
class MethodConfig:
    name: str = "fedgalore"
    rank: int = 8
    #: a pool: this method's options and possibly other methods' (docs/cli.md, "Method options")
    options: dict[str, Any] = field(default_factory=dict)

    def own_options(self) -> dict[str, Any]:
        """The options of the pool that this method takes (:func:`~fedgalore.methods.base.split_options`)."""
        return split_options(self.name, self.options)[0]

    def typed_options(self) -> MethodOptions:
        """This method's options dataclass, as the method runs them (:func:`~fedgalore.methods.base.parse_options`)."""
        return parse_options(self.name, self.own_options(), self.rank)


@dataclass
class FederationConfig:
    num_clients: int | None = 20  # M (null with partition.kind=natural: one client per value, inferred)
    clients_per_round: int | None = 5  # K (None: full participation)
    rounds: int = 20  # R
    eval_every: int = 1
    eval_last: int = 0  # also evaluate after every one of the last this many rounds (0: only eval_every and the last)
    eval_batch_size: int = 64
    min_clients: int = 1  # fewer valid uploads than this → the round is retried with a new sample
    max_round_retries: int = 2
    max_update_norm: float | None = None  # reject uploads whose ‖ΔW‖_F exceeds this
    clip_update_norm: float | None = None  # scale uploads down to this ‖ΔW‖_F (dense/GaLore methods)
    client_timeout_s: float | None = None  # uploads that took longer are dropped (Ray: backend.options.timeout_s preempts)
    validation_fraction: float = 0.0  # share of the training pool held out (stratified) for model selection
    partition: PartitionConfig = field(default_factory=lambda: PartitionConfig(kind="dirichlet", alpha=0.5))
    #: evaluate the global model on each client's held-out share every evaluation round (fedgalore.engine.client_eval)
    client_eval: bool = False
    #: with client_eval: share of each client's data held out from its training (stratified by category)
    client_test_fraction: float = 0.2
    #: with client_eval: evaluate on the clients' held-out shares every this many rounds (and after the
    #: last); null: with every evaluation of the global model (eval_every, eval_last)
    client_eval_every: int | None = None
    #: what the server does with the aggregate (fedgalore.federated.server_opt; default fedavg: keep it)
    server_optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    #: Flower SecAgg+: the server sees only the weighted sum of the uploads (fedgalore.federated.guards;
    #: Flower deployments; null: off)
    secure_aggregation: SecureAggregationConfig | None = None
    #: robust aggregation against a hostile site: trimmed_mean | median | krum | norm_filter (null: off)
    robust: RobustConfig | None = None
    #: simulations only: hostile clients whose uploads are scaled or sign-flipped (to measure federation.robust)
    attack: AttackConfig | None = None
    #: a rank per site: tiers of sites and/or single sites' ranks (fedgalore.federated.site_ranks;
    #: null: every site at method.rank)
    site_ranks: SiteRanksConfig | None = None


@dataclass
class BackendConfig:
    name: str = "sequential"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OutputConfig:
    dir: str = "runs"
    run_name: str | None = None  # default: "<name>-<method>-<setting>-s<seed>"
    #: rounds between checkpoints (and after the last), or "auto": checkpoint after a round while
    #: the loop's time in checkpoints stays within ``checkpoint_budget`` of the run's wall time
    checkpoint_every: int | Literal["auto"] = 1
    checkpoint_budget: float = 0.02
    keep_checkpoints: int = 2
    progress: str = "auto"  # "auto" | "rich" | "plain" | "quiet"


@dataclass
class ExportConfig:
    """What a run keeps for export besides its checkpoints (docs/export.md)."""

    #: keep the global model's LoRA adapter of every round under ``<run dir>/adapters/round-NNNN/`` (a
    #: PEFT adapter folder; the methods whose global model is the base plus adapters: FedIT, FFA-LoRA, LoRA-FAIR)
    every_round: bool = False


@dataclass
class FederatedConfig:
    name: str = "offline_text"
    seed: int = 0
    task: TaskConfig = field(default_factory=TaskConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    #: differential privacy (fedgalore.privacy; docs/privacy.md): privacy.record = DP-SGD at each site
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    device: str = "cpu"
    diagnostics: bool = True
    #: true: the tail energy of every matrix by a full SVD (slow on large models); false: exact for small matrices,
    #: a randomized top-r estimate for large ones (fedgalore.federated.diagnostics; errs upwards)
    diagnostics_exact: bool = False

    # ------------------------------------------------------------------ conversion
    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FederatedConfig":
        cfg = from_plain(cls, _natural_num_clients(data), "")
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> "FederatedConfig":
        f, t, p = self.federation, self.train, self.federation.partition
        _check(self.method.rank >= 1, "method.rank must be >= 1 (e.g. method.rank=8)")
        _check(f.num_clients is not None or infers_clients(p.kind),
               "federation.num_clients=null needs federation.partition.kind=natural (one client per value of a column) "
               "or files (one per site); "
               "set federation.num_clients")
        _check(f.num_clients is None or f.num_clients >= 1, "federation.num_clients must be >= 1")
        _check(p.kind != "nodes" or f.validation_fraction == 0,
               "federation.partition.kind=nodes: the server holds no training rows to draw a validation pool from; "
               "set federation.validation_fraction=0 (give the server a test file in task.options.data: {test: FILE})")
        if f.clients_per_round is not None and f.num_clients is not None:
            _check(
                1 <= f.clients_per_round <= f.num_clients,
                f"federation.clients_per_round={f.clients_per_round} must be between 1 and "
                f"federation.num_clients={f.num_clients} (or null for full participation)",
            )
        _check(f.rounds >= 1, "federation.rounds must be >= 1")
        _check(f.eval_every >= 1, "federation.eval_every must be >= 1")
        _check(f.eval_last >= 0, "federation.eval_last must be >= 0 (e.g. 10: also evaluate every one of the last 10 rounds)")
        _check(f.client_eval_every is None or f.client_eval_every >= 1,
               f"federation.client_eval_every={f.client_eval_every} must be >= 1 (or null: with every evaluation)")
        _check(f.min_clients >= 1, "federation.min_clients must be >= 1")
        _check(
            f.min_clients <= (f.clients_per_round or f.num_clients or f.min_clients),
            f"federation.min_clients={f.min_clients} exceeds the clients sampled per round",
        )
        _check(f.max_round_retries >= 0, "federation.max_round_retries must be >= 0")
        for key in ("max_update_norm", "clip_update_norm", "client_timeout_s"):
            v = getattr(f, key)
            _check(v is None or (math.isfinite(v) and v > 0), f"federation.{key} must be a positive number or null")
        _check(
            0.0 <= f.validation_fraction < 1.0,
            f"federation.validation_fraction={f.validation_fraction} must be in [0, 1) (e.g. 0.1 holds out 10 % of the training pool)",
        )
        _check(0.0 < f.client_test_fraction < 1.0,
               f"federation.client_test_fraction={f.client_test_fraction} must be in (0, 1) (e.g. 0.2 holds out 20 % of "
               "each client's data for federation.client_eval)")
        if p.kind == "dirichlet":
            _check(
                isinstance(p.alpha, (int, float)) and math.isfinite(p.alpha) and p.alpha > 0,
                f"federation.partition.alpha={p.alpha} must be a positive number (smaller = more skew)",
            )
        _check(p.min_size >= 0, "federation.partition.min_size must be >= 0")
        _check(t.lr > 0 and math.isfinite(t.lr), f"train.lr={t.lr} must be a positive number")
        _check(t.batch_size >= 1, "train.batch_size must be >= 1")
        _check(
            t.grad_accum_steps >= 1,
            f"train.grad_accum_steps={t.grad_accum_steps} must be >= 1 (micro-batches of train.batch_size per optimizer step; 1 = none)",
        )
        _check(
            t.local_steps is not None or (t.local_epochs is not None and t.local_epochs > 0),
            "set train.local_epochs (E > 0) or train.local_steps (T >= 1)",
        )
        if t.local_steps is not None:
            _check(t.local_steps >= 1, "train.local_steps must be >= 1")
        _check(0 <= t.warmup_ratio < 1, "train.warmup_ratio must be in [0, 1)")
        _check(t.weight_decay >= 0, "train.weight_decay must be >= 0")
        _check(t.schedule in ("cosine", "linear", "constant"), "train.schedule must be cosine, linear or constant")
        _check(t.schedule_scope in ("global", "round"), "train.schedule_scope must be 'global' or 'round'")
        _check(t.grad_clip is None or t.grad_clip > 0, "train.grad_clip must be > 0 or null")
        _check(self.output.checkpoint_every == "auto" or self.output.checkpoint_every >= 1,
               "output.checkpoint_every must be >= 1 or 'auto'")
        _check(0 < self.output.checkpoint_budget <= 1,
               f"output.checkpoint_budget={self.output.checkpoint_budget} must be in (0, 1] (the share of wall time "
               "checkpoint_every=auto may spend checkpointing, e.g. 0.02)")
        _check(self.output.keep_checkpoints >= 1, "output.keep_checkpoints must be >= 1")
        _check(self.output.progress in ("auto", "rich", "plain", "quiet"), "output.progress must be auto, rich, plain or quiet")
        why = device_error(self.device)
        _check(why is None, f"device={self.device!r} {why}")
        _check(math.isfinite(t.prox_mu) and t.prox_mu >= 0,
               f"train.prox_mu={t.prox_mu} must be >= 0 (FedProx's μ; 0 = off, e.g. train.prox_mu=0.01)")
        f.server_optimizer.check()
        self.privacy.check()
        why = devices_problem(t.devices_per_client, self.privacy.record is not None, self.device)
        _check(why is None, why or "")
        why = shard_problem(t.shard_params, t.devices_per_client, bool(t.scaffold))
        _check(why is None, why or "")
        if self.method.name in available_methods():  # a method registered later (a Ray plugin) is checked when built
            opts = self.method.typed_options()
            if t.scaffold and not method_class(self.method.name).supports_scaffold:
                ok = ", ".join(m for m in available_methods() if method_class(m).supports_scaffold)
                raise ConfigError(f"train.scaffold needs dense trainable server parameters; method {self.method.name!r} "
                                  f"has none — use one of: {ok} (or set train.scaffold=false)")
            if getattr(opts, "downlink", "dense") == "factored" and not f.server_optimizer.identity:
                raise ConfigError(f"federation.server_optimizer.name={f.server_optimizer.name} changes the update the "
                                  "factored downlink sends; set method.options.downlink=dense (or server_optimizer.name=fedavg)")
            self._check_adapter_needs()
            if method_class(self.method.name).traits.keeps_client_state:  # e.g. FedSA-LoRA's local B
                _check(self.backend.name in ("sequential", "flower"),
                       f"method {self.method.name!r} keeps each site's own adapter factor between rounds, which the "
                       f"sequential backend and Flower's nodes keep for it (backend.name={self.backend.name} keeps no "
                       "method state at the sites); use backend.name=sequential or flower")
        self._check_guards()
        self._check_site_ranks()
        return self

    def _check_site_ranks(self) -> None:
        """``federation.site_ranks``: the sites it names exist, and the method (with its options) can
        train sites at different ranks (:meth:`~fedgalore.methods.base.Method.site_ranks_problem`);
        the stages that read each upload at one shape refuse it in one line."""
        f = self.federation
        if f.site_ranks is None:
            return
        named = [k for k in f.site_ranks.ranks if is_site_name(k)]
        _check(not named or infers_clients(f.partition.kind),
               f"federation.site_ranks.ranks: site {named[0] if named else ''!r} is a name, but federation.partition.kind={f.partition.kind} "
               "names no sites (natural, files and nodes partitions do); use client ids 0..M-1")
        if f.num_clients is not None:  # the ids and tiers now; the names once the data is split (resolve_clients)
            ids = {k: v for k, v in f.site_ranks.ranks.items() if k not in named}
            if ids or f.site_ranks.tiers:
                site_ranks(SiteRanksConfig(list(f.site_ranks.tiers), ids), f.num_clients, self.method.rank)
        if self.method.name in available_methods():
            cls = method_class(self.method.name)
            opts = cls.resolve_options(self.method.typed_options(), self.method.rank)
            why = cls.site_ranks_problem(opts, self.method.name)
            _check(why is None, str(why))
        _check(f.secure_aggregation is None,
               "federation.site_ranks with federation.secure_aggregation: SecAgg+ sums uploads of one shape, and sites "
               "at different ranks upload different shapes; use one of the two")
        _check(self.privacy.client is None,
               "federation.site_ranks with privacy.client: client-level DP noises the sum of uploads of one shape, and "
               "sites at different ranks upload different shapes; use one of the two (privacy.record works)")
        _check(not self.train.scaffold,
               "federation.site_ranks with train.scaffold: SCAFFOLD's control variates need one parameter shape at every "
               "site; turn train.scaffold off")

    def _check_guards(self) -> None:
        """``federation.secure_aggregation`` and ``federation.robust`` (fedgalore.federated.guards):
        their values, what they exclude, and — for a method registered here — whether the method's
        aggregation allows them (:meth:`~fedgalore.methods.base.Method.secure_aggregation_problem`,
        :meth:`~fedgalore.methods.base.Method.robust_problem`). Every refusal is one line naming the
        option; the method's comes before the backend's (SecAgg+ runs in Flower deployments only:
        :class:`~fedgalore.engine.loop.Federation` refuses any other backend before the model loads)."""
        f, name = self.federation, self.method.name
        if f.attack is not None:
            f.attack.check()
            _check(self.backend.name != "flower",
                   "federation.attack simulates hostile sites; a Flower deployment's sites are real ones — set "
                   "federation.attack=null")
            named = [c for c in f.attack.clients if is_site_name(c)]
            _check(not named or infers_clients(f.partition.kind),
                   f"federation.attack.clients: site {named[0] if named else ''!r} is a name, but federation.partition.kind={f.partition.kind} "
                   "names no sites (natural, files and nodes partitions do); use client ids 0..M-1")
            _check(f.num_clients is None or all(c < f.num_clients for c in f.attack.clients if c not in named),
                   f"federation.attack.clients={f.attack.clients} names a client outside 0..{(f.num_clients or 1) - 1}")
        known = name in available_methods()
        cls = method_class(name) if known else None
        if f.robust is not None:
            r = f.robust.check()
            _check(f.secure_aggregation is None,
                   "federation.robust compares the clients' individual uploads, which federation.secure_aggregation hides "
                   "from the server; use one of the two (set the other to null)")
            _check(self.privacy.client is None,
                   "federation.robust with privacy.client: a robust rule lets one site change which other uploads count, so "
                   "the noised sum's sensitivity is no longer privacy.client.clip; use one of the two")
            per_round = f.clients_per_round or f.num_clients
            _check(per_round is None or per_round >= r.min_clients(),
                   f"federation.robust.kind={r.kind} with num_malicious={r.num_malicious} needs at least {r.min_clients()} "
                   f"clients per round (K − f − 2 >= 1 and to_keep <= K); raise federation.clients_per_round or lower "
                   f"num_malicious")
            if cls is not None:
                why = cls.robust_problem(r.kind, name)
                _check(why is None, str(why))
        if f.secure_aggregation is not None:
            f.secure_aggregation.check()
            if cls is not None:
                opts = cls.resolve_options(self.method.typed_options(), self.method.rank)
                why = cls.secure_aggregation_problem(opts)
                _check(why is None, str(why))
            for key in ("max_update_norm", "clip_update_norm"):
                _check(getattr(f, key) is None,
                       f"federation.{key} checks each client's update, which federation.secure_aggregation hides from the "
                       f"server (SecAgg+'s clipping_range bounds every value instead); set federation.{key}=null")
            _check(not self.train.scaffold,
                   "train.scaffold: SCAFFOLD's control variates are per-client state the server must read, which "
                   "federation.secure_aggregation hides; turn train.scaffold off")
            c = self.privacy.client
            _check(c is None or c.noise == "distributed",
                   "privacy.client.noise=central has the server clip each upload, which federation.secure_aggregation "
                   "hides from it; set privacy.client.noise: distributed (each site clips and noises its own upload)")

    def _check_adapter_needs(self) -> None:
        """``task.options.quantization`` and ``export.every_round`` need a method whose global model is
        the pretrained base plus LoRA adapters (:attr:`~fedgalore.methods.traits.MethodTraits.explicit_adapters`)."""
        name = self.method.name
        adapters = ", ".join(m for m in available_methods() if method_class(m).traits.explicit_adapters)
        options = self.task.options or {}
        quant = options.get("quantization") or ("4bit" if options.get("load_in_4bit") is True else None)
        if quant is not None and not method_class(name).traits.explicit_adapters:
            raise ConfigError(f"task.options.quantization={quant} freezes a quantised base, but method {name!r} trains the "
                              f"weight matrices themselves; use a method that trains LoRA adapters on a frozen base "
                              f"({adapters}), or leave quantization out")
        if quant is not None and not self.device.startswith("cuda"):
            from fedgalore.tasks.quantize import quantization_unavailable

            why = quantization_unavailable()
            raise ConfigError(f"task.options.quantization={quant}: bitsandbytes' quantised layers run on a CUDA GPU; set "
                              "device=cuda" + (f" on a machine with one (here: {why})" if why else ""))
        if self.export.every_round and not method_class(name).traits.explicit_adapters:
            raise ConfigError(f"export.every_round keeps each round's LoRA adapter, and method {name!r} has none (it changes "
                              f"the weights themselves); use it with {adapters}, or export a round's model with fedgalore export")

    def setting_label(self) -> str:
        """The partition setting (``iid``, ``dirichlet:0.5``, ``natural:site``, ...; run names, tables)."""
        return self.federation.partition.label()


def _yaml_problem(exc: Exception) -> str:
    """A YAML error in one line with where it is: PyYAML's ``problem`` and its mark (1-based line
    and column), else the error's first line."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _natural_num_clients(data: Any) -> Any:
    """A natural (or files) partition infers ``federation.num_clients``: left out, it is null (not the default 20)."""
    fed = data.get("federation") if isinstance(data, dict) else None
    part = fed.get("partition") if isinstance(fed, dict) else None
    if isinstance(part, dict) and infers_clients(str(part.get("kind"))) and "num_clients" not in fed:
        return {**data, "federation": {**fed, "num_clients": None}}
    return data


def device_error(device: str) -> str | None:
    """Why ``device`` is not a device a run can use (``None`` when it is: cpu, cuda, cuda:N or mps)."""
    if device in ("cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", device):
        return None
    return "must be cpu, cuda[:N] or mps"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> FederatedConfig:
    """Read a pipeline YAML and apply dotted ``key=value`` overrides (OmegaConf syntax)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured({})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found (pipelines live in conf/pipeline/*.yaml)")
        try:
            base = OmegaConf.load(p)
        except Exception as exc:  # yaml errors
            raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(exc)}") from None
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like key=value (e.g. federation.rounds=5)")
    try:
        merged = base
        for ov in overrides:  # in order; `key={}` / `key=null` on a mapping empties it (a merge would keep its keys)
            key, value = (x.strip() for x in ov.split("=", 1))
            if value in ("{}", "null", "~") and OmegaConf.is_dict(OmegaConf.select(merged, key, default=None)):
                OmegaConf.update(merged, key, {}, merge=False)
            else:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([ov]))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override or interpolation: {str(exc).splitlines()[0]}") from None
    return FederatedConfig.from_dict(data or {})


def config_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first difference between two plain configs (``FederatedConfig.to_dict()`` or a saved
    ``config.yaml``), as ``"train.lr: 0.001 -> 0.0005"``; None when they describe the same run.
    The display (``output.progress``), the checkpoint cadence (``output.checkpoint_every``,
    ``checkpoint_budget``, ``keep_checkpoints``) and ``export`` do not count. A key present on one side only is a
    config-schema change between library versions: the missing side is read as the key's default
    (a new option's default is the old behaviour, e.g. ``train.prox_mu: 0``), so a run with the
    option set differs from an older run without it; keys that are not config fields (inside
    option pools) present on one side only are ignored. Whether a run directory holds a given
    run is decided by the run identity (:mod:`fedgalore.records.identity`), which resolves those
    pools against the task's and the method's options."""
    defaults = _comparable(FederatedConfig().to_dict())
    return _first_difference(_with_defaults(_comparable(old), defaults), _with_defaults(_comparable(new), defaults))


def _with_defaults(d: Any, defaults: Any) -> Any:
    """``d`` with the config fields it lacks filled in from ``defaults`` (recursively)."""
    if not isinstance(d, dict) or not isinstance(defaults, dict):
        return d
    out = dict(d)
    for k, v in defaults.items():
        out[k] = _with_defaults(out[k], v) if k in out else v
    return out


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) & set(b)):
            diff = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        a, b = list(a), list(b)
    return None if a == b else f"{path}: {a!r} -> {b!r}"


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    d = json.loads(json.dumps(d))
    fed = d.get("federation", {})
    if isinstance(fed, dict) and infers_clients(str((fed.get("partition") or {}).get("kind"))):
        fed.pop("num_clients", None)  # the data decides it (one client per value); a given one must agree
    for key in ("progress", "checkpoint_every", "checkpoint_budget", "keep_checkpoints"):  # display and checkpoint cadence:
        d.get("output", {}).pop(key, None)  # they do not change the run's result
    d.pop("export", None)  # what a run keeps for export (per-round adapters) does not change its result either
    return d
