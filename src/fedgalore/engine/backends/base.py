"""The backend interface: where the clients' local training T runs (sequential | ray | flower).

A backend is configured first (its options, checked at once), then bound to the run's
:class:`~fedgalore.engine.runtime.Runtime` by :meth:`Backend.start` — a backend with worker
processes starts them there — and asked each round to train a list of clients on one serialised
broadcast. Only serialised payloads cross a backend boundary.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from fedgalore.engine.events import ProgressSink
from fedgalore.engine.runtime import ClientJob, ClientResult, Runtime

__all__ = ["Backend"]


class Backend(abc.ABC):
    name = "backend"

    def start(self, runtime: Runtime) -> None:
        """Bind to the run's runtime before the first round (called once by the round loop)."""
        self.runtime = runtime

    @abc.abstractmethod
    def run_clients(self, broadcast, jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        """Run T for every job on the same broadcast (``bytes``, or a ``Payload`` for an
        :attr:`in_process` backend); results in job order. A per-client downlink
        hands one message per client (``dict[client, bytes | Payload]``): the factored downlink only to a backend
        whose :meth:`client_versions` reports client state, SCAFFOLD's c − c_i to every backend."""

    #: whether the clients keep their own model between rounds and rebuild the next one from a
    #: per-client (factored) downlink: they are handed exactly the message the ledger counts
    keeps_client_state: bool = False
    #: whether the clients run in this process (sequential): the loop hands them the broadcast
    #: as :class:`~fedgalore.protocol.payload.Payload` objects (each client works on its own copy,
    #: ``Runtime.execute``), gets the uploads back the same way and counts every message with
    #: ``encoded_size`` — the bytes the codec would write — instead of serialising it
    in_process: bool = False
    #: whether this backend simulates the clients (sequential, Ray). A simulation whose clients
    #: keep no model is handed the dense broadcast to train from, while the ledger counts what a
    #: client that kept its last global model would receive (the server's record of the version
    #: it sent each client). A deployment (Flower) ships what it counts: dense, unless its clients
    #: keep their model.
    simulated: bool = True

    def node_clients(self, cfg) -> "Clients | None":  # noqa: F821
        """The clients of a deployment whose nodes bring their own data (``federation.partition.
        kind: nodes``): names and example counts as the nodes report them
        (:class:`~fedgalore.job.clients.Clients` whose parts are stand-ins of those sizes), asked
        before the runtime is built. None (the default): this backend has no such nodes."""
        return None

    def evaluate_clients(self, runtime: Runtime, batch_size: int) -> dict[str, dict[str, float]] | None:
        """Federated evaluation: each client's metrics of the global model (``runtime.model``,
        loaded) on the test data it holds, ``{name: {"n": examples, metric: value}}``; None (the
        default) when the server evaluates every client itself."""
        return None

    #: bytes the last :meth:`evaluate_clients` sent and received (the round record's ``bytes_eval``)
    eval_bytes: int = 0
    #: records for the run's clients.jsonl from before the first round (round 0: nodes left out, and
    #: why); a backend that has some sets its own list (a tuple here: never shared and mutated)
    startup_records: Sequence[dict] = ()

    #: whether :meth:`run_clients_summed` runs a secure-aggregation protocol (``federation.secure_aggregation``)
    secure_aggregation: bool = False

    def run_clients_summed(self, broadcast, jobs: list[ClientJob], weights: list[int],
                           progress: ProgressSink | None = None) -> "tuple[list[ClientResult], Any]":
        """Secure aggregation (``federation.secure_aggregation``): train the jobs and return
        ``(results, summed)`` — each client's result without its upload (``stats["secagg_summed"]``
        true when its upload is in the sum) and the uploads' weighted mean ``Σ w_i x_i / Σ w_i``
        (``weights``: the integers w_i) as one Payload, or None. Only a deployment that runs a
        secure-aggregation protocol has it (fedgalore.flower.strategy.GridBackend)."""
        raise NotImplementedError(f"backend {self.name!r} runs no secure aggregation")

    def client_versions(self, method, clients: list[int]) -> dict[int, int | None]:
        """The model version each client's own store holds (``method.held_version``), for a
        per-client downlink on a backend that :attr:`keeps_client_state`. Default: ``None`` (dense)."""
        return {c: None for c in clients}

    def close(self) -> None:
        pass
