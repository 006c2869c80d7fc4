"""The method interface: local training T, aggregation A and state synchronisation S (paper §3).

A federated method is data, not a fork of the round loop (docs/design.md §2). It declares

* ``setup`` — how the shared model is prepared once per process (e.g. PEFT adapters, which
  parameters train);
* ``init_server_state`` / ``broadcast`` — what the server owns and sends down each round;
* ``client_update`` — the local training operator T: load the broadcast, build the optimizer,
  run local steps, return a typed upload;
* ``aggregate`` — the aggregation operator A (mutates the server state);
* ``synchronize`` — the state synchronisation operator S (default: none);
* ``load_global`` — put the global state into a model for evaluation.

Methods register themselves with :func:`register`; the loop looks them up by name.
"""
from __future__ import annotations

import abc
import inspect
from typing import Any, ClassVar, Iterable, Sequence

import torch
from torch import nn

from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = [
    "Method",
    "register",
    "get_method",
    "available_methods",
    "MethodError",
    "method_options_for",
]


class MethodError(ValueError):
    """Unknown method or an invalid method option."""


class Method(abc.ABC):
    """Base class; subclasses set ``name`` and implement T, A (and optionally S)."""

    name: ClassVar[str] = "method"
    #: short description for ``fedgalore methods`` / README tables
    summary: ClassVar[str] = ""
    #: options the constructor takes through ``**options`` (not visible in its signature)
    extra_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The option names this method accepts: the keyword parameters of ``__init__`` along
        the class hierarchy (except ``rank``) plus :attr:`extra_options`. Used to route a shared
        ``method.options`` mapping to the method that owns each option."""
        names: set[str] = set(cls.extra_options)
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.name not in ("self", "rank") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                    names.add(p.name)
        return frozenset(names)

    def __init__(self, rank: int = 8, **options: Any) -> None:
        if rank <= 0:
            raise MethodError(f"rank must be a positive integer, got {rank}")
        self.rank = int(rank)
        self.options = dict(options)

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
        to each adapted weight matrix (ΔW̄, used by diagnostics)."""

    def synchronize(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, float]:
        """State synchronisation operator S (default: none). Returns diagnostics."""
        return {}

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """Dense effective weight change of each adapted matrix in one upload (for drift
        diagnostics). Methods that can compute it override this; default: none."""
        return {}

    def validate_upload(self, state: ServerState, upload: Payload, ctx: "RoundContext") -> str | None:
        """Method-specific checks of an upload (reason to reject, or None). Generic checks —
        finite values, shapes, key sets, norm bound — are done by the server."""
        return None

    def scale_upload(self, upload: Payload, factor: float) -> Payload:
        """The upload whose effective update is ``factor`` times this one's (norm clipping).
        Only methods whose update is linear in the payload can support it."""
        raise MethodError(f"method {self.name!r} does not support federation.clip_update_norm")

    @abc.abstractmethod
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        """Load the global state into ``model`` (for evaluation and checkpoints)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, **self.options}


_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    from fedgalore import methods as _m  # noqa: F401  (imports the built-in methods)

    return sorted(_REGISTRY)


def get_method(name: str, **kwargs: Any) -> Method:
    available_methods()
    if name not in _REGISTRY:
        raise MethodError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


def method_options_for(name: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a shared ``method.options`` mapping into (options for method ``name``, ignored).

    The rule (docs/cli.md, "Method options"): ``method.options`` may hold options of several
    methods — a pipeline written for FedGaLore keeps working with ``method.name=fedit``. An
    option goes to ``name`` when ``name`` accepts it; an option that only *other* registered
    methods accept is ignored (returned second); an option that no registered method accepts is
    passed on too, so the method rejects it with its own one-line error. An unregistered
    ``name`` (a method object passed to ``fedgalore.run``) gets every option.
    """
    available_methods()
    cls = _REGISTRY.get(name)
    if cls is None:
        return dict(options), {}
    own = cls.option_names()
    others = set().union(*(c.option_names() for n, c in _REGISTRY.items() if n != name))
    kept = {k: v for k, v in options.items() if k in own or k not in others}
    ignored = {k: v for k, v in options.items() if k not in kept}
    return kept, ignored


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
