"""The server side of the Flower app: fedgalore's round loop driving Flower SuperNodes.

:class:`FedGaLoreStrategy` is a Flower (Message API) ``Strategy`` whose steps map fedgalore's
operators onto Flower messages:

* ``configure_train`` — one ``train`` Message per client of the round, addressed to the
  SuperNode whose ``partition-id`` is that client; it carries the method's serialised broadcast
  (the output of ``method.broadcast``: global tensors, synchronised second-moment factors, round
  seed) as an :class:`~flwr.app.ArrayRecord` and the job (round, client, round seed, resolved
  config, partition) as a :class:`~flwr.app.ConfigRecord`;
* ``aggregate_train`` — counts the replies (the uploads themselves are read back by
  :func:`client_results`: a missing reply or a reply with an error becomes a dropped client).

``start`` does not use Flower's generic round loop: it runs fedgalore's own
:class:`~fedgalore.engine.loop.Federation` (sampling, ledger, upload validation, retries,
A = ``method.aggregate``, S = ``method.synchronize``, evaluation, checkpoints) with
``backend=GridBackend(...)``, which trains each round's clients through the Grid. The round logic
is therefore the same code as with the sequential and Ray backends, and same seed → same
results. Flower's built-in FedAvg is not used: it averages ArrayRecords and cannot carry moment
views or seeded factors.

Nodes come and go: before each round and each federated evaluation the backend looks for
SuperNodes it has not seen (a restarted SuperNode comes back under a new node id, or — with
SuperNode authentication — under its registered one, holding nothing of the run) and moves a
client to the node that reports its site or ``partition-id`` (:meth:`GridBackend.refresh_nodes`).
A node that does not answer within ``timeout`` seconds is dropped from that round (``join_timeout``
for a wave with a node that has not yet trained or evaluated in this run: its first job builds its
runtime); a round retried for too few uploads waits twice as long at each retry
(:meth:`GridBackend._retry_wait`). ``resume``
continues a run from its run directory's last checkpoint (:meth:`FedGaLoreStrategy.start`).
Every message's payload size is written to ``<run dir>/flower_messages.jsonl`` (what was put into
each message, what the node says it received, what came back), so the ledger can be checked
against the wire.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedgalore.engine.backends.base import Backend
from fedgalore.job.clients import Clients
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.events import ProgressSink
from fedgalore.records.liveness import is_finished
from fedgalore.engine.loop import Federation, RunResult
from fedgalore.engine.runtime import ClientJob, ClientResult, Runtime
from fedgalore.federated.partition import encode_partition
from fedgalore.flower.codec import blob_to_record, record_to_blob, tensors_to_record
from fedgalore.jsonl import append_jsonl, read_jsonl

__all__ = ["FedGaLoreStrategy", "GridBackend", "client_results", "MESSAGES_FILE"]

log = logging.getLogger("fedgalore")

#: per message, the payload bytes sent, received by the node and uploaded (GridBackend)
MESSAGES_FILE = "flower_messages.jsonl"


def _array_bytes(record: ArrayRecord) -> int:
    """The bytes of an ArrayRecord's arrays (what a payload occupies in a message)."""
    return sum(len(a.data) for a in record.values())


def _who(rec: dict) -> str:
    return f"{rec['node']} (site {rec['site']})" if rec.get("site") else f"{rec['node']}"


def _say(line: str) -> None:
    """One line in the run's log (the ServerApp's output, which ``flwr run --stream`` shows)."""
    print(f"fedgalore: {line}", flush=True)


class GridBackend(Backend):
    """Trains a round's clients on Flower SuperNodes through a Grid: one ``train`` message per
    client (:meth:`FedGaLoreStrategy.configure_train`), uploads read back from the replies."""

    name = "flower"
    #: a deployment: what the ledger counts is what the SuperNodes are sent. Each node keeps its
    #: model between rounds in its ``Context.state`` (fedgalore.flower.client_app), so a factored
    #: downlink's chain is sent from the version each node reported holding.
    simulated = False
    keeps_client_state = True
    #: federation.secure_aggregation: Flower's SecAgg+ (:meth:`run_clients_summed`)
    secure_aggregation = True

    def __init__(self, strategy: "FedGaLoreStrategy", grid: Grid) -> None:
        self.strategy, self.grid = strategy, grid
        self.node_of: dict[int, int] = {}
        #: the model version each client's node reported holding (None: unknown or none → dense)
        self.held: dict[int, int | None] = {}
        self.job: dict[str, str | bytes] = {}
        self.last_round_bytes: dict[str, int] = {}
        #: kind nodes: the nodes left out at the start (bad data), for the run's clients.jsonl
        self.startup_records: list[dict] = []
        #: kind nodes: what each client's node reported (site, n, n_test, label_counts)
        self.sites: dict[int, dict] = {}
        #: nodes already asked who they are (each node is asked once)
        self.asked: set[int] = set()
        #: where each message's payload sizes are appended (set by FedGaLoreStrategy.start)
        self.log_path: Path | None = None
        self._round = 0  # the 1-based round of the last train wave (for the evaluation's records)
        #: nodes that have answered a train or evaluate message of this run: their runtime (model,
        #: data) is built; a wave that includes any other node waits ``join_timeout`` (:meth:`_wait`)
        self.ready: set[int] = set()
        self._versions: dict[int, int | None] = {}  # what client_versions told the round loop this round
        #: (round, attempt) of the last train wave: a wave for the same round is a retry (:meth:`_retry_wait`)
        self._wave: tuple[int, int] = (-1, 0)

    def start(self, runtime: Runtime) -> None:
        """Find the SuperNode of every client; the jobs carry the resolved config and partition
        (nodes build their runtime from them, once, cached under ``key``). With site-local data
        (``partition.kind: nodes``) the nodes were found by :meth:`node_clients` and the jobs carry
        the clients' sizes instead of a partition."""
        self.runtime = runtime
        cfg_json = json.dumps({**runtime.cfg.to_dict(), "backend": {"name": "flower", "options": {}}}, sort_keys=True)
        if runtime.cfg.federation.partition.kind == "nodes":
            sizes = json.dumps([int(len(p)) for p in runtime.parts])
            self.job = {"config": cfg_json, "sizes": sizes, "key": hashlib.sha256((cfg_json + sizes).encode()).hexdigest()[:16]}
            return
        parts = encode_partition(runtime.parts)
        self.job = {"config": cfg_json, "partition": parts, "key": hashlib.sha256(cfg_json.encode() + parts).hexdigest()[:16]}
        self.node_of, asked = self.strategy.discover_nodes(self.grid, runtime.cfg.federation.num_clients, with_asked=True)
        self.asked.update(asked)

    # ------------------------------------------------------------------ nodes that come and go
    def refresh_nodes(self) -> None:
        """Map clients to SuperNodes that joined since the last look. A restarted SuperNode comes
        back under a new node id (with SuperNode authentication: under its registered id); each
        node not seen before is asked once who it is (its site and data, or its ``partition-id``),
        and the client it names moves to it. The moved client's node holds nothing of this run but
        ``W_0``, which every node builds, so it is sent the chain since ``W_0`` (or the dense matrix
        where the server no longer keeps that chain). A node naming a site this run does not have, or
        other data than its site had when the run started, is left out with one line."""
        try:
            ids = sorted(int(n) for n in self.grid.get_node_ids())
        except Exception as exc:  # noqa: BLE001 - the SuperLink did not answer: go on with the nodes known
            log.warning("flower: could not list the SuperNodes (%s)", exc)
            return
        mapped = set(self.node_of.values())
        new = [n for n in ids if n not in mapped and n not in self.asked]
        if not new:
            return
        self.asked.update(new)
        cfg = self.runtime.cfg
        if cfg.federation.partition.kind == "nodes":
            names = {self.sites[j]["site"]: j for j in self.sites}
            reports, failed = self.strategy.ask_sites(self.grid, cfg, new)
            for r in failed:
                _say(f"node {_who(r)} joined and was left out: {r['error']}")
            for site, rep in sorted(reports.items()):
                j = names.get(site)
                if j is None:
                    _say(f"node {rep['node']} (site {site}) joined a running federation of sites {', '.join(sorted(names))}; "
                         "it is not one of them and is left out (start a new run to add a site)")
                elif (int(rep["n"]), rep["label_counts"]) != (int(self.sites[j]["n"]), self.sites[j]["label_counts"]):
                    _say(f"node {rep['node']} (site {site}) rejoined with other data ({rep['n']} training rows, the run "
                         f"started with {self.sites[j]['n']}); left out — restart it with the site's original files")
                else:
                    self._move(j, int(rep["node"]), f"site {site}")
        else:
            for pid, node in sorted(self.strategy.ask_partition_ids(self.grid, new).items()):
                if 0 <= pid < len(self.runtime.parts):
                    self._move(pid, node, f"partition-id {pid}")

    def _move(self, client: int, node: int, what: str) -> None:
        old = self.node_of.get(client)
        self.node_of[client] = node
        if old is not None:
            self.asked.add(int(old))  # the old node (dead, or replaced) is not asked who it is
        self.held[client] = 0  # a node new to this run holds W_0 (its runtime builds it): the chain since W_0, or dense
        _say(f"client {client} ({what}) is now on node {node} (was {old})")

    # ------------------------------------------------------------------ site-local data (kind nodes)
    def node_clients(self, cfg: FederatedConfig) -> Clients:
        """Ask every SuperNode which site it is and what it holds (its own data, read and checked
        against the task on the node: fedgalore.flower.client_app.whoami); client ``j`` = the
        ``j``-th site in sorted name order. A node whose data does not fit the task is left out
        with its one-line reason (:attr:`startup_records`, the run's clients.jsonl, and the log)."""
        reports, self.startup_records = self.strategy.discover_sites(self.grid, cfg)
        self.asked.update(int(r["node"]) for r in reports.values())
        self.asked.update(int(r["node"]) for r in self.startup_records)
        for r in self.startup_records:
            _say(f"node {_who(r)} left out: {r['error']}")
        if len(reports) < 2:
            raise ConfigError(f"federation.partition.kind=nodes: {len(reports)} SuperNode(s) with usable data joined "
                              f"({len(self.startup_records)} left out); a federation needs at least 2 — start more "
                              "SuperNodes with --node-config \"data='...' site='...'\" or fix their data")
        names = sorted(reports)
        self.node_of = {j: int(reports[s]["node"]) for j, s in enumerate(names)}
        parts, cats, start = [], [], 0
        for s in names:
            counts = [int(c) for c in reports[s]["label_counts"]]
            # stand-ins of the node's size: the server holds no rows; a node whose size the server view withholds
            # (client-level DP: fedgalore.privacy.view) reports -1 and stands in as one row
            n = int(reports[s]["n"]) if int(reports[s]["n"]) >= 0 else 1
            parts.append(np.arange(start, start + n))
            cats.append(np.repeat(np.arange(len(counts)), counts) if sum(counts) == n else np.zeros(n, dtype=np.int64))
            start += n
        self.sites = {j: {"site": s, **reports[s]} for j, s in enumerate(names)}
        return Clients(parts, np.zeros(0, dtype=np.int64), np.concatenate(cats).astype(np.int64), names)

    def evaluate_clients(self, runtime: Runtime, batch_size: int) -> dict[str, dict[str, float]] | None:
        """Federated evaluation (kind nodes): every node evaluates the global model on its own test
        data. The model goes out dense — the adapted matrices, the adapters and the head (what the
        methods' ``load_global`` writes) — once per node; counted in :attr:`eval_bytes`."""
        if runtime.cfg.federation.partition.kind != "nodes" or not runtime.view.site_eval:
            return None  # per-site metrics only where the server view declares them (client-level DP: client_eval)
        self.refresh_nodes()
        model = runtime.model
        targets = tuple(f"{m}." for m in runtime.target_modules)
        heads = set(runtime.head_params)
        sent = {n: p.detach() for n, p in model.named_parameters()
                if p.requires_grad or n in heads or any(t in n or n.startswith(t) for t in targets)}
        arrays = tensors_to_record(sent)
        size = sum(len(a.data) for a in arrays.values())
        msgs = [Message(content=RecordDict({"model": arrays, "job": ConfigRecord({**self.job, "client": int(c),
                                                                                  "eval_batch_size": int(batch_size)})}),
                        dst_node_id=int(node), message_type=MessageType.EVALUATE)
                for c, node in self.node_of.items()]
        out: dict[str, dict[str, float]] = {}
        got: dict[int, int] = {}
        replies = list(self.grid.send_and_receive(msgs, timeout=self._wait(self.node_of.values())))
        sent_to = _sent_to(msgs)
        for rep in replies:
            if not rep.has_error():
                self.ready.add(_from_node(rep, sent_to))
            if rep.has_error() or "metrics" not in rep.content:
                log.warning("flower: node %s did not evaluate (%s)", _from_node(rep, sent_to),
                            rep.error.reason if rep.has_error() else "no metrics")
                continue
            res = rep.content["metrics"]
            got[_from_node(rep, sent_to)] = int(res.get("received", -1))
            if str(res.get("error", "")):
                log.warning("flower: site %s could not evaluate: %s", res["site"], res["error"])
                continue
            out[str(res["site"])] = {"n": int(res["n"]), **json.loads(str(res["values"]))}
        self.eval_bytes = size * len(msgs)
        for c, node in self.node_of.items():
            self._log({"round": self._round, "type": "evaluate", "client": int(c), "node": int(node),
                       "sent": _array_bytes(arrays), "node_received": got.get(int(node))})
        return {s: out[s] for s in sorted(out)} or None

    def _wait(self, nodes: Iterable[int]) -> float:
        """Seconds a wave of messages to ``nodes`` waits for their replies: the round ``timeout``,
        or ``join_timeout`` when one of them has not yet answered a train or evaluate message of
        this run — its first one builds the node's runtime (loading the model, reading and
        tokenising its data), which on a loaded machine takes longer than a short round timeout.
        A node that never answers therefore costs one wave ``join_timeout`` once, then ``timeout``
        per round (a restarted node, under a new id, is waited for as a new node)."""
        cold = any(int(n) not in self.ready for n in nodes)
        return max(self.strategy.timeout, self.strategy.join_timeout) if cold else self.strategy.timeout

    def _retry_wait(self, round_: int, wait: float) -> float:
        """The wait of a train wave, doubled for every retry of the same round: ``wait · 2^a`` at
        attempt ``a``. A retry follows a wave whose replies did not come in time; a SuperNode
        handles one message at a time, so a node that was merely slow is still working on the
        last attempt's job when the retry's arrives, and a retry that waited only ``timeout``
        again would miss it again, every attempt (seen on a loaded 2-core machine: three attempts
        of 45 s, no reply from any of three healthy nodes). A node that is really gone costs
        ``timeout · (2^(r+1) − 1)`` over ``r`` retries instead of ``timeout · (r + 1)``."""
        last, attempt = self._wave
        self._wave = (round_, attempt + 1 if round_ == last else 0)
        return wait * 2 ** self._wave[1]

    def _log(self, rec: dict) -> None:
        if self.log_path is not None:
            append_jsonl(self.log_path, rec)

    def run_clients_summed(self, broadcast: bytes | dict[int, bytes], jobs: list[ClientJob], weights: list[int],
                           progress: ProgressSink | None = None) -> tuple[list[ClientResult], object]:
        """One round under Flower's SecAgg+ (fedgalore.flower.secagg.secure_round): each client's
        node is sent its broadcast and job as the workflow's FitIns, trains, and uploads its arrays
        masked; the server learns their weighted mean (``weights``: each client's integer weight) and
        each client's result record in the clear. A node lost in any stage is handled as Flower
        handles it (its masks recovered from its neighbours' shares); its client counts as dropped."""
        from fedgalore.flower.secagg import from_summed, secure_round

        self.refresh_nodes()
        for j in jobs:
            if progress is not None:
                progress.client_start(j.round, j.client, self.runtime.batches(j.client, j.round)[1])
        server_round = jobs[0].round + 1 if jobs else 0
        sa = self.runtime.cfg.federation.secure_aggregation
        instructions: dict[int, tuple[bytes, dict]] = {}
        for j, w in zip(jobs, weights):
            node = int(self.node_of[j.client])
            if node in instructions:
                raise RuntimeError(f"secure aggregation: clients {instructions[node][1]['client']} and {j.client} are on one "
                                   "SuperNode; SecAgg+ masks per node — run one SuperNode per client")
            blob = broadcast[j.client] if isinstance(broadcast, dict) else broadcast
            instructions[node] = (blob, {**self.job, "round": j.round, "total_rounds": j.total_rounds,
                                         "round_seed": str(j.round_seed), "client": int(j.client), "secagg_weight": int(w)})
        max_weight = float(sa.max_weight) if sa.max_weight is not None else float(max(weights, default=1))
        wait = self._retry_wait(jobs[0].round if jobs else -1, self._wait(instructions))
        waves = _SecureWaves(self.grid)
        try:
            sr = secure_round(waves, sa, instructions, server_round=server_round, max_weight=max_weight, timeout=wait)
        except Exception as exc:  # noqa: BLE001 - the protocol failed: the round's clients are dropped, the loop retries
            log.warning("flower: SecAgg+ round %s failed: %s", server_round, exc)
            from fedgalore.flower.secagg import SecureRound

            sr = SecureRound(halted=f"SecAgg+ failed: {type(exc).__name__}: {exc}".splitlines()[0])
        by_client = {int(r["client"]): (node, r) for node, r in sr.results.items()}
        self.ready.update(sr.results)
        results: list[ClientResult] = []
        summed = set(by_client) if sr.mean is not None else set()  # clients whose masked upload is in the mean
        for j in jobs:
            node = int(self.node_of[j.client])
            self.held[j.client] = None
            if j.client not in by_client:
                why = waves.held_back.get(node) or sr.halted or "no masked upload from its SuperNode in the SecAgg+ round (dropped, timed out or failed to train)"
                results.append(ClientResult(j.client, None, f"secure aggregation: {why}"))
                continue
            _, r = by_client[j.client]
            held = int(r.get("held_version", -1))
            self.held[j.client] = held if held >= 0 else None
            stats = {**json.loads(str(r.get("stats", "{}"))), "secagg_summed": j.client in summed}
            results.append(ClientResult(j.client, None, str(r.get("error", "")) or None, float(r.get("time", 0.0)), stats,
                                        origin="site" if str(r.get("origin", "")) == "site" else "client"))
        mean = None
        if sr.mean is not None and by_client:
            layout = str(next(iter(by_client.values()))[1]["layout"])
            mean = from_summed(layout, sr.mean)
        self._round = server_round
        for j in jobs:
            node = int(self.node_of[j.client])
            self._log({"round": server_round, "type": "train_secagg", "client": int(j.client), "node": node,
                       "sent": len(instructions[node][0]), "server_received": waves.received.get(node),
                       "masked_head": waves.masked.get(node), "summed": j.client in summed,
                       "held_back": waves.held_back.get(node)})
        for r, j in zip(results, jobs):
            if progress is not None:
                progress.client_end(j.round, j.client, {"time": r.time, "error": r.error, **r.stats})
        up = sum(waves.received.values())
        sent = sum(len(b) for b, _ in instructions.values())
        self.last_round_bytes = {"broadcast": sent, "uploads": up, "total": sent + up}
        self.secure_received = dict(waves.received)
        return results, mean

    def client_versions(self, method, clients: list[int]) -> dict[int, int | None]:
        """What each node holds: the version it last reported, W_0 (0) for a node that has not
        trained in this run, None (dense) after a missing reply or a node that kept nothing."""
        if not method.run_traits.per_client_downlink:
            return {c: None for c in clients}
        self.refresh_nodes()  # before the messages are built for what each client's node holds
        self._versions = {c: self.held.get(c, 0) for c in clients}
        return dict(self._versions)

    def run_clients(self, broadcast: bytes | dict[int, bytes], jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        """Send each job's client its broadcast (see the class doc) and read the uploads back; a
        client whose node does not reply within ``timeout`` is dropped with an error."""
        self.refresh_nodes()
        for j in jobs:
            if progress is not None:
                progress.client_start(j.round, j.client, self.runtime.batches(j.client, j.round)[1])
        server_round = jobs[0].round + 1 if jobs else 0
        config = ConfigRecord({
            **self.job, "round": jobs[0].round if jobs else 0, "total_rounds": jobs[0].total_rounds if jobs else 0,
            "round_seed": str(jobs[0].round_seed if jobs else 0),
            "clients": [j.client for j in jobs], "nodes": [self.node_of[j.client] for j in jobs],
        })
        arrays = {c: blob_to_record(b) for c, b in broadcast.items()} if isinstance(broadcast, dict) else blob_to_record(broadcast)
        messages = list(self.strategy.configure_train(server_round, arrays, config, self.grid))
        wait = self._retry_wait(jobs[0].round if jobs else -1, self._wait(int(m.metadata.dst_node_id) for m in messages))
        replies = list(self.grid.send_and_receive(messages, timeout=wait))
        sent_to = _sent_to(messages)
        self.ready.update(_from_node(r, sent_to) for r in replies if not r.has_error())
        client_of = {m.metadata.message_id: int(m.content["job"]["client"]) for m in messages if m.metadata.message_id}
        results = client_results([j.client for j in jobs], replies, client_of)
        for j in jobs:
            self.held[j.client] = None  # no reply: unknown
        wire = {int(m.content["job"]["client"]): {"node": int(m.metadata.dst_node_id), "sent": _array_bytes(m.content["broadcast"]),
                                                  "node_received": None, "upload": None} for m in messages}
        for msg in replies:
            if not msg.has_error() and "result" in msg.content:
                res = msg.content["result"]
                held = int(res["held_version"]) if "held_version" in res else -1
                self.held[int(res["client"])] = held if held >= 0 else None
                w = wire.get(int(res["client"]))
                if w is not None:
                    w["node_received"] = int(res["received"]) if "received" in res else None
                    w["upload"] = _array_bytes(msg.content["upload"]) if "upload" in msg.content else None
        self._round = server_round
        versions, self._versions = self._versions, {}
        for c, w in wire.items():  # held: the model version the message was built for (None: dense)
            self._log({"round": server_round, "type": "train", "client": c, "held": versions.get(c), **w})
        for r, j in zip(results, jobs):
            if progress is not None:
                progress.client_end(j.round, j.client, {"time": r.time, "error": r.error, **r.stats})
        up = sum(len(r.upload) for r in results if r.upload is not None)
        sent = sum(len(broadcast[j.client]) for j in jobs) if isinstance(broadcast, dict) else len(broadcast) * len(jobs)
        self.last_round_bytes = {"broadcast": sent, "uploads": up, "total": sent + up}
        return results


class _SecureWaves:
    """The Grid as the SecAgg+ workflow sees it, with two things added (a wrapper: every call goes to
    the real Grid). (1) Each collect-stage reply is checked before Flower sums it: a reply whose
    layout (fedgalore.flower.secagg.summable, in its clear metrics) differs from the round's majority
    would be summed element by element with arrays of other shapes, so it is held back — to the
    workflow that node dropped out, and Flower recovers its masks. (2) What the server received from
    each node in every stage is kept for flower_messages.jsonl: bytes, and for the masked vector a
    few of its first values (masked: uniform over the modulus, not the client's update)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.received: dict[int, int] = {}
        self.masked: dict[int, list[int]] = {}
        self.held_back: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.common import bytes_to_ndarray
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        sent_to = _sent_to(messages)
        ok = [r for r in replies if not r.has_error()]
        for r in ok:
            node = _from_node(r, sent_to)
            cfg = r.content.config_records.get(RECORD_KEY_CONFIGS)
            self.received[node] = self.received.get(node, 0) + _content_bytes(r.content)
            if cfg is not None and Key.MASKED_PARAMETERS in cfg:
                first = bytes_to_ndarray(cfg[Key.MASKED_PARAMETERS][1] if len(cfg[Key.MASKED_PARAMETERS]) > 1
                                         else cfg[Key.MASKED_PARAMETERS][0]).ravel()
                self.masked[node] = [int(x) for x in first[:4]]
        layouts = {}
        for r in ok:
            if "fitres.metrics" in r.content.config_records:
                layouts[_from_node(r, sent_to)] = str(r.content.config_records["fitres.metrics"].get("layout", ""))
        if len(set(layouts.values())) > 1:
            votes: dict[str, int] = {}
            for lay in layouts.values():
                votes[lay] = votes.get(lay, 0) + 1
            major = max(votes, key=lambda k: (votes[k], k))
            bad = {n for n, lay in layouts.items() if lay != major}
            for n in bad:
                self.held_back[n] = ("its upload's layout differs from the round's majority (e.g. another number of GaLore "
                                     "refreshes): SecAgg+ sums arrays of one layout; give every client the same train.local_steps")
            replies = [r for r in replies if r.has_error() or _from_node(r, sent_to) not in bad]
        return replies


def _content_bytes(content: RecordDict) -> int:
    """The payload bytes of a message's records: every array's data, and the bytes and strings of
    every config record (SecAgg+ sends keys, shares and masked vectors there)."""
    n = sum(_array_bytes(a) for a in content.array_records.values())
    for rec in content.config_records.values():
        for v in rec.values():
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, (bytes, str)):
                    n += len(x)
    return n


def _reply_result(msg: Message) -> ClientResult | None:
    """The client's result carried by a ``train`` reply (None for a node-level error)."""
    if msg.has_error():
        return None
    res = msg.content["result"]
    upload = record_to_blob(msg.content["upload"]) if "upload" in msg.content else None
    return ClientResult(int(res["client"]), upload, str(res["error"]) or None, float(res["time"]), json.loads(str(res["stats"])),
                        origin="site" if str(res.get("origin", "")) == "site" else "client")


def _sent_to(messages: Iterable[Message]) -> dict[str, int]:
    """Message id → destination node of messages the Grid has sent (it sets their ids)."""
    return {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages if m.metadata.message_id}


def _from_node(reply: Message, sent_to: dict[str, int]) -> int:
    """The node a reply is about: an error the SuperLink makes up for a node (e.g. "Node
    Unavailable") comes from the SuperLink itself, so it is found by the message it answers."""
    return sent_to.get(reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id))


def client_results(clients: Sequence[int], replies: Iterable[Message], client_of: dict[str, int] | None = None) -> list[ClientResult]:
    """One result per client, in ``clients`` order; a client without a reply is dropped with an error
    (the SuperLink's reason, e.g. "Node Unavailable", when ``client_of`` — message id → client —
    finds the message an error reply answers)."""
    by_client: dict[int, ClientResult] = {}
    for rep in replies:
        r = _reply_result(rep)
        if r is not None:
            by_client[r.client] = r
            continue
        c = (client_of or {}).get(rep.metadata.reply_to_message_id)
        reason = rep.error.reason.strip().splitlines()[0] if rep.error.reason else f"error code {rep.error.code}"
        log.warning("flower: client %s: the SuperNode replied with an error: %s", c, reason)
        if c is not None:
            # the reason may be the ClientApp's own exception text: recorded as a client's (fedgalore.privacy.view)
            by_client[c] = ClientResult(c, None, f"SuperNode error: {reason}", origin="client")
    return [by_client.get(c) or ClientResult(c, None, "no reply from the SuperNode (timeout or node error)") for c in clients]


class FedGaLoreStrategy(Strategy):
    """fedgalore's method (T, A, S) as a Flower strategy; see the module docstring."""

    def __init__(self, cfg: FederatedConfig, *, run_dir: str | Path | None = None, timeout: float = 3600.0,
                 progress: ProgressSink | None = None, resume: bool = False, join_timeout: float | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.timeout = float(timeout)
        #: seconds to wait for a node's first answer (which site, which partition): it includes the
        #: node's cold start (installing the app, starting its ClientApp, importing torch), so a
        #: short round ``timeout`` must not drop every node before the first round (default: the
        #: larger of ``timeout`` and 300 s)
        self.join_timeout = float(join_timeout) if join_timeout is not None else max(self.timeout, 300.0)
        self.progress = progress
        #: continue the run in ``run_dir`` from its last checkpoint (:meth:`start`)
        self.resume = bool(resume)
        #: kind nodes: how long to wait for SuperNodes to join, and how long no new one must join
        #: before the run starts when federation.num_clients is not given
        self.nodes_wait, self.settle_s = 120.0, 5.0

    # ------------------------------------------------------------------ Flower steps
    def configure_train(self, server_round: int, arrays: ArrayRecord | dict[int, ArrayRecord], config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One ``train`` message per entry of ``config["clients"]``, to the node ``config["nodes"]``
        names for it; the job is the rest of ``config`` plus the client id. ``arrays``: the
        broadcast, or one per client (a per-client downlink: SCAFFOLD's c − c_i)."""
        common = {k: v for k, v in config.items() if k not in ("clients", "nodes")}
        per = arrays if isinstance(arrays, dict) else None
        return [Message(content=RecordDict({"broadcast": per[int(c)] if per is not None else arrays,
                                            "job": ConfigRecord({**common, "client": int(c)})}),
                        dst_node_id=int(node), message_type=MessageType.TRAIN, group_id=str(server_round))
                for c, node in zip(config["clients"], config["nodes"])]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Counts of the clients that trained and that failed (the round loop aggregates the uploads
        themselves with the method's operator A)."""
        results = [r for r in map(_reply_result, replies) if r is not None]
        ok = sum(1 for r in results if r.error is None)
        return None, MetricRecord({"clients_ok": ok, "clients_failed": len(results) - ok})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return []  # the server evaluates the global model itself, as with every backend

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("FedGaLoreStrategy: method=%s, %d clients, %d rounds", self.cfg.method.name,
                 self.cfg.federation.num_clients, self.cfg.federation.rounds)

    # ------------------------------------------------------------------ the run
    @staticmethod
    def view_of(cfg: FederatedConfig):
        """The run's server view (fedgalore.privacy.view): what the server may record about a site."""
        from fedgalore.privacy.view import view_of

        return view_of(cfg)

    def discover_sites(self, grid: Grid, cfg: FederatedConfig, wait_s: float | None = None) -> tuple[dict[str, dict], list[dict]]:
        """Kind nodes: wait for the SuperNodes (``federation.num_clients`` of them when given, else
        until no new node has joined for ``settle_s``), then :meth:`ask_sites` every one of them:
        ``({site: report}, [records of nodes left out])``. Two nodes naming the same site is an error."""
        wait_s = self.nodes_wait if wait_s is None else wait_s
        want = cfg.federation.num_clients
        deadline = time.monotonic() + wait_s
        nodes: list[int] = []
        last_change = time.monotonic()
        while time.monotonic() < deadline:
            now = sorted(int(n) for n in grid.get_node_ids())
            if now != nodes:
                nodes, last_change = now, time.monotonic()
            if want is not None and len(nodes) >= want:
                break
            if want is None and len(nodes) >= 2 and time.monotonic() - last_change >= self.settle_s:
                break
            time.sleep(0.5)
        return self.ask_sites(grid, cfg, nodes, unique=True)

    def ask_sites(self, grid: Grid, cfg: FederatedConfig, nodes: Sequence[int], unique: bool = False) -> tuple[dict[str, dict], list[dict]]:
        """Send ``nodes`` the task config and collect what each holds (fedgalore.flower.client_app.
        whoami): ``({site: {"node", "n", "n_test", "label_counts"}}, [records of nodes left out,
        with the one-line reason])``. A node that does not answer within ``timeout`` is left out.
        Two nodes naming the same site: an error with ``unique``, else the later node id wins."""
        cfg_json = json.dumps({**cfg.to_dict(), "backend": {"name": "flower", "options": {}}}, sort_keys=True)
        msgs = [Message(content=RecordDict({"q": ConfigRecord({"ask": "site", "config": cfg_json})}), dst_node_id=int(n),
                        message_type=MessageType.QUERY) for n in nodes]
        reports: dict[str, dict] = {}
        failed: list[dict] = []
        answered: set[int] = set()
        replies = list(grid.send_and_receive(msgs, timeout=self.join_timeout)) if msgs else []
        sent_to = _sent_to(msgs)
        for rep in replies:
            node = _from_node(rep, sent_to)
            answered.add(node)
            if rep.has_error():  # Flower's own error reply: the node's exception text, recorded as the view allows
                failed.append({"round": 0, "node": node, "site": None,
                               "error": "node error: " + self.view_of(cfg).error(str(rep.error.reason), "client")})
                continue
            who = rep.content["whoami"]
            site = str(who.get("site", "")) or None
            if str(who.get("error", "")):
                failed.append({"round": 0, "node": node, "site": site, "error": str(who["error"])})
                continue
            if site is None:
                failed.append({"round": 0, "node": node, "site": None,
                               "error": "the node has no site data (start it with --node-config \"data='...' site='...'\")"})
                continue
            if site in reports and unique:
                raise ConfigError(f"two SuperNodes ({reports[site]['node']} and {node}) report site {site!r}; give each node "
                                  "its own site='...' in --node-config")
            reports[site] = {"node": node, "n": int(who.get("n", -1)), "n_test": int(who.get("n_test", -1)),
                             "label_counts": json.loads(str(who.get("label_counts", "[]")))}
        for n in nodes:
            if int(n) not in answered:
                failed.append({"round": 0, "node": int(n), "site": None, "error": f"no answer within join-timeout={self.join_timeout:g}s"})
        return reports, failed

    def ask_partition_ids(self, grid: Grid, nodes: Sequence[int]) -> dict[int, int]:
        """``{partition-id: node}`` of the ``nodes`` that answered within ``join_timeout``."""
        msgs = [Message(content=RecordDict({"q": ConfigRecord({"ask": "partition-id"})}), dst_node_id=int(n),
                        message_type=MessageType.QUERY) for n in nodes]
        out: dict[int, int] = {}
        for rep in grid.send_and_receive(msgs, timeout=self.join_timeout) if msgs else []:
            if not rep.has_error() and "whoami" in rep.content:
                out[int(rep.content["whoami"]["partition-id"])] = int(rep.metadata.src_node_id)
        return out

    def discover_nodes(self, grid: Grid, num_clients: int, wait_s: float = 120.0, with_asked: bool = False):
        """Ask every SuperNode for its ``partition-id``; returns client id → node id (and, with
        ``with_asked``, also the node ids that were asked)."""
        m = num_clients
        deadline = time.monotonic() + wait_s
        while len(nodes := list(grid.get_node_ids())) < m and time.monotonic() < deadline:
            time.sleep(1.0)
        node_of = self.ask_partition_ids(grid, nodes)
        missing = [c for c in range(m) if c not in node_of]
        if missing:
            raise RuntimeError(
                f"federation.num_clients={m} but no SuperNode reported partition-id {missing[:5]}; start one "
                f"SuperNode per client with --node-config 'partition-id=<i> num-partitions={m}' "
                f"(simulation: options.num-supernodes >= {m})"
            )
        return (node_of, [int(n) for n in nodes]) if with_asked else node_of

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, **_ignored) -> RunResult:
        """Run the whole federation on ``grid``; returns fedgalore's RunResult.

        With ``resume`` (the run config's ``resume=true``) the run continues from the last
        checkpoint in its run directory (``run_dir``, else ``output.dir``/run name, as for a new
        run), exactly as ``fedgalore run --resume`` does: the directory must hold this very run
        (same config and inputs; else one line naming the difference), its logs are cut back to the
        checkpointed rounds, and the rounds after it are run again — with the same metrics as an
        uninterrupted run. The SuperNodes of the resumed run hold nothing of it (a new Flower run),
        so each is sent the chain since W_0 or the dense model. A run that already completed is
        returned as it is."""
        if timeout is not None:
            self.timeout = float(timeout)
        data = {**self.cfg.to_dict(), "backend": {"name": "flower", "options": {}}}
        if num_rounds is not None:
            data["federation"]["rounds"] = int(num_rounds)
        cfg = FederatedConfig.from_dict(data)
        backend = GridBackend(self, grid)
        if self.resume:
            fed = self._resumed(cfg, backend)
            if isinstance(fed, RunResult):
                return fed
        else:
            # the Federation refuses a taken run directory before the model loads and the nodes are asked
            fed = Federation(cfg, run_dir=self.run_dir, progress=self.progress, backend=backend)
        backend.log_path = Path(fed.run_dir) / MESSAGES_FILE
        if fed.start_round == 0:
            backend.log_path.unlink(missing_ok=True)
        elif backend.log_path.exists():  # as the run's other logs: only the checkpointed rounds' records stay
            kept = [r for r in read_jsonl(backend.log_path) if int(r.get("round", 0)) <= fed.start_round]
            backend.log_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        return fed.run()

    def _resumed(self, cfg: FederatedConfig, backend: GridBackend) -> "Federation | RunResult":
        from fedgalore.records.identity import compare_with_saved, run_identity, summarize
        from fedgalore.records.rundir import choose_run_dir, saved_summary

        run_dir = Path(choose_run_dir(cfg, self.run_dir, True, lambda _m: None))
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"resume=true: {run_dir} holds no run (no config.yaml) — nothing to resume; start the run "
                              "without resume, or give run-dir=\"<the run directory>\"")
        diffs, _note = compare_with_saved(run_dir, run_identity(cfg))
        if diffs:
            raise ConfigError(f"resume=true: {run_dir} holds another run ({summarize(diffs)}); resume it with the config "
                              "it started with, or start a new run without resume")
        s = saved_summary(run_dir)
        if is_finished(s.get("status")):
            if self.progress is not None:
                self.progress.message(f"{run_dir} is complete ({s.get('rounds_completed')}/{s.get('rounds')} rounds); nothing to resume")
            return RunResult(run_dir, s, read_jsonl(run_dir / "metrics.jsonl"))
        return Federation(cfg, run_dir=run_dir, progress=self.progress, backend=backend, resume=True)
