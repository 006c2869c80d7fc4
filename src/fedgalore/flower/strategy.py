"""The server side of the Flower app: fedgalore's round loop driving Flower SuperNodes.

:class:`FedGaLoreStrategy` is a Flower (Message API) ``Strategy`` whose steps map fedgalore's
operators onto Flower messages:

* ``configure_train`` — one ``train`` Message per sampled client, addressed to the SuperNode
  whose ``partition-id`` is that client; it carries the method's serialised broadcast (the
  output of ``method.broadcast``: global tensors, synchronised second-moment factors, round
  seed) as an :class:`~flwr.app.ArrayRecord` and the job (round, client, round seed, resolved
  config, partition) as a :class:`~flwr.app.ConfigRecord`;
* ``aggregate_train`` — turns the replies (serialised uploads: deltas / low-rank factors,
  second-moment views, seeds) back into :class:`~fedgalore.backends.base.ClientResult`s; a
  missing reply or a reply with an error becomes a dropped client.

``start`` does not use Flower's generic round loop: it runs fedgalore's own
:class:`~fedgalore.federated.server.Federation` (sampling, ledger, upload validation, retries,
A = ``method.aggregate``, S = ``method.synchronize``, evaluation, checkpoints) with a backend
that executes clients through the Grid. The round logic is therefore the same code as with the
sequential and Ray backends, and same seed → same results. Flower's built-in FedAvg is not used:
it averages ArrayRecords and cannot carry moment views or seeded factors.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedgalore.backends.base import Backend, ClientJob, ClientResult
from fedgalore.federated.partition import encode_partition
from fedgalore.flower.codec import blob_to_record, record_to_blob

__all__ = ["FedGaLoreStrategy", "GridBackend"]

log = logging.getLogger("fedgalore")


class GridBackend(Backend):
    """Runs a round's clients on Flower SuperNodes through a Grid (via the strategy)."""

    name = "flower"

    def __init__(self, strategy: "FedGaLoreStrategy", grid: Grid, runtime=None) -> None:
        self.strategy, self.grid, self.runtime = strategy, grid, runtime
        self.last_round_bytes: dict[str, int] = {}

    def run_clients(self, broadcast: bytes, jobs: list[ClientJob], progress=None) -> list[ClientResult]:
        self.strategy.pending_jobs = jobs
        arrays = blob_to_record(broadcast)
        server_round = jobs[0].round + 1 if jobs else 0
        for j in jobs:
            if progress is not None:
                steps = self.runtime.batches(j.client, j.round)[1] if self.runtime is not None else 0
                progress.client_start(j.round, j.client, steps)
        messages = list(self.strategy.configure_train(server_round, arrays, ConfigRecord(), self.grid))
        replies = self.grid.send_and_receive(messages, timeout=self.strategy.timeout)
        self.strategy.aggregate_train(server_round, replies)
        results = self.strategy.last_results
        for r, j in zip(results, jobs):
            if progress is not None:
                progress.client_end(j.round, j.client, {"time": r.time, "error": r.error, **r.stats})
        up = sum(len(r.upload) for r in results if r.upload is not None)
        self.last_round_bytes = {"broadcast": len(broadcast) * len(jobs), "uploads": up, "total": len(broadcast) * len(jobs) + up}
        return results


class FedGaLoreStrategy(Strategy):
    """fedgalore's method (T, A, S) as a Flower strategy; see the module docstring."""

    def __init__(self, cfg, *, run_dir: str | Path | None = None, timeout: float = 3600.0, progress=None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.timeout = float(timeout)
        self.progress = progress
        self.cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
        self.node_of: dict[int, int] = {}
        self.pending_jobs: list[ClientJob] = []
        self.last_results: list[ClientResult] = []
        self._parts_blob = b""
        self._key = ""

    # ------------------------------------------------------------------ Flower steps
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        msgs = []
        for j in self.pending_jobs:
            job = ConfigRecord({
                "round": j.round, "total_rounds": j.total_rounds, "client": j.client, "round_seed": str(j.round_seed),
                "config": self.cfg_json, "partition": self._parts_blob, "key": self._key, **dict(config),
            })
            content = RecordDict({"broadcast": arrays, "job": job})
            msgs.append(Message(content=content, dst_node_id=self.node_of[j.client], message_type=MessageType.TRAIN,
                                group_id=str(server_round)))
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        by_client: dict[int, ClientResult] = {}
        for msg in replies:
            if msg.has_error():
                log.warning("flower: node %s replied with error %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            res = msg.content["result"]
            client = int(res["client"])
            upload = record_to_blob(msg.content["upload"]) if "upload" in msg.content else None
            error = str(res["error"]) or None
            by_client[client] = ClientResult(client, upload, error, float(res["time"]), json.loads(str(res["stats"])))
        self.last_results = [
            by_client.get(j.client) or ClientResult(j.client, None, "no reply from the SuperNode (timeout or node error)")
            for j in self.pending_jobs
        ]
        ok = [r for r in self.last_results if r.error is None]
        return None, MetricRecord({"clients_ok": len(ok), "clients_failed": len(self.last_results) - len(ok)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return []  # the server evaluates the global model itself, as with every backend

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("FedGaLoreStrategy: method=%s, %d clients, %d rounds", self.cfg.method.name,
                 self.cfg.federation.num_clients, self.cfg.federation.rounds)

    # ------------------------------------------------------------------ the run
    def discover_nodes(self, grid: Grid, wait_s: float = 120.0) -> dict[int, int]:
        """Ask every SuperNode for its ``partition-id``; returns client id → node id."""
        m = self.cfg.federation.num_clients
        deadline = time.monotonic() + wait_s
        while len(nodes := list(grid.get_node_ids())) < m and time.monotonic() < deadline:
            time.sleep(1.0)
        msgs = [Message(content=RecordDict({"q": ConfigRecord({"ask": "partition-id"})}), dst_node_id=n,
                        message_type=MessageType.QUERY) for n in nodes]
        node_of: dict[int, int] = {}
        for rep in grid.send_and_receive(msgs, timeout=self.timeout):
            if not rep.has_error():
                node_of[int(rep.content["whoami"]["partition-id"])] = int(rep.metadata.src_node_id)
        missing = [c for c in range(m) if c not in node_of]
        if missing:
            raise RuntimeError(
                f"federation.num_clients={m} but no SuperNode reported partition-id {missing[:5]}; start one "
                f"SuperNode per client with --node-config 'partition-id=<i> num-partitions={m}' "
                f"(simulation: options.num-supernodes >= {m})"
            )
        return node_of

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, **_ignored):
        """Run the whole federation on ``grid``; returns fedgalore's RunResult."""
        from fedgalore.federated.server import Federation

        if timeout is not None:
            self.timeout = float(timeout)
        if num_rounds is not None:
            self.cfg.federation.rounds = int(num_rounds)
        self.cfg.backend.name, self.cfg.backend.options = "flower", {}
        fed_cfg = type(self.cfg).from_dict({**self.cfg.to_dict(), "backend": {"name": "sequential", "options": {}}})
        fed = Federation(fed_cfg, run_dir=self.run_dir, progress=self.progress)  # refuses a taken run dir first
        # nodes build their runtime from the config the Federation runs (its method's own options)
        self.cfg_json = json.dumps({**fed.cfg.to_dict(), "backend": {"name": "flower", "options": {}}}, sort_keys=True)
        self.node_of = self.discover_nodes(grid)
        fed.backend = GridBackend(self, grid, fed.runtime)  # the Federation's loop, clients on SuperNodes
        self._parts_blob = encode_partition(fed.runtime.parts)
        self._key = hashlib.sha256(self.cfg_json.encode() + self._parts_blob).hexdigest()[:16]
        return fed.run()
