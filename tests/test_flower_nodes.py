"""Site-local data on Flower (issue 32): ``federation.partition.kind: nodes``.

Every SuperNode reads only its own files (node config ``data``, ``test-data``, ``site``); the server
sends the task config and never a row, counts what the nodes report, trains each node as its
client and has each node evaluate the global model on its own test rows. The same per-site files
run by ``fedgalore run`` with ``partition.kind: files`` must give the same numbers.

Here the ServerApp's strategy drives the real ClientApp handlers (``whoami``, ``train``,
``evaluate``) through an in-process Grid, each node with its own ``Context`` (node config and
state), so the protocol — messages, records, per-node state — is exercised without processes;
tests/test_flower_deploy.py runs it on a real SuperLink and SuperNodes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

import fedgalore  # noqa: E402
from fedgalore.engine.config import FederatedConfig  # noqa: E402
from fedgalore.jsonl import read_jsonl  # noqa: E402
from tiny_assets import TOPICS, news_rows, write  # noqa: E402

SITES = ["s1", "s0", "s2"]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """What a ServerApp process has set when it creates messages (flwr's TaskIdentity)."""
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)


class LocalGrid(Grid):
    """A Grid whose SuperNodes are the ClientApp's handlers called in this process, each with its
    own Context (node config, state), as a SuperNode process would hold it."""

    def __init__(self, node_configs: dict[int, dict]) -> None:
        self.contexts = {n: Context(run_id=1, node_id=n, node_config=c, state=RecordDict(), run_config={})
                         for n, c in node_configs.items()}
        self.down = self.sent = 0

    # the Grid interface the strategy uses
    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from fedgalore.flower import client_app

        handlers = {MessageType.QUERY: client_app.whoami, MessageType.TRAIN: client_app.train,
                    MessageType.EVALUATE: client_app.evaluate}
        out = []
        for m in messages:
            node = int(m.metadata.dst_node_id)
            rep = handlers[m.metadata.message_type](m, self.contexts[node])
            out.append(rep)
        return out

    # unused by the strategy
    def create_message(self, *a, **k):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def set_run(self, run_id):  # pragma: no cover
        pass

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError


def site_files(root: Path, bad: str | None = None) -> dict:
    df = news_rows(90)
    data = {}
    for s in SITES:
        d = df[df.site == s].drop(columns=["site"]).reset_index(drop=True)
        if s == "s2":
            data[s] = str(write(d, root / f"{s}_all.csv"))
        else:
            data[s] = {"train": str(write(d.iloc[:-6], root / f"{s}_train.csv")),
                       "test": str(write(d.iloc[-6:], root / f"{s}_test.csv"))}
    return data


def config(out: Path, bert_dir, method: str, kind: str, data=None, **fed) -> FederatedConfig:
    opts = {"model": str(bert_dir), "text_column": "body", "label_column": "topic", "max_length": 16, "labels": TOPICS}
    if data is not None:
        opts["data"] = data
    return FederatedConfig.from_dict({
        "name": "sites", "seed": 0,
        "task": {"name": "text_classification", "options": opts},
        "method": {"name": method, "rank": 4},
        "federation": {"clients_per_round": None, "rounds": 2, "partition": {"kind": kind}, **fed},
        "train": {"lr": 1e-2, "batch_size": 4, "local_steps": 3},
        "output": {"dir": str(out), "progress": "quiet"},
    })


def node_configs(data: dict) -> dict[int, dict]:
    """Node ids that do not follow the site order, each node with only its own files."""
    out = {}
    for node, s in zip((907, 13, 4242), SITES):
        one = data[s]
        out[node] = {"data": one["train"], "test-data": one["test"], "site": s} if isinstance(one, dict) else {"data": one, "site": s}
    return out


def run_nodes(tmp_path, bert_dir, method, data, grid=None):
    from fedgalore.flower.strategy import FedGaLoreStrategy

    grid = grid or LocalGrid(node_configs(data))
    strategy = FedGaLoreStrategy(config(tmp_path / "nodes", bert_dir, method, "nodes"), run_dir=tmp_path / "nodes" / "run")
    strategy.settle_s = 0.0
    return strategy.start(grid), grid


@pytest.mark.parametrize("method", ["fedgalore", "fedit"])
def test_nodes_deployment_equals_files_simulation(tmp_path, bert_dir, method):
    data = site_files(tmp_path)
    sim = fedgalore.run(config(tmp_path / "sim", bert_dir, method, "files", {"sites": data}))
    dep, grid = run_nodes(tmp_path, bert_dir, method, data)
    assert dep.summary["status"] == "complete"
    for a, b in zip(read_jsonl(Path(sim.run_dir) / "metrics.jsonl"), read_jsonl(Path(dep.run_dir) / "metrics.jsonl")):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        if "client_eval" in a:  # every site, evaluated where its data is, as in the simulation
            assert set(b["client_eval"]["clients"]) == set(SITES)
            for s, m in a["client_eval"]["clients"].items():
                got = b["client_eval"]["clients"][s]
                assert got["n"] == m["n"]
                assert got["loss"] == pytest.approx(m["loss"], abs=1e-5) and got["accuracy"] == pytest.approx(m["accuracy"], abs=1e-9)
            assert b["eval/client_mean_loss"] == pytest.approx(a["eval/client_mean_loss"], abs=1e-5)
            assert b["client_eval"]["worst_client"] == a["client_eval"]["worst_client"]
            assert b["bytes_eval"] > 0 and "eval/accuracy" not in b  # no server-side test file: no pooled metric
    part = json.loads((Path(dep.run_dir) / "partition.json").read_text())
    sim_part = json.loads((Path(sim.run_dir) / "partition.json").read_text())
    assert part["client_names"] == sorted(SITES) and part["sizes"] == sim_part["sizes"]
    assert part["histograms"] == sim_part["histograms"]  # label counts reported by the nodes
    # uploads weighted by the example counts the nodes reported
    recs = [r for r in read_jsonl(Path(dep.run_dir) / "clients.jsonl") if r.get("round") == 1]
    assert {r["client_name"]: r["num_examples"] for r in recs} == dict(zip(sorted(SITES), sim_part["sizes"]))


def test_a_node_whose_data_does_not_fit_is_left_out_with_one_line(tmp_path, bert_dir, capsys):
    data = site_files(tmp_path)
    cfgs = node_configs(data)
    bad = tmp_path / "bad.csv"
    write(news_rows(12).drop(columns=["site"]).rename(columns={"body": "text"}), bad)
    cfgs[77] = {"data": str(bad), "site": "s9"}
    res, grid = run_nodes(tmp_path, bert_dir, "fedgalore", data, LocalGrid(cfgs))
    assert res.summary["status"] == "complete"
    first = read_jsonl(Path(res.run_dir) / "clients.jsonl")[0]
    assert first["round"] == 0 and first["site"] == "s9" and first["node"] == 77
    assert "has no column 'body'" in first["error"] and "task.options.text_column" in first["error"]
    assert "node 77 (site s9) left out: bad.csv has no column 'body'" in capsys.readouterr().out
    names = json.loads((Path(res.run_dir) / "partition.json").read_text())["client_names"]
    assert names == sorted(SITES)


def test_nodes_kind_outside_flower_and_without_labels_is_one_line(tmp_path, bert_dir, monkeypatch, capsys):
    from fedgalore.cli import main

    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, bert_dir, "fedgalore", "nodes")
    (tmp_path / "c.yaml").write_text(json.dumps(cfg.to_dict()))
    assert main(["run", "--config", str(tmp_path / "c.yaml")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fedgalore: error")]
    assert len(err) == 1 and "runs with the Flower app only" in err[0] and "kind=files" in err[0]
    d = cfg.to_dict()
    d["task"]["options"].pop("labels")
    from fedgalore.flower.client_app import site_options
    from fedgalore.tasks import get_task

    with pytest.raises(Exception, match=r"data is required: .*kind=nodes .*task\.options\.labels lists the classes"):
        get_task("text_classification", **d["task"]["options"])
    with pytest.raises(Exception, match="task.options.labels is required when the task reads no training rows"):
        get_task("text_classification", **{**d["task"]["options"], "data": {"test": site_files(tmp_path)["s0"]["test"]}})
    site, opts = site_options({"data": "x/site7.csv"}, {"model": "m"})
    assert site == "site7" and opts == {"model": "m", "data": {"sites": {"site7": "x/site7.csv"}}}
    with pytest.raises(ValueError, match="this SuperNode has no data"):
        site_options({}, {})
