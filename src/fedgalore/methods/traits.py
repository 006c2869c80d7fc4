"""What the engine may rely on about a method: its declared traits and its optional operator groups.

Every method class declares ``traits = MethodTraits(...)`` (:class:`MethodTraits`: one field per
thing the engine, its stages and backends, the Flower apps, ``plan``, ``export`` and the reports
ask of a method). A trait that follows the method's options (FedGaLore's ``sync``, a
``downlink`` option, HetLoRA's ``aggregation``) is filled in by the class's
:meth:`~fedgalore.methods.base.Method.traits_for`; a built method's own traits are
:attr:`~fedgalore.methods.base.Method.run_traits`. Code outside ``fedgalore.methods`` reads a method
through these and through the protocols below, never by ``getattr`` or by the method's name
(tests/project/test_method_traits.py).

Optional operator groups are :class:`typing.Protocol` classes: a method that has the group
implements every operator of it, and callers ask :func:`per_client_downlink_ops`,
``isinstance(method, WrapsModel)`` / ``isinstance(method, StartsFromAdapter)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # typing only: the protocols' signatures
    import torch
    from torch import nn

    from fedgalore.protocol.payload import Payload
    from fedgalore.protocol.state import RoundContext, ServerState

__all__ = ["MethodTraits", "ROBUST_RULES", "PerClientDownlink", "WrapsModel", "StartsFromAdapter",
           "per_client_downlink_ops", "declares_traits"]

#: every ``federation.robust.kind``; the coordinate-wise ones need :attr:`MethodTraits.coordinate_uploads`
ROBUST_RULES = ("trimmed_mean", "median", "krum", "norm_filter")
_COORDINATE_RULES = ("trimmed_mean", "median")


@dataclass(frozen=True)
class MethodTraits:
    """A method's declaration of what the engine may rely on (module doc). Every field has the
    conservative default; a method declares the ones that differ."""

    #: the downlink: ``dense`` — every client gets the same broadcast; ``factored`` — the method takes a
    #: ``downlink`` option (factored / dense / auto, fedgalore.job.resolve) and implements
    #: :class:`PerClientDownlink`: with ``downlink: factored`` a client holding model version ``h`` is sent
    #: the exact low-rank updates since ``h`` (fedgalore.protocol.downlink)
    downlink: Literal["dense", "factored"] = "dense"
    #: whether the message depends on what each client holds (a ``factored`` downlink with its option
    #: ``factored``, or ``auto`` not resolved yet): the round loop builds one broadcast per held version
    #: (filled in by :meth:`~fedgalore.methods.base.Method.traits_for`; False on the class)
    per_client_downlink: bool = False
    #: whether each client keeps state of its own between rounds in ``ctx.state`` (FedSA-LoRA's local B):
    #: the sequential backend keeps a store per site (written with the run, fedgalore.engine.stages.site_state),
    #: a Flower node in its ``Context.state``; the config refuses Ray
    keeps_client_state: bool = False
    #: the second moments the method synchronises: ``none``; ``uploaded`` — the uploads carry second-moment
    #: views (released under client-level DP when ``privacy.client.moments: noised``); ``from_aggregate`` —
    #: the server builds them from the aggregate itself (FedGaLore's ``sync: aggregate``: post-processing)
    moments: Literal["none", "uploaded", "from_aggregate"] = "none"
    #: whether the upload carries the weight decay as a term ``decay·W0`` beside the trained change (FedGaLore's
    #: decoupled decay): outside client-level DP's clipped change, and a full-rank change of W (no exact LoRA)
    decay_in_upload: bool = False
    #: how A combines the uploads: ``mean`` — each released tensor is averaged with the round's weights
    #: (A(x_1..x_K; p) = A(Σ p_i x_i; 1)), so client-level DP noise on the sum protects the aggregate and
    #: secure aggregation applies; ``individual`` — A uses each upload on its own (stacking, products, a fit
    #: per client), so each upload carries the whole noise and secure aggregation is refused
    dp_aggregate: Literal["mean", "individual"] = "individual"
    #: whether the uploads are dense tensors in the global parameters' own coordinates, so coordinate-wise
    #: statistics (``federation.robust.kind`` trimmed_mean / median) are updates (:attr:`robust_rules`)
    coordinate_uploads: bool = False
    #: whether sites may train at different ranks (``federation.site_ranks``)
    site_ranks: bool = False
    #: the client optimizer: ``adamw`` (torch AdamW on the trained tensors), ``sgd`` (plain SGD: the paper's
    #: optimizer of FFA-LoRA, LoRA-FAIR, FedSA-LoRA; ``train.sgd_lr``), ``galore_adamw`` (GaLoreAdamW on the
    #: adapted matrices)
    optimizer: Literal["adamw", "sgd", "galore_adamw"] = "adamw"
    #: whether the global model is the pretrained model plus the method's LoRA adapters, the base weights never
    #: changed (FedIT, FFA-LoRA, LoRA-FAIR): the adapters are a PEFT adapter (``export --format peft``), a
    #: starting adapter is trained on (with :class:`StartsFromAdapter`), a quantised base is allowed
    explicit_adapters: bool = False
    #: whether the run's update ``W_T − W_0`` is exactly low rank (``export --format peft`` without ``--rank``:
    #: fedgalore.trained.lora_exact; under a linear server optimizer, and no :attr:`decay_in_upload` decay)
    exact_low_rank: bool = False
    #: whether an upload's structure follows the site's local step count (FedGaLore: one update term per
    #: projector refresh, ``plan`` sizes it per refresh count; client-level DP needs ``train.local_steps``)
    upload_follows_steps: bool = False
    #: memory term for ``plan``: the uploads are the dense deltas ΔW_i themselves, so the diagnostics hold no
    #: second copy of every client's delta (FedAvg-Full)
    uploads_dense_deltas: bool = False

    @property
    def secure_aggregation(self) -> bool:
        """Whether A reads the uploads only through their weighted sum (secure aggregation applies)."""
        return self.dp_aggregate == "mean"

    @property
    def robust_rules(self) -> tuple[str, ...]:
        """The ``federation.robust.kind`` rules that apply: Krum and the norm filter compare updates ΔW_i,
        which every method has; the coordinate-wise statistics need :attr:`coordinate_uploads`."""
        return tuple(k for k in ROBUST_RULES if self.coordinate_uploads or k not in _COORDINATE_RULES)


def declares_traits(cls: type) -> bool:
    """Whether ``cls`` itself declares its traits (a ``traits`` class attribute of its own)."""
    return isinstance(vars(cls).get("traits"), MethodTraits)


@runtime_checkable
class PerClientDownlink(Protocol):
    """The operators of a :attr:`MethodTraits.downlink` ``factored`` method
    (fedgalore.methods.downlink_mixin.FactoredDownlink) that the round loop and the backends call."""

    def downlink_base(self, model: "nn.Module") -> "dict[str, torch.Tensor]":
        """Version 0 of the chained matrices: what a client that kept nothing holds."""

    def held_versions(self, state: "ServerState", clients: Sequence[int]) -> dict[int, int]:
        """The version the server last sent each client."""

    def held_version(self, client_state: dict[str, Any] | None) -> int | None:
        """The version a client's own store holds (None: it keeps none)."""

    def downlink_sent(self, state: "ServerState", clients: Sequence[int]) -> None:
        """Record that ``clients`` now hold the current version."""

    def client_broadcast(self, state: "ServerState", ctx: "RoundContext", common: "Payload", held: int | None) -> "Payload":
        """The message for a client holding version ``held``."""


def per_client_downlink_ops(method: Any) -> PerClientDownlink | None:
    """``method`` as its :class:`PerClientDownlink` operators when its downlink is per client now
    (:attr:`MethodTraits.per_client_downlink`), else None."""
    if not method.run_traits.per_client_downlink:
        return None
    if not isinstance(method, PerClientDownlink):
        raise TypeError(f"method {method.name!r} declares a per-client downlink but lacks PerClientDownlink's operators")
    return method


@runtime_checkable
class WrapsModel(Protocol):
    """A method whose :meth:`setup` wraps the model (PEFT adapters): ``inner`` is the model inside."""

    def inner(self, model: "nn.Module") -> "nn.Module":
        """The wrapped model (the task's own architecture)."""


@runtime_checkable
class StartsFromAdapter(Protocol):
    """A method that trains a starting LoRA adapter further (with :attr:`MethodTraits.explicit_adapters`)."""

    def start_from(self, model: "nn.Module", factors: "Mapping[str, tuple[torch.Tensor, torch.Tensor]]", *args: Any,
                   **kwargs: Any) -> Any:
        """Load the starting adapter's factors into the prepared model."""
