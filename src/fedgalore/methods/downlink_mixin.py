"""The factored downlink as a method capability (the protocol is
:mod:`fedgalore.protocol.downlink`).

A method whose server keeps dense matrices ``W`` (FedGaLore's adapted matrices, FLoRA's and
FR-LoRA's merged base) and moves them each round by an update that is exactly low rank can send
a client that holds ``W_h`` the chain of updates ``h+1..k`` instead of ``W_k``. The method says
which server parameters are chained (:meth:`FactoredDownlink.downlink_names`), builds each
round's update as a payload entry (``GaLoreUpdate`` / ``LowRank``) and applies it with
:meth:`FactoredDownlink.apply_round_update` — the same function a client rebuilds ``W`` with, so
the server's ``W`` is bit-identical whatever the downlink — and its client loads the start model
through :meth:`FactoredDownlink.start_matrices`. The round loop (fedgalore.engine.loop) asks the
trait ``per_client_downlink`` (:class:`~fedgalore.methods.traits.MethodTraits`, filled in from the
option ``downlink`` by :meth:`~fedgalore.methods.base.Method.traits_for`) and calls the
:class:`~fedgalore.methods.traits.PerClientDownlink` operators ``held_versions``, ``downlink_sent``,
``client_broadcast`` and the backend ``downlink_base``; nothing in it is method-specific.

Option ``downlink`` of such a method: ``factored`` (the chain, dense per matrix where the chain
would be larger), ``dense`` (Algorithm 1's broadcast of ``W``), ``auto`` (factored, unless the
engine resolves it to dense because a server optimizer rewrites the aggregate:
:func:`fedgalore.job.resolve.method_options`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from fedgalore.federated.diagnostics import FactoredDelta
from fedgalore.protocol import downlink
from fedgalore.protocol.payload import Entry, GaLoreUpdate, Payload
from fedgalore.protocol.state import RoundContext, ServerState

__all__ = ["FactoredDownlink", "DOWNLINK_HELP"]

DOWNLINK_HELP = ("factored: the round's exact low-rank updates since the version the client holds (dense per matrix "
                 "when smaller); dense: W every round (Alg. 1); auto: factored unless a server optimizer rewrites the "
                 "update (then dense)")


class FactoredDownlink:
    """Mixin for methods with a ``downlink`` option (see the module docstring)."""

    options: Any

    def downlink_names(self) -> list[str]:
        """The server parameters (names in ``ServerState.params``) sent as chains."""
        raise NotImplementedError

    def downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Version 0 of :meth:`downlink_names` (fp32 copies): the public initial model every
        process builds identically, what a client that kept nothing yet holds. A backend whose
        clients keep their model takes it once, at start, from the freshly set-up model."""
        raise NotImplementedError

    @property
    def factored_downlink(self) -> bool:
        """``downlink: factored``, or ``auto`` left unresolved (a method built outside the engine)."""
        return getattr(self.options, "downlink", "dense") in ("factored", "auto")

    def downlink_meta(self, state: ServerState) -> dict[str, Any]:
        """Broadcast metadata: the model version under the factored downlink, else nothing."""
        return {"version": downlink.version(state)} if self.factored_downlink else {}

    def held_versions(self, state: ServerState, clients: Sequence[int]) -> dict[int, int]:
        """The version the server last sent each client (0: the public W_0), from its record."""
        return downlink.held_versions(state, clients)

    def downlink_sent(self, state: ServerState, clients: Sequence[int]) -> None:
        """Record that ``clients`` now hold the current version."""
        downlink.mark_sent(state, clients)

    def held_version(self, client_state: dict[str, Any] | None) -> int | None:
        """The version a client's own store holds (its cache); None when it keeps none."""
        if not self.factored_downlink or not client_state or client_state.get("downlink") is None:
            return None
        return client_state["downlink"].version

    def client_broadcast(self, state: ServerState, ctx: RoundContext, common: Payload, held: int | None) -> Payload:
        """The message for a client holding version ``held``: each chained matrix as its updates
        since then, or dense where the chain is gone or not smaller; the rest as in ``common``."""
        if not self.factored_downlink:
            return common
        return downlink.client_payload(state, common, self.downlink_names(), held)

    def reconstruct_targets(self, broadcast: Payload, client_state: dict[str, Any] | None, in_place: bool = False) -> dict[str, torch.Tensor]:
        """The chained matrices of the broadcast's model: dense as sent, or the client's cache
        with the chain applied (:func:`fedgalore.protocol.downlink.reconstruct`; ``in_place``:
        to the cache's own tensors)."""
        cache = None if client_state is None else client_state.get("downlink")
        return downlink.reconstruct(broadcast, self.downlink_names(), cache, in_place=in_place)

    def start_matrices(self, broadcast: Payload, client_state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
        """Client side: the chained matrices of ``W_k`` (rebuilt from the client's copy when the
        broadcast is a chain) and, for a client that keeps its model, its new copy. A chained
        matrix is applied to the client's own copy in place and returned as that tensor (no copy
        of every matrix, twice, per round): callers copy the matrices into the model and never
        write to them, so the cache is not the model being trained."""
        if "version" not in broadcast.meta:
            return {n: broadcast[n].materialize() for n in self.downlink_names()}
        start = self.reconstruct_targets(broadcast, client_state, in_place=client_state is not None)
        if client_state is not None:  # matrices sent dense are the message's tensors: the cache copies those
            own = {n: w.detach().float().clone() if n in broadcast.entries else w for n, w in start.items()}
            client_state["downlink"] = downlink.ClientCache(int(broadcast.meta["version"]), own, owned=True)
        return start

    def apply_round_update(self, state: ServerState, updates: Mapping[str, Entry], delta: bool = True,
                           factored: bool = False) -> dict[str, Any]:
        """``W ← W + ΔW`` for every chained matrix with :func:`fedgalore.protocol.downlink.apply_update`
        (what a client applies), the round's updates kept in the chain under ``factored``;
        returns each ``ΔW`` as an ``m × n`` matrix, or ``{}`` when not ``delta`` (a run
        without diagnostics: nothing reads it, and it costs an m × n product per matrix). The
        new ``W`` is the same bits either way. ``factored`` (with ``delta``): a GaLore update record's ``ΔW``
        as a :class:`~fedgalore.federated.diagnostics.FactoredDelta` instead, from its factors and the new
        ``W`` (``ΔW = a·W_old + LR = a/(1+a)·W_new + LR/(1+a)``), no ``m × n`` product formed."""
        if delta and factored:
            applied = {}
            for n, u in updates.items():
                downlink.apply_update(state.params[n], u, return_delta=False)
                applied[n] = factored_applied(u, state.params[n])
            if self.factored_downlink:
                downlink.record_update(state, updates)
            return applied
        applied = {n: downlink.apply_update(state.params[n], u, return_delta=delta) for n, u in updates.items()}
        if self.factored_downlink:
            downlink.record_update(state, updates)
        return applied if delta else {}


def factored_applied(update: Entry, w_new: torch.Tensor) -> Any:
    """The ``ΔW`` an update record applied, for the diagnostics, given the matrix after it (``W_new =
    (1+a)·W_old + LR``): a GaLore record as ``a/(1+a)·W_new + LR/(1+a)`` in factors, any other entry dense."""
    if not isinstance(update, GaLoreUpdate):
        return update.tensor.float() if hasattr(update, "tensor") else update.materialize()
    c = 1.0 / (1.0 + float(update.decay))
    pairs = [(a * c, b) for a, b in (t.factors() for t in update.terms)]
    return FactoredDelta.of(pairs, tuple(update.shape), float(update.decay) * c, w_new)
