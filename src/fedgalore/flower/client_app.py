"""The client side of the Flower app: a ClientApp that runs fedgalore's operator T.

Each SuperNode is one federated client: its node config ``partition-id`` is the fedgalore client
id (in simulation Flower sets it; in a deployment pass ``--node-config "partition-id=3
num-partitions=20"``). A ``train`` message carries the serialised broadcast and the job; the
node trains with :meth:`fedgalore.engine.runtime.Runtime.execute` — the same code the sequential
and Ray backends run — and replies with the serialised upload.

The Runtime (task, frozen base model, method, partition) is built once per process from the
resolved config the server sends, and cached under a hash of that config and partition.

**Site-local data** (``federation.partition.kind: nodes``): the node is started with its own files,
``--node-config "data='site3/train.csv' test-data='site3/test.csv' site='site3'"`` (``test-data``
optional: then the site's test rows are drawn from its own data with ``task.options.
test_fraction``; ``site`` defaults to the data file's name without its extension). The server
sends the task config (model, columns, labels, lengths) and never a row: the node reads its data as
the site ``site`` of per-site data (``task.options.data: {sites: {site: {train: data, test:
test-data}}}``, fedgalore.tasks.generic.data), exactly as ``fedgalore run`` with ``partition.kind:
files`` reads that site — so a deployment and its simulation see the same examples. It reports its
site, example counts and label counts (:func:`whoami`; a file that does not fit the task is one
line, in the node's log and the server's clients.jsonl), trains as its client, and evaluates the
global model on its own test rows (:func:`evaluate`).

A method with a factored downlink (FedGaLore, FLoRA, FR-LoRA by default; fedgalore.methods.
downlink_mixin): the node keeps its copy of the adapted matrices and their model version in its
``Context.state`` between rounds (records ``fedgalore.downlink`` and ``fedgalore.downlink.meta``,
tied to the run's key), rebuilds ``W_k`` from the chain the server sends, and reports the
version it now holds in its reply (``held_version``, −1 for none), which the server's
:class:`~fedgalore.flower.strategy.GridBackend` sends the next chain from. A node that has not
trained in this run holds the public ``W_0`` (its runtime builds it). A node that lost its state
cannot apply a chain: its round fails with that error, it reports holding ``W_0`` (version 0), and
is sent the chain since ``W_0`` (or dense) next time.

**The site's own policy** (fedgalore.privacy.site; docs/privacy.md, "The site's own policy and ledger"):
node config ``privacy-policy='PATH'`` (default: a ``fedgalore-policy.yaml`` beside ``data``) and
``privacy-ledger='PATH'`` (default: ``fedgalore-ledger.jsonl`` beside the policy). The node refuses
in one line — in its log and as its error to the server — a job that asks for less than its policy
or whose release would pass its budget, and writes every release to its ledger (fsynced) before
the upload leaves. The server's ``privacy.sites_dir`` (a simulation's) is dropped from the config
the node runs.

A method that keeps its own state at the site between rounds (``MethodTraits.keeps_client_state``:
FedSA-LoRA's local ``B``): the node keeps it in ``Context.state`` too (records ``fedgalore.site.*``,
tied to the run's key), so the same node trains its site in every round it is sampled.
"""
from __future__ import annotations

import json
import os

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedgalore.flower.codec import blob_to_record, record_to_blob  # noqa: E402
from fedgalore.flower.secagg import secagg_mod  # noqa: E402
from fedgalore.methods.traits import per_client_downlink_ops  # noqa: E402

__all__ = ["app", "train", "whoami", "evaluate", "site_options"]

app = ClientApp()
#: runtimes of the current run, per node data (one entry per process on a SuperNode; the in-process
#: test grid holds several nodes). ``downlink_base``: W_0 of the chained matrices (factored downlink)
_RUNTIMES: dict[tuple[str, str], object] = {}
_STATE, _STATE_META = "fedgalore.downlink", "fedgalore.downlink.meta"
#: a method's own state kept at the site between rounds (MethodTraits.keeps_client_state): one record per entry
_SITE, _SITE_META = "fedgalore.site", "fedgalore.site.meta"


_SITE_TASKS: dict[str, object] = {}  # kind nodes: this node's task per server config (read once)


def site_options(node_config, task_options: dict) -> tuple[str, dict]:
    """``(site, task options)``: the server's task options with ``data`` replaced by this node's
    own files (node config ``data``, ``test-data``, ``site``; module doc)."""
    from pathlib import Path

    data = str(node_config.get("data", "") or "").strip()
    if not data:
        raise ValueError("this SuperNode has no data: start it with --node-config \"data='FILE' site='NAME'\" "
                         "(and test-data='FILE' for its own test rows)")
    test = str(node_config.get("test-data", "") or "").strip()
    site = str(node_config.get("site", "") or "").strip() or Path(data).stem
    one = {"train": data, "test": test} if test else data
    return site, {**task_options, "data": {"sites": {site: one}}}


def _view(cfg):
    """What this site lets leave (fedgalore.privacy.view), decided here from the job's config."""
    from fedgalore.privacy.view import view_of

    return view_of(cfg)


def _site_task(node_config, cfg):
    """This node's task: the server's task on the node's own data (cached per config)."""
    from fedgalore.tasks import get_task

    site, options = site_options(node_config, dict(cfg.task.options))
    key = json.dumps([cfg.task.name, options], sort_keys=True, default=str)
    if key not in _SITE_TASKS:
        _SITE_TASKS[key] = (site, get_task(cfg.task.name, **options))
    return _SITE_TASKS[key]


def _runtime(job: ConfigRecord, node_config=None):
    run = str(job["key"])
    mine = "" if "partition" in job else json.dumps([str((node_config or {}).get(k, "")) for k in ("data", "test-data", "site")])
    key = (run, mine)
    if key not in _RUNTIMES:
        import numpy as np

        from fedgalore.job.config import FederatedConfig
        from fedgalore.engine.runtime import Runtime
        from fedgalore.federated.partition import decode_partition

        plain = json.loads(str(job["config"]))
        (plain.get("privacy") or {}).pop("sites_dir", None)  # a node's policy is its own, never a folder the server names
        cfg = FederatedConfig.from_dict(plain)
        if cfg.privacy.enabled and cfg.privacy.reproducible:  # the node does not trust a server that asks for seeded noise
            from fedgalore.privacy.randomness import REPRODUCIBLE_REFUSED
            from fedgalore.privacy.view import SiteRefusal

            raise SiteRefusal(REPRODUCIBLE_REFUSED)
        for old in [k for k in _RUNTIMES if k[0] != run]:  # one run at a time per process
            del _RUNTIMES[old]
        if "partition" in job:
            rt = Runtime(cfg, parts=decode_partition(bytes(job["partition"])))
        else:  # kind nodes: this node's own rows are its client's part; the others' are stand-ins of their sizes
            site, task = _site_task(node_config, cfg)
            sizes = json.loads(str(job["sizes"]))
            me, n = int(job["client"]), len(task.train_set())
            if _view(cfg).site_size and sizes[me] != n:  # a withheld size stands in as 1 (strategy.node_clients)
                raise ValueError(f"the server counted {sizes[me]} training rows for this site, the node holds {n}; "
                                 "restart the run (the data changed since the node joined)")
            parts = [np.arange(n) if j == me else np.arange(s) for j, s in enumerate(sizes)]
            rt = Runtime(cfg, parts=parts, task=task)
            rt.site = site
        rt.site_policies = None  # the node's own policy comes with each job (_site_guard), not from the server's config
        rt.run_key = run  # the run's key in the site's ledger
        ops = per_client_downlink_ops(rt.method)
        rt.downlink_w0 = ops.downlink_base(rt.model) if ops is not None else None
        _RUNTIMES[key] = rt
    return _RUNTIMES[key]


def _load_store(context: Context, key: str, rt) -> dict | None:
    """This node's store for its client (``ctx.state``): the downlink copy it kept (if it belongs to
    this run), else W_0; and the method's own state kept at the site (:attr:`~fedgalore.methods.traits.
    MethodTraits.keeps_client_state`, e.g. FedSA-LoRA's B), restored from ``Context.state``. None: the
    method keeps nothing at the site."""
    from fedgalore.flower.codec import record_to_tensors
    from fedgalore.protocol.downlink import ClientCache

    state = context.state
    store: dict | None = None
    base = rt.downlink_w0
    if base is not None:
        if _STATE in state and _STATE_META in state and str(state[_STATE_META]["key"]) == key:
            store = {"downlink": ClientCache(int(state[_STATE_META]["version"]), record_to_tensors(state[_STATE]))}
        else:
            store = {"downlink": ClientCache(0, base)}
    if rt.method.traits.keeps_client_state:
        store = {} if store is None else store
        if _SITE_META in state and str(state[_SITE_META]["key"]) == key:
            for name in json.loads(str(state[_SITE_META]["names"])):
                store[name] = record_to_tensors(state[f"{_SITE}.{name}"])
    return store


def _save_store(context: Context, key: str, store: dict | None) -> int:
    """Keep the store in ``Context.state`` — the downlink copy, and the method's own entries (each a
    mapping of names to tensors); the downlink version held (−1: none)."""
    from fedgalore.flower.codec import tensors_to_record
    from fedgalore.protocol.state import own_entries

    if store is None:
        return -1
    own = own_entries(store)
    if own:
        for name, tensors in own.items():
            context.state[f"{_SITE}.{name}"] = tensors_to_record(tensors)
        context.state[_SITE_META] = ConfigRecord({"key": key, "names": json.dumps(sorted(own))})
    cache = store.get("downlink")
    if cache is None:
        return -1
    if cache.version > 0:  # version 0 is W_0, rebuilt by the runtime: nothing to keep
        context.state[_STATE] = tensors_to_record(cache.params)
        context.state[_STATE_META] = ConfigRecord({"key": key, "version": int(cache.version)})
    return int(cache.version)


def _received(msg: Message, key: str) -> int:
    """Bytes of the payload arrays this node received under ``key`` (reported back: the server
    checks its ledger against them, fedgalore.flower.strategy.MESSAGES_FILE)."""
    return int(sum(len(a.data) for a in msg.content[key].values())) if key in msg.content else -1


@app.query()
def whoami(msg: Message, context: Context) -> Message:
    """Tell the server which federated client this node is: its ``partition-id``, or — asked with
    the task config (kind nodes) — its site and what its own data holds (training and test rows,
    training rows per class), having read and checked that data against the task."""
    q = msg.content["q"] if "q" in msg.content else ConfigRecord()
    if str(q.get("ask", "")) == "site":
        from fedgalore.job.config import FederatedConfig

        site, view = "", None
        try:
            cfg = FederatedConfig.from_dict(json.loads(str(q["config"])))
            view = _view(cfg)
            site = site_options(context.node_config, {})[0]
            _, task = _site_task(context.node_config, cfg)
            n = int(len(task.train_set()))
            if n == 0:
                raise ValueError(f"site {site}: no training rows")
            # only what the server view declares leaves the node (client-level DP: no size, no label counts)
            who = {"site": site, "n": n if view.site_size else -1,
                   "n_test": int(len(task.test_set())) if view.site_size else -1, "label_counts": "[]"}
            if view.site_labels:
                labels = np.asarray(task.partition_labels(), dtype=np.int64)
                counts = np.bincount(labels, minlength=len(task.label_names())) if labels.size else np.zeros(0, dtype=np.int64)
                who["label_counts"] = json.dumps([int(c) for c in counts])
        except Exception as exc:  # noqa: BLE001 - the node's data does not fit the task: one line, here and on the server
            line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"fedgalore: error: site {site or '?'}: {line}", flush=True)
            who = {"site": site, "error": line if view is None or view.client_error_text
                   else "the site's data does not fit the task (its message stays at the site)"}
        return Message(RecordDict({"whoami": ConfigRecord(who)}), reply_to=msg)
    pid = int(context.node_config["partition-id"])
    return Message(RecordDict({"whoami": ConfigRecord({"partition-id": pid})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation (kind nodes): the global model the server sends, on this node's own
    test rows; replies the site, its number of test rows and the task's metrics. The runtime's
    model is restored afterwards (training starts from the broadcast and the node's store)."""
    import torch

    from fedgalore.flower.codec import record_to_tensors

    job = msg.content["job"]
    site = ""
    try:
        rt = _runtime(job, context.node_config)
        site = getattr(rt, "site", "")
        if not rt.view.site_eval:  # per-site metrics leave only where the server view declares them
            raise ValueError("per-site evaluation is not part of this run's server view (set federation.client_eval: true)")
        sent = record_to_tensors(msg.content["model"])
        params = dict(rt.model.named_parameters())
        unknown = sorted(set(sent) - set(params))
        if unknown:
            raise ValueError(f"the server sent parameters this node's model lacks: {unknown[:3]}")
        kept = {n: params[n].detach().clone() for n in sent}
        try:
            with torch.no_grad():
                for n, t in sent.items():
                    params[n].copy_(t)
            test = rt.task.test_set()
            values = rt.task.evaluate(rt.model, test, int(job["eval_batch_size"])) if len(test) else {}
        finally:
            with torch.no_grad():
                for n, t in kept.items():
                    params[n].copy_(t)
        res = {"site": site, "n": int(len(test)), "values": json.dumps({k: float(v) for k, v in values.items()}), "error": ""}
    except Exception as exc:  # noqa: BLE001 - reported to the server, which logs it and goes on
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        res = {"site": site, "n": 0, "values": "{}", "error": line}
    res["received"] = _received(msg, "model")
    return Message(RecordDict({"metrics": ConfigRecord(res)}), reply_to=msg)


@app.train(mods=[secagg_mod])
def train(msg: Message, context: Context) -> Message:
    """Run T for the job's client on the broadcast (this node's downlink store applied first) and
    reply the upload, the version now held and the bytes received. Under secure aggregation
    (a SecAgg+ collect stage: the job arrives as Flower's FitIns, fedgalore.flower.secagg) the reply
    is Flower's FitRes — the upload as the summed arrays, the weight as its example count — which
    Flower's ``secaggplus_mod`` masks before it leaves the node."""
    if "fitins.config" in msg.content.config_records:
        return _train_secagg(msg, context)
    job = msg.content["job"]
    result, upload = _run_job(job, record_to_blob(msg.content["broadcast"]), context, _received(msg, "broadcast"))
    content = RecordDict()
    if upload is not None:
        content["upload"] = blob_to_record(upload)
    content["result"] = ConfigRecord(result)
    return Message(content, reply_to=msg)


_GUARDS: dict[str, object] = {}  # this process's nodes' own guards, per node config (policy read once)


def _site_guard(node_config, name: str):
    """This node's own policy and ledger (node config ``privacy-policy``, ``privacy-ledger``; by default a
    ``fedgalore-policy.yaml`` beside its ``data``: fedgalore.engine.site_policy.node_guard), or None."""
    from fedgalore.engine.site_policy import node_guard

    key = json.dumps([name] + [str(node_config.get(k, "")) for k in ("privacy-policy", "privacy-ledger", "data")])
    if key not in _GUARDS:
        _GUARDS[key] = node_guard(node_config, name)
    return _GUARDS[key]


def _run_job(job, broadcast: bytes, context: Context, received: int) -> tuple[dict, bytes | None]:
    """``(result record, upload blob)`` of one train job on this node."""
    from fedgalore.engine.runtime import ClientJob

    client = int(job["client"])
    pid = context.node_config.get("partition-id")
    if pid is not None and int(pid) != client:
        return {"client": client, "error": f"node holds partition {pid}, asked to train client {client}", "time": 0.0, "stats": "{}"}, None
    from fedgalore.privacy.view import SiteRefusal

    try:
        rt = _runtime(job, context.node_config)
    except Exception as exc:  # noqa: BLE001 - one line in the node's log; the server gets what the view lets leave
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"fedgalore: error: client {client}: {line}", flush=True)
        from fedgalore.job.config import FederatedConfig

        if isinstance(exc, SiteRefusal):  # the site's own policy: quotes no data
            return {"client": client, "error": line, "origin": "site", "time": 0.0, "stats": "{}"}, None
        try:
            line = _view(FederatedConfig.from_dict(json.loads(str(job["config"])))).client_error(line) or line
        except Exception:  # noqa: BLE001 - a config this node cannot read: nothing of the site in it
            line = "the client failed (its message stays at the site)"
        return {"client": client, "error": line, "time": 0.0, "stats": "{}"}, None
    key = str(job["key"])
    store = _load_store(context, key, rt)
    try:
        site = _site_guard(context.node_config, getattr(rt, "site", "") or str(context.node_config.get("site", "") or "")
                           or f"partition {pid if pid is not None else client}")
    except ValueError as exc:  # the node's own policy file does not parse: one line, here and on the server
        print(f"fedgalore: error: {exc}", flush=True)
        return {"client": client, "error": str(exc), "origin": "site", "time": 0.0, "stats": "{}"}, None
    res = rt.execute(ClientJob(int(job["round"]), int(job["total_rounds"]), client, int(str(job["round_seed"]))), broadcast,
                     client_state=store, site=site)
    held = _save_store(context, key, store)
    result = {"client": client, "error": res.error or "", "origin": res.origin, "time": float(res.time),
              "stats": json.dumps(res.stats, default=float), "held_version": held, "received": received}
    return result, res.upload


def _train_secagg(msg: Message, context: Context) -> Message:
    """The SecAgg+ collect stage's training: the job and broadcast come as Flower's FitIns (the
    broadcast is fedgalore's encoded payload, one tensor); the reply is Flower's FitRes with the
    upload as :func:`fedgalore.flower.secagg.summable`'s arrays, ``num_examples`` = the job's
    ``secagg_weight`` and the layout and result record in the (clear) metrics. A client that could
    not train raises: its node drops out of the SecAgg+ round, and Flower recovers its masks."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    from fedgalore.flower.secagg import SUMMED_META, summable
    from fedgalore.protocol.payload import decode

    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    job = dict(fitins.config)
    blob = bytes(fitins.parameters.tensors[0])
    result, upload = _run_job(job, blob, context, len(blob))
    if upload is None or result["error"]:
        raise RuntimeError(f"client {result['client']} could not train: {result['error'] or 'no upload'}")
    arrays, layout = summable(decode(upload))
    # what is summed (client-level DP's noised clip bit) must not also travel in the clear result record
    stats = {k: v for k, v in json.loads(result["stats"]).items() if k not in SUMMED_META}
    metrics = {**result, "stats": json.dumps(stats), "layout": layout}
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(arrays), int(job["secagg_weight"]), metrics)
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)
