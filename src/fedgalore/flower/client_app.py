"""The client side of the Flower app: a ClientApp that runs fedgalore's operator T.

Each SuperNode is one federated client: its node config ``partition-id`` is the fedgalore client
id (in simulation Flower sets it; in a deployment pass ``--node-config "partition-id=3
num-partitions=20"``). A ``train`` message carries the serialised broadcast and the job; the
node trains with :meth:`fedgalore.engine.runtime.Runtime.execute` — the same code the sequential
and Ray backends run — and replies with the serialised upload.

The Runtime (task, frozen base model, method, partition) is built once per process from the
resolved config the server sends, and cached under a hash of that config and partition.
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


def _runtime(job: ConfigRecord):
    key = str(job["key"])
    if key not in _RUNTIMES:
        from fedgalore.engine.config import FederatedConfig
        from fedgalore.engine.runtime import Runtime
        from fedgalore.federated.partition import decode_partition

        cfg = FederatedConfig.from_dict(json.loads(str(job["config"])))
        _RUNTIMES.clear()  # one run at a time per process
        _RUNTIMES[key] = Runtime(cfg, parts=decode_partition(bytes(job["partition"])))
    return _RUNTIMES[key]


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
        res = rt.execute(
            ClientJob(int(job["round"]), int(job["total_rounds"]), client, int(str(job["round_seed"]))),
            record_to_blob(msg.content["broadcast"]),
        )
        if res.upload is not None:
            content["upload"] = blob_to_record(res.upload)
        result = {"client": client, "error": res.error or "", "time": float(res.time), "stats": json.dumps(res.stats, default=float)}
    content["result"] = ConfigRecord(result)
    return Message(content, reply_to=msg)
