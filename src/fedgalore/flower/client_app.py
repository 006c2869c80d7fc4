"""The client side of the Flower app: a ClientApp that runs fedgalore's operator T.

Each SuperNode is one federated client: its node config ``partition-id`` is the fedgalore client
id (in simulation Flower sets it; in a deployment pass ``--node-config "partition-id=3
num-partitions=20"``). A ``train`` message carries the serialised broadcast and the job; the
node trains with :meth:`fedgalore.engine.runtime.Runtime.execute` — the same code the sequential
and Ray backends run — and replies with the serialised upload.

The Runtime (task, frozen base model, method, partition) is built once per process from the
resolved config the server sends, and cached under a hash of that config and partition.

A method with a factored downlink (FedGaLore, FLoRA, FR-LoRA by default; fedgalore.methods.
downlink_mixin): the node keeps its copy of the adapted matrices and their model version in its
``Context.state`` between rounds (records ``fedgalore.downlink`` and ``fedgalore.downlink.meta``,
tied to the run's key), rebuilds ``W_k`` from the chain the server sends, and reports the
version it now holds in its reply (``held_version``, −1 for none), which the server's
:class:`~fedgalore.flower.strategy.GridBackend` sends the next chain from. A node that has not
trained in this run holds the public ``W_0`` (its runtime builds it). A node that lost its state
cannot apply a chain: its round fails with that error, it reports holding ``W_0`` (version 0), and
is sent the chain since ``W_0`` (or dense) next time.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedgalore.flower.codec import blob_to_record, record_to_blob  # noqa: E402

__all__ = ["app", "train", "whoami"]

app = ClientApp()
_RUNTIMES: dict[str, object] = {}
_BASES: dict[str, dict | None] = {}  # W_0 of the chained matrices per runtime (factored downlink)
_STATE, _STATE_META = "fedgalore.downlink", "fedgalore.downlink.meta"


def _runtime(job: ConfigRecord):
    key = str(job["key"])
    if key not in _RUNTIMES:
        from fedgalore.engine.config import FederatedConfig
        from fedgalore.engine.runtime import Runtime
        from fedgalore.federated.partition import decode_partition

        cfg = FederatedConfig.from_dict(json.loads(str(job["config"])))
        _RUNTIMES.clear()  # one run at a time per process
        _BASES.clear()
        rt = Runtime(cfg, parts=decode_partition(bytes(job["partition"])))
        _RUNTIMES[key] = rt
        base = getattr(rt.method, "downlink_base", None)
        _BASES[key] = base(rt.model) if base is not None and getattr(rt.method, "per_client_downlink", False) else None
    return _RUNTIMES[key]


def _load_store(context: Context, key: str) -> dict | None:
    """This node's downlink store: its kept copy (if it belongs to this run), else W_0."""
    from fedgalore.protocol.downlink import ClientCache

    base = _BASES.get(key)
    if base is None:
        return None
    state = context.state
    if _STATE in state and _STATE_META in state and str(state[_STATE_META]["key"]) == key:
        from fedgalore.flower.codec import record_to_tensors

        return {"downlink": ClientCache(int(state[_STATE_META]["version"]), record_to_tensors(state[_STATE]))}
    return {"downlink": ClientCache(0, base)}


def _save_store(context: Context, key: str, store: dict | None) -> int:
    """Keep the store in ``Context.state``; the version held (−1: none)."""
    cache = None if store is None else store.get("downlink")
    if cache is None:
        return -1
    if cache.version > 0:  # version 0 is W_0, rebuilt by the runtime: nothing to keep
        from fedgalore.flower.codec import tensors_to_record

        context.state[_STATE] = tensors_to_record(cache.params)
        context.state[_STATE_META] = ConfigRecord({"key": key, "version": int(cache.version)})
    return int(cache.version)


@app.query()
def whoami(msg: Message, context: Context) -> Message:
    """Tell the server which federated client this node is."""
    pid = int(context.node_config["partition-id"])
    return Message(RecordDict({"whoami": ConfigRecord({"partition-id": pid})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedgalore.engine.runtime import ClientJob

    job = msg.content["job"]
    client = int(job["client"])
    pid = context.node_config.get("partition-id")
    content = RecordDict()
    if pid is not None and int(pid) != client:
        result = {"client": client, "error": f"node holds partition {pid}, asked to train client {client}", "time": 0.0, "stats": "{}"}
    else:
        rt = _runtime(job)
        key = str(job["key"])
        store = _load_store(context, key)
        res = rt.execute(
            ClientJob(int(job["round"]), int(job["total_rounds"]), client, int(str(job["round_seed"]))),
            record_to_blob(msg.content["broadcast"]),
            client_state=store,
        )
        held = _save_store(context, key, store)
        if res.upload is not None:
            content["upload"] = blob_to_record(res.upload)
        result = {"client": client, "error": res.error or "", "time": float(res.time), "stats": json.dumps(res.stats, default=float),
                  "held_version": held}
    content["result"] = ConfigRecord(result)
    return Message(content, reply_to=msg)
