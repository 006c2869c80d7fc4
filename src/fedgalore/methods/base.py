"""The method interface: local training T, aggregation A and state synchronisation S (paper §3).

A federated method is data, not a fork of the round loop (docs/design.md §2). It declares

* ``setup`` — how the shared model is prepared once per process (e.g. PEFT adapters, which
  parameters train);
* ``init_server_state`` / ``broadcast`` — what the server owns and sends down each round;
* ``client_update`` — the local training operator T: load the broadcast, build the optimizer,
  run local steps, return a typed upload;
* ``aggregate`` — the aggregation operator A (mutates the server state);
* ``synchronize`` — the state synchronisation operator S (default: none);
* ``load_global`` — put the global state into a model for evaluation;
* ``options_class`` — its options, a frozen :class:`MethodOptions` dataclass (every field a
  default and a one-line doc), parsed from the config's ``method.options`` when the config is
  loaded (:func:`split_options`, :func:`parse_options`).

Methods register themselves with :func:`register`; the loop looks them up by name. A method
defined outside the package is one class and its options dataclass (tests/engine/test_engine.py). One
class may stand under several names: :func:`register_preset` registers a name that runs a class
with some options pinned (``fedgalore_minus`` is FedGaLore with ``sync: none``); build a method
by its name with :func:`build_method` (or :func:`get_method`), which gives it that name.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, Sequence, get_type_hints

import torch
from torch import nn

from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState
from fedgalore.methods.traits import ROBUST_RULES, MethodTraits
from fedgalore.typed import ConfigError, coerce, to_plain

__all__ = [
    "Method",
    "MethodTraits",
    "register",
    "register_preset",
    "Registration",
    "registration",
    "build_method",
    "method_behaviour",
    "get_method",
    "available_methods",
    "MethodError",
    "MethodOptions",
    "option",
    "method_class",
    "option_fields",
    "parse_options",
    "split_options",
]


class MethodError(ConfigError):
    """Unknown method or an invalid method option (one line, naming the method and the option)."""


@dataclass(frozen=True)
class MethodOptions:
    """A method's options: a frozen dataclass registered with the method (:attr:`Method.options_class`),
    like PEFT's ``LoraConfig`` per tuner. Every field has a default and a one-line doc
    (:func:`option`); ``fedgalore methods`` lists them. Ranges and combinations are checked in
    ``__post_init__`` (raise :class:`MethodError`)."""


def option(default: Any, doc: str) -> Any:
    """A field of a :class:`MethodOptions` dataclass: its default and its one-line doc."""
    return field(default=default, metadata={"doc": doc})


class Method(abc.ABC):
    """Base class; subclasses set ``name`` and implement T, A (and optionally S)."""

    name: ClassVar[str] = "method"
    #: short description for ``fedgalore methods`` / README tables
    summary: ClassVar[str] = ""
    #: the method's options (a :class:`MethodOptions` dataclass; the base has none)
    options_class: ClassVar[type[MethodOptions]] = MethodOptions
    #: the behaviour version: what the method computes, bumped when the same options give another
    #: result (a fixed rule), so a run made before is not taken for this method's run (the run
    #: identity's ``method.behaviour``, :mod:`fedgalore.records.identity`; a run recorded without it
    #: counts as version 1). A name registered with :func:`register_preset` may carry its own.
    behaviour_version: ClassVar[int] = 1

    #: whether ``train.scaffold`` applies: the server parameters are exactly the dense tensors the
    #: clients train (:meth:`scaffold_params`), so a control variate per parameter makes sense
    supports_scaffold: ClassVar[bool] = False

    #: what the engine may rely on (:class:`~fedgalore.methods.traits.MethodTraits`; every registered
    #: class of the package declares its own, tests/project/test_method_traits.py); traits that follow
    #: the options: :meth:`traits_for`, a built method's: :attr:`run_traits`
    traits: ClassVar[MethodTraits] = MethodTraits()

    #: whether every upload entry is a change from what the client started with (zero when it did
    #: not train); else entries are absolute values whose untrained value is the broadcast's
    uploads_changes: ClassVar[bool] = False

    @classmethod
    def traits_for(cls, options: MethodOptions) -> MethodTraits:
        """The traits of this method with its resolved ``options``: :attr:`traits`, with
        ``per_client_downlink`` filled in for a ``factored`` downlink (its ``downlink`` option
        ``factored``, or ``auto`` not resolved yet). A class whose traits follow other options
        overrides this (FedGaLore's ``sync``, HetLoRA's ``aggregation``)."""
        t = cls.traits
        if t.downlink == "factored" and getattr(options, "downlink", "dense") in ("factored", "auto"):
            t = dataclasses.replace(t, per_client_downlink=True)
        return t

    @property
    def run_traits(self) -> MethodTraits:
        """This method's traits as it runs (:meth:`traits_for` its current options)."""
        return type(self).traits_for(self.options)

    def release_reference(self, broadcast: Payload | None, key: str, upload: Payload | None = None) -> Any:
        """The public value upload entry ``key`` would have if the client had not trained: the
        broadcast's entry of the same name (methods that upload absolute factors and heads), or
        None — zero — for :attr:`uploads_changes` methods. Client-level DP clips and noises the
        upload's change from it (fedgalore.privacy.client_dp); it is public, so it affects the
        utility only, never the guarantee. ``upload`` (its shapes and public meta — client, round)
        lets a method rebuild what it starts from out of public seeds (FLoRA's fresh adapters)."""
        if self.uploads_changes or broadcast is None:
            return None
        return broadcast.entries.get(key)

    def released_coordinates(self, model: nn.Module, steps: int) -> int:
        """d: how many coordinates one client's upload change has — what client-level DP clips
        jointly to C and noises (the update and the head; second moments have their own clip and
        are not counted) — for a client that runs ``steps`` optimizer steps a round, on the
        prepared ``model``. Default: every parameter the model trains (the dense changes of
        FedAvg-Full, the LoRA methods' factors and head). :func:`fedgalore.privacy.signal.noise_vs_signal`
        weighs the noise in these d coordinates against the clip."""
        return sum(int(p.numel()) for p in model.parameters() if p.requires_grad)

    def start_notes(self, train: Any) -> list[str]:
        """One-line notes the run prints when it starts, about how this method reads the
        ``train`` config (e.g. a setting it does not use). Default: none."""
        return []

    def client_dp_problem(self, moments: str) -> str | None:
        """Why this method (with its options) cannot run under client-level DP, as one line that
        names the option to change, or None. ``moments``: ``privacy.client.moments``."""
        return None

    #: each site's rank (:meth:`use_site_ranks`, before :meth:`setup`); None: every site at :attr:`rank`
    site_ranks: tuple[int, ...] | None = None

    @classmethod
    def site_ranks_problem(cls, options: MethodOptions, name: str | None = None) -> str | None:
        """Why this method, with its resolved ``options``, cannot train sites at different ranks
        (``federation.site_ranks``), as one line naming what to change, or None."""
        if cls.traits_for(options).site_ranks:
            return None
        return (f"federation.site_ranks: method {(name or cls.name)!r} trains one shape at every site and combines the "
                "uploads coordinate by coordinate, which factors of different ranks do not share; use fedgalore, "
                "fedgalore_minus, fedgalore_mean, flora, flexlora or hetlora, or remove federation.site_ranks")

    def use_site_ranks(self, ranks: Sequence[int] | None) -> None:
        """Give each site (client id) its own rank (None: every site at :attr:`rank`). Called once,
        before :meth:`setup`, by every process of the run (the server and each client's)."""
        if ranks is None:
            self.site_ranks = None
            return
        why = type(self).site_ranks_problem(self.options, self.name)
        if why is not None:
            raise MethodError(why)
        if any(int(r) < 1 for r in ranks):
            raise MethodError(f"site ranks must be positive integers, got {sorted(set(ranks))}")
        self.site_ranks = tuple(int(r) for r in ranks)

    def rank_of(self, client: int) -> int:
        """Site ``client``'s rank: its entry of :attr:`site_ranks`, else :attr:`rank`."""
        if self.site_ranks is None or not 0 <= int(client) < len(self.site_ranks):
            return self.rank
        return self.site_ranks[int(client)]

    @property
    def frame_rank(self) -> int:
        """The largest rank any site trains at (:attr:`rank` without site ranks): the rank the
        shared model is prepared at and the frame of nested seeded bases."""
        return max(self.site_ranks) if self.site_ranks else self.rank

    @classmethod
    def secure_aggregation_problem(cls, options: MethodOptions) -> str | None:
        """Why this method, with its resolved ``options``, cannot run under secure aggregation
        (``federation.secure_aggregation``: the server learns only ``Σ_i w_i x_i / Σ_i w_i`` of the
        uploads ``x_i``), as one line naming the option, or None. Supported exactly when A and S
        read the uploads only through that weighted mean — ``A(x_1..x_K; p) = A(Σ p_i x_i; 1)`` —
        which :attr:`MethodTraits.dp_aggregate` ``mean`` declares; a method whose A uses each upload on
        its own (stacking, products, a fit per client) is refused."""
        if cls.traits_for(options).secure_aggregation:
            return None
        return (f"federation.secure_aggregation: method {cls.name!r} combines each client's upload on its own (its "
                "aggregation is not a weighted sum of the uploads), which secure aggregation hides from the server; use "
                "fedavg_full, fedit, ffa_lora, fr_lora or fedgalore on seeded bases, or set federation.secure_aggregation=null")

    @classmethod
    def robust_problem(cls, kind: str, name: str | None = None) -> str | None:
        """Why ``federation.robust.kind`` cannot apply to this method (registered as ``name``), or None. Coordinate-wise
        statistics need :attr:`MethodTraits.coordinate_uploads`; Krum and the norm filter compare the clients'
        effective updates ΔW_i (:meth:`update_terms`), which every method has."""
        if kind in ROBUST_RULES and kind not in cls.traits.robust_rules:
            return (f"federation.robust.kind={kind} is a coordinate-wise statistic of dense uploads, and method "
                    f"{(name or cls.name)!r} uploads factors (two clients' factor coordinates are not the same coordinates); use "
                    "kind krum or norm_filter, which compare the updates ΔW_i themselves")
        return None

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list[Any]]:
        """Each adapted matrix's effective update ΔW_i as additive terms
        (:class:`fedgalore.federated.robust.Term`: dense, or factored ``L R``) — what robust
        aggregation compares, through inner products of factors, never forming ``m × n`` where
        the factors suffice. Default: the dense :meth:`client_deltas`."""
        from fedgalore.federated.robust import dense_term

        return {k: [dense_term(d)] for k, d in self.client_deltas(state, upload).items()}

    def __init__(self, rank: int = 8, options: MethodOptions | None = None) -> None:
        if rank <= 0:
            raise MethodError(f"rank must be a positive integer, got {rank}")
        options = self.options_class() if options is None else options
        if type(options) is not self.options_class:
            raise MethodError(f"method {self.name!r} takes {self.options_class.__name__}, got {type(options).__name__}")
        self.rank = int(rank)
        #: the options as this method runs them (:meth:`resolve_options`)
        self.options = type(self).resolve_options(options, self.rank)

    @classmethod
    def resolve_options(cls, options: MethodOptions, rank: int) -> MethodOptions:
        """The options as this method runs them: defaults that depend on the method or the rank
        filled in, combinations checked (raise :class:`MethodError`). Default: as given."""
        return options

    # --------------------------------------------------------------- once per process
    @abc.abstractmethod
    def setup(self, model: nn.Module, target_modules: Sequence[str], head_params: Sequence[str]) -> nn.Module:
        """Prepare the model once per process (wrap with adapters, set ``requires_grad``).

        ``target_modules``: full names of the adapted ``nn.Linear`` modules in the raw model
        (their ``.weight`` is the matrix W); ``head_params``: full names of the parameters every
        method trains fully and averages (the classifier head). Must be deterministic: every
        process (sequential, Ray worker, Flower client) builds the identical prepared model.
        """

    @abc.abstractmethod
    def init_server_state(self, model: nn.Module) -> ServerState:
        """The server's initial state from the prepared model."""

    # --------------------------------------------------------------- per round
    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        """Server → client message (default: every global tensor dense + the round seed)."""
        return Payload({k: Dense(v) for k, v in state.params.items()}, {"round": ctx.round, "round_seed": ctx.round_seed})

    @abc.abstractmethod
    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        """Local training operator T: returns the upload (meta must hold ``num_examples``)."""

    @abc.abstractmethod
    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """Aggregation operator A. Mutates ``state``; returns the dense effective update applied
        to each adapted weight matrix (ΔW̄, used by diagnostics only: a method may return ``{}``
        when ``ctx.diagnostics`` is off)."""

    def synchronize(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, float]:
        """State synchronisation operator S (default: none). Returns diagnostics."""
        return {}

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """Dense effective weight change ΔW_i of each adapted matrix in one upload, against the
        state the client started from: the round loop calls it once per valid upload, before
        ``aggregate`` changes ``state``, and passes the result to the norm bound, clipping and
        the drift diagnostics. Methods that can compute it override this; default: none."""
        return {}

    def client_delta_factors(self, state: ServerState, upload: Payload) -> dict[str, Any] | None:
        """``ΔW_i`` of each adapted matrix in factors (:class:`fedgalore.federated.diagnostics.FactoredDelta`,
        its decay term on ``state.params``), for the drift diagnostics when nothing else needs the dense
        ``ΔW_i`` (``diagnostics_exact: false``); called like :meth:`client_deltas`. ``None``: the method has no
        factored form, and the dense one is used."""
        return None

    def validate_upload(self, state: ServerState, upload: Payload, ctx: "RoundContext") -> str | None:
        """Method-specific checks of an upload (reason to reject, or None). Generic checks —
        finite values, shapes, key sets, norm bound — are done by the server."""
        return None

    def scale_upload(self, upload: Payload, factor: float) -> Payload:
        """The upload whose effective update is ``factor`` times this one's (norm clipping).
        Only methods whose update is linear in the payload can support it."""
        raise MethodError(f"method {self.name!r} does not support federation.clip_update_norm")

    def scaffold_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters a client trains, keyed by their server names (``ServerState.params``'s
        keys): where SCAFFOLD's control variates apply (methods with :attr:`supports_scaffold`)."""
        raise MethodError(f"method {self.name!r} does not support train.scaffold")

    @abc.abstractmethod
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        """Load the global state into ``model`` (for evaluation and checkpoints)."""

    def describe(self) -> dict[str, Any]:
        """The method as it runs (``environment.json``): name, rank and every option."""
        return {"name": self.name, "rank": self.rank, **to_plain(self.options)}


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Registration:
    """One name of the method registry: the class that runs it and what the name fixes.

    ``presets``: options the name pins — applied over the options a config gives (a shared
    ``method.options`` pool cannot override them; its values are still type-checked), e.g.
    ``fedgalore_minus`` = :class:`~fedgalore.methods.fedgalore.FedGaLore` with ``sync: none``.
    ``summary`` (``fedgalore methods``) and ``behaviour_version`` (:attr:`Method.behaviour_version`)
    are the name's: a preset is another method of the paper, versioned on its own."""

    name: str
    cls: type[Method]
    presets: Mapping[str, Any]
    summary: str
    behaviour_version: int


_REGISTRY: dict[str, Registration] = {}


def _check_options_class(cls: type[Method]) -> None:
    opts = cls.options_class
    if not (issubclass(opts, MethodOptions) and dataclasses.is_dataclass(opts) and opts.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__}.options_class must be a frozen dataclass subclassing MethodOptions")
    for f in dataclasses.fields(opts):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING or not f.metadata.get("doc"):
            raise TypeError(f"{opts.__name__}.{f.name} needs a default and a doc: use option(default, doc)")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by ``cls.name`` (its options: ``cls.options_class``,
    a frozen :class:`MethodOptions` dataclass whose every field has a default and a doc)."""
    _check_options_class(cls)
    _REGISTRY[cls.name] = Registration(cls.name, cls, {}, cls.summary, cls.behaviour_version)
    return cls


def register_preset(name: str, cls: type[Method], presets: Mapping[str, Any], summary: str,
                    behaviour_version: int | None = None) -> None:
    """Make ``name`` available as method ``cls`` with the options ``presets`` pinned (e.g. an
    ablation of a method: one option fixed); ``behaviour_version``: the name's own (default: the
    class's). Built by :func:`build_method`, which names the method ``name``."""
    _check_options_class(cls)
    fields = {f.name for f in dataclasses.fields(cls.options_class)}
    unknown = sorted(set(presets) - fields)
    if unknown:
        raise TypeError(f"preset {name!r}: {cls.options_class.__name__} has no option(s) {unknown}")
    _REGISTRY[name] = Registration(name, cls, dict(presets), summary,
                                   cls.behaviour_version if behaviour_version is None else behaviour_version)


def available_methods() -> list[str]:
    """The registered method names (the built-in ones register when ``fedgalore.methods`` is imported)."""
    return sorted(_REGISTRY)


def registration(name: str) -> Registration:
    """The registry's entry for method ``name``."""
    if name not in _REGISTRY:
        raise MethodError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def method_class(name: str) -> type[Method]:
    """The class that runs method ``name`` (several names may share one: :func:`register_preset`)."""
    return registration(name).cls


def method_behaviour(name: str) -> int:
    """The behaviour version of method ``name`` (:attr:`Method.behaviour_version`; a preset's own)."""
    return registration(name).behaviour_version


def build_method(name: str, rank: int = 8, options: MethodOptions | None = None) -> Method:
    """Method ``name`` built with ``options`` (parsed: :func:`parse_options`; default: the class's
    defaults) and the name's presets pinned; the object carries the name, summary and behaviour
    version it was registered with."""
    reg = registration(name)
    options = reg.cls.options_class() if options is None else options
    if reg.presets and type(options) is reg.cls.options_class:
        options = dataclasses.replace(options, **reg.presets)
    method = reg.cls(rank=rank, options=options)
    if name != reg.cls.name:
        method.name, method.summary, method.behaviour_version = name, reg.summary, reg.behaviour_version  # type: ignore[misc]
    return method


def option_fields(name: str) -> dict[str, dataclasses.Field]:
    """The option fields of method ``name`` by option name."""
    return {f.name: f for f in dataclasses.fields(method_class(name).options_class)}


def parse_options(name: str, options: Mapping[str, Any], rank: int = 8) -> MethodOptions:
    """Method ``name``'s options dataclass from a mapping of its own options (values checked
    against the field types), resolved as the method runs them (:meth:`Method.resolve_options`).
    An option the method does not take, a value of the wrong type or an invalid combination is a
    :class:`MethodError` naming the method and the option."""
    cls = method_class(name)
    fields = option_fields(name)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise MethodError(f"method {name!r} has no option(s) {unknown}; options are {sorted(fields)}")
    hints = get_type_hints(cls.options_class)
    try:
        values = {k: coerce(hints[k], v, f"option {k}") for k, v in options.items()}
        values.update(_REGISTRY[name].presets)  # the name's pinned options (register_preset) win
        return cls.resolve_options(cls.options_class(**values), int(rank))
    except (ConfigError, ValueError, TypeError) as exc:  # MethodError is a ConfigError
        raise MethodError(f"method {name!r}: {exc}") from None


def split_options(name: str, pool: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a shared ``method.options`` pool into (method ``name``'s own options, ignored).

    The rule (docs/cli.md, "Method options"): the pool may hold options of several methods — a
    pipeline written for FedGaLore keeps working with ``method.name=fedit``. An option goes to
    ``name`` when ``name`` takes it; an option that only other registered methods take is
    ignored (returned second), after its value is checked against the type those methods give
    it; an option that no registered method takes is a :class:`MethodError`. An unregistered
    ``name`` (a method registered later, e.g. in a Ray worker's plugin) gets the whole pool.
    """
    if name not in _REGISTRY:
        return dict(pool), {}
    own = option_fields(name)
    takers: dict[str, list[str]] = {}
    for other in sorted(_REGISTRY):
        for k in option_fields(other):
            takers.setdefault(k, []).append(other)
    unknown = sorted(k for k in pool if k not in takers)
    if unknown:
        raise MethodError(f"method {name!r} has no option(s) {unknown}; options are {sorted(own)}")
    ignored = {k: v for k, v in pool.items() if k not in own}
    for k, v in ignored.items():
        other = takers[k][0]
        try:
            coerce(get_type_hints(method_class(other).options_class)[k], v, f"option {k}")
        except ConfigError as exc:
            raise MethodError(f"method {other!r}: {exc}") from None
    return {k: v for k, v in pool.items() if k in own}, ignored


def get_method(name: str, rank: int = 8, **options: Any) -> Method:
    """Build the registered method ``name``; ``options`` by keyword are parsed as the config's
    ``method.options`` are (:func:`parse_options`)."""
    return build_method(name, rank, parse_options(name, options, rank))


# ----------------------------------------------------------------------------- shared helpers
def named_params(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Parameter]:
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise MethodError(f"model has no parameters {missing[:4]}")
    return {n: params[n] for n in names}


@torch.no_grad()
def load_params(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters/buffers of the same names (in place)."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for name, value in values.items():
        params[name].copy_(value.to(params[name].device, params[name].dtype))
