"""Site-local data on Flower (issue 32): ``federation.partition.kind: nodes``.

Every SuperNode reads only its own files (node config ``data``, ``test-data``, ``site``); the server
sends the task config and never a row, counts what the nodes report, trains each node as its
client and has each node evaluate the global model on its own test rows. The same per-site files
run by ``fedgalore run`` with ``partition.kind: files`` must give the same numbers.

Here the ServerApp's strategy drives the real ClientApp handlers (``whoami``, ``train``,
``evaluate``) through an in-process Grid, each node with its own ``Context`` (node config and
state), so the protocol — messages, records, per-node state — is exercised without processes;
tests/flower/test_flower_deploy.py runs it on a real SuperLink and SuperNodes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("flwr")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Context, MessageType, RecordDict  # noqa: E402

import fedgalore  # noqa: E402
from fedgalore.job.config import ConfigError, FederatedConfig  # noqa: E402
from fedgalore.jsonl import read_jsonl  # noqa: E402
from fedgalore_testing.assets import TOPICS, news_rows, news_site_files, write  # noqa: E402
from fedgalore_testing.flower import LocalGrid, _task_identity  # noqa: E402,F401

SITES = ["s1", "s0", "s2"]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def site_files(root: Path) -> dict:
    return news_site_files(root, SITES)


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


def run_nodes(tmp_path, bert_dir, method, data, grid=None, server_data=None):
    from fedgalore.flower.strategy import FedGaLoreStrategy

    grid = grid or LocalGrid(node_configs(data))
    strategy = FedGaLoreStrategy(config(tmp_path / "nodes", bert_dir, method, "nodes", server_data),
                                 run_dir=tmp_path / "nodes" / "run")
    strategy.settle_s = 0.0
    return strategy.start(grid), grid


@pytest.mark.parametrize("method", ["fedgalore", "fedit"])
def test_nodes_deployment_equals_files_simulation(tmp_path, bert_dir, method):
    data = site_files(tmp_path)
    sim = fedgalore.run(config(tmp_path / "sim", bert_dir, method, "files", {"sites": data}))
    dep, grid = run_nodes(tmp_path, bert_dir, method, data)
    assert dep.summary["status"] == "finished"
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
    # the report's final metric of a run without a pooled test set: the sites' weighted mean
    from fedgalore.report import load_run

    last = read_jsonl(Path(dep.run_dir) / "metrics.jsonl")[-1]
    assert load_run(dep.run_dir).metric() == pytest.approx(last["eval/client_mean_accuracy"], abs=1e-12)
    assert load_run(sim.run_dir).metric() == pytest.approx(read_jsonl(Path(sim.run_dir) / "metrics.jsonl")[-1]["eval/accuracy"])
    part = json.loads((Path(dep.run_dir) / "partition.json").read_text())
    sim_part = json.loads((Path(sim.run_dir) / "partition.json").read_text())
    assert part["client_names"] == sorted(SITES) and part["sizes"] == sim_part["sizes"]
    assert part["histograms"] == sim_part["histograms"]  # label counts reported by the nodes
    # uploads weighted by the example counts the nodes reported
    recs = [r for r in read_jsonl(Path(dep.run_dir) / "clients.jsonl") if r.get("round") == 1]
    assert {r["client_name"]: r["num_examples"] for r in recs} == dict(zip(sorted(SITES), sim_part["sizes"]))


def image_site_files(root: Path, fmt: str) -> dict:
    """Per-site images (a colour per class plus noise, 4 per class; the site's last image of each
    class is its test row) as ``fmt``: ``csv`` — a CSV of image paths relative to it, ``parquet`` —
    the images' bytes in a ``datasets`` Image column. ``{site: {"train": path, "test": path}}``."""
    import datasets
    import numpy as np
    import pandas as pd
    from PIL import Image

    out = {}
    for k, s in enumerate(SITES):
        g, rows = np.random.default_rng(k), []
        for c, colour in {"cat": (200, 40, 40), "dog": (40, 180, 40), "owl": (40, 40, 200)}.items():
            for i in range(4):
                f = root / s / f"{c}{i}.png"
                f.parent.mkdir(parents=True, exist_ok=True)
                pixels = np.clip(np.array(colour)[None, None] + g.normal(0, 70, (12, 12, 3)), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(f)
                rows.append({"image": f"{s}/{f.name}" if fmt == "csv" else {"bytes": f.read_bytes(), "path": None}, "label": c})
        out[s] = {}
        for split, part in (("train", [r for j, r in enumerate(rows) if j % 4 != 3]), ("test", rows[3::4])):
            path = root / f"{s}_{split}.{fmt}"
            if fmt == "csv":
                pd.DataFrame(part).to_csv(path, index=False)
            else:
                datasets.Dataset.from_list(part).cast_column("image", datasets.Image()).to_parquet(str(path))
            out[s][split] = str(path)
    return out


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_image_sites_on_nodes_equal_files_simulation(tmp_path, vit_dir, fmt):
    """Nodes holding images (a CSV of paths, or Parquet with the images' bytes; image folders on real
    SuperNodes: tests/flower/test_flower_deploy.py): the server, which holds no image, trains
    and evaluates each site where its images are, with the files simulation's numbers."""
    data = image_site_files(tmp_path / "images", fmt)

    def image_config(out, kind, data=None):
        cfg = config(out, vit_dir, "fedit", kind, data).to_dict()
        cfg["task"] = {"name": "image_classification",
                       "options": {"model": str(vit_dir), "labels": ["cat", "dog", "owl"], "new_head": True,
                                   **({"data": data} if data is not None else {})}}
        return FederatedConfig.from_dict(cfg)

    from fedgalore.flower.strategy import FedGaLoreStrategy

    sim = fedgalore.run(image_config(tmp_path / "sim", "files", {"sites": data}))
    strategy = FedGaLoreStrategy(image_config(tmp_path / "nodes", "nodes"), run_dir=tmp_path / "nodes" / "run")
    strategy.settle_s = 0.0
    dep = strategy.start(LocalGrid(node_configs(data)))
    assert dep.summary["status"] == "finished"
    got, want = read_jsonl(Path(dep.run_dir) / "metrics.jsonl"), read_jsonl(Path(sim.run_dir) / "metrics.jsonl")
    assert len(got) == len(want) == 2
    for a, b in zip(want, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        assert set(b["client_eval"]["clients"]) == set(SITES)
        for s, m in a["client_eval"]["clients"].items():
            assert b["client_eval"]["clients"][s]["n"] == m["n"] == 3
            assert b["client_eval"]["clients"][s]["loss"] == pytest.approx(m["loss"], abs=1e-5)


def test_a_server_side_test_file_still_gives_the_pooled_metrics(tmp_path, bert_dir):
    """A nodes server may hold a test file of its own (``data: {test: FILE}``): the pooled
    ``eval/*`` metrics on it, beside the sites' own. With the union of the sites' test files as
    that file, the pooled accuracy is the sites' example-weighted mean."""
    import pandas as pd

    data = site_files(tmp_path)
    s2 = pd.read_csv(data["s2"])  # every site with a test file here: the server's file is their union
    data["s2"] = {"train": str(write(s2.iloc[:-6], tmp_path / "s2_train.csv")), "test": str(write(s2.iloc[-6:], tmp_path / "s2_test.csv"))}
    pooled = write(pd.concat([pd.read_csv(data[s]["test"]) for s in SITES], ignore_index=True), tmp_path / "server_test.csv")
    res, _ = run_nodes(tmp_path, bert_dir, "fedgalore", data, server_data={"test": str(pooled)})
    assert res.summary["status"] == "finished"
    for rec in read_jsonl(Path(res.run_dir) / "metrics.jsonl"):
        if "client_eval" in rec:
            per = rec["client_eval"]["clients"]
            assert set(per) == set(SITES) and sum(m["n"] for m in per.values()) == 18
            assert rec["eval/accuracy"] == pytest.approx(rec["eval/client_mean_accuracy"], abs=1e-9)
            assert rec["eval/loss"] == pytest.approx(rec["eval/client_mean_loss"], abs=1e-5)


def test_a_node_whose_data_does_not_fit_is_left_out_with_one_line(tmp_path, bert_dir, capsys):
    data = site_files(tmp_path)
    cfgs = node_configs(data)
    bad = tmp_path / "bad.csv"
    write(news_rows(12).drop(columns=["site"]).rename(columns={"body": "text"}), bad)
    cfgs[77] = {"data": str(bad), "site": "s9"}
    res, grid = run_nodes(tmp_path, bert_dir, "fedgalore", data, LocalGrid(cfgs))
    assert res.summary["status"] == "finished"
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


class RestartingGrid(LocalGrid):
    """After the first evaluation, the SuperNode ``old`` is gone and comes back as node ``new``
    with the node config ``node_config`` (default: its own) and an empty state, as a restarted
    SuperNode does (a new node id, nothing kept)."""

    def __init__(self, node_configs: dict[int, dict], old: int, new: int, node_config: dict | None = None) -> None:
        super().__init__(node_configs)
        self.old, self.new, self.node_config, self.restarted = old, new, node_config, False
        self.sent_to: list[tuple[str, int]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent_to += [(str(m.metadata.message_type), int(m.metadata.dst_node_id)) for m in messages]
        out = super().send_and_receive(messages, timeout=timeout)
        if not self.restarted and messages and messages[0].metadata.message_type == MessageType.EVALUATE:
            old = self.contexts.pop(self.old)
            self.contexts[self.new] = Context(run_id=1, node_id=self.new, node_config=self.node_config or old.node_config,
                                              state=RecordDict(), run_config={})
            self.restarted = True
        return out


def test_a_restarted_node_takes_its_site_back(tmp_path, bert_dir, capsys):
    """A SuperNode restarted between rounds comes back under a new node id with nothing kept: the
    server finds it before the next round, asks it who it is, moves its site to it and sends it
    the model from W_0 (which a new node holds) — and the run's numbers are the uninterrupted simulation's."""
    data = site_files(tmp_path)
    sim = fedgalore.run(config(tmp_path / "sim", bert_dir, "fedgalore", "files", {"sites": data}))
    grid = RestartingGrid(node_configs(data), old=13, new=5150)  # node 13 holds s0 (client 0)
    dep, _ = run_nodes(tmp_path, bert_dir, "fedgalore", data, grid)
    assert dep.summary["status"] == "finished"
    assert "client 0 (site s0) is now on node 5150 (was 13)" in capsys.readouterr().out
    assert (str(MessageType.TRAIN), 5150) in grid.sent_to and grid.sent_to.count((str(MessageType.QUERY), 5150)) == 1
    for a, b in zip(sim.history, read_jsonl(Path(dep.run_dir) / "metrics.jsonl")):
        assert b["dropped"] == [] and b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        for s, m in a["client_eval"]["clients"].items():
            assert b["client_eval"]["clients"][s]["loss"] == pytest.approx(m["loss"], abs=1e-5)
    wire = read_jsonl(Path(dep.run_dir) / "flower_messages.jsonl")
    r2 = {w["client"]: w for w in wire if w["type"] == "train" and w["round"] == 2}
    assert r2[0]["node"] == 5150 and r2[0]["upload"] > 0
    # the downlink was built for what each node holds: W_0 (what a node new to the run builds) — the
    # restarted node included, although its predecessor had received W_0 too
    assert [r2[c]["held"] for c in range(3)] == [0, 0, 0]


def test_a_node_that_rejoins_with_other_data_is_left_out(tmp_path, bert_dir, capsys):
    data = site_files(tmp_path)
    other = tmp_path / "other.csv"
    write(news_rows(40).drop(columns=["site"]), other)
    grid = RestartingGrid(node_configs(data), old=13, new=5150, node_config={"data": str(other), "site": "s0"})
    dep, _ = run_nodes(tmp_path, bert_dir, "fedit", data, grid)
    assert dep.summary["status"] == "finished"
    out = capsys.readouterr().out
    assert "node 5150 (site s0) rejoined with other data (31 training rows, the run started with 17); left out" in out
    assert [m["dropped"] for m in read_jsonl(Path(dep.run_dir) / "metrics.jsonl")] == [[], [0]]


class DyingGrid(LocalGrid):
    """The ServerApp dies (an exception out of the Grid) when round ``die_in`` is sent."""

    def __init__(self, node_configs: dict[int, dict], die_in: int) -> None:
        super().__init__(node_configs)
        self.die_in = die_in

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN and messages[0].metadata.group_id == str(self.die_in):
            raise SystemExit("the ServerApp process was killed")
        return super().send_and_receive(messages, timeout=timeout)


def test_resume_continues_a_killed_server_app_with_the_same_metrics(tmp_path, bert_dir, caplog):
    """resume=true (FedGaLoreStrategy(resume=True)): the run continues from its last checkpoint —
    the nodes of the new Flower run hold nothing, so they get the chain since W_0 or dense — and
    ends with the metrics of an uninterrupted run; resuming a complete run returns it."""
    from fedgalore.flower.strategy import FedGaLoreStrategy

    data = site_files(tmp_path)
    cfg = config(tmp_path / "nodes", bert_dir, "fedgalore", "nodes")
    cfg.federation.rounds = 3
    run_dir = tmp_path / "nodes" / "run"
    with pytest.raises(SystemExit):
        s = FedGaLoreStrategy(cfg, run_dir=run_dir)
        s.settle_s = 0.0
        s.start(DyingGrid(node_configs(data), die_in=2))
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 1
    s = FedGaLoreStrategy(cfg, run_dir=run_dir, resume=True)
    s.settle_s = 0.0
    res = s.start(LocalGrid(node_configs(data)))  # a fresh set of node contexts: a new Flower run
    assert res.summary["status"] == "finished" and f"resuming {run_dir} after round 1" in caplog.text
    uninterrupted = FedGaLoreStrategy(cfg, run_dir=tmp_path / "whole")
    uninterrupted.settle_s = 0.0
    whole = uninterrupted.start(LocalGrid(node_configs(data)))
    got = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["round"] for m in got] == [1, 2, 3]
    for a, b in zip(whole.history, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
        for site, m in a["client_eval"]["clients"].items():
            assert b["client_eval"]["clients"][site]["loss"] == pytest.approx(m["loss"], abs=1e-5)
    again = FedGaLoreStrategy(cfg, run_dir=run_dir, resume=True).start(LocalGrid(node_configs(data)))
    assert again.summary["status"] == "finished" and len(again.history) == 3
    other = config(tmp_path / "nodes", bert_dir, "fedgalore", "nodes")  # 2 rounds: another run
    with pytest.raises(ConfigError, match=r"resume=true: .* holds another run \(federation.rounds: 3 -> 2"):
        FedGaLoreStrategy(other, run_dir=run_dir, resume=True).start(LocalGrid(node_configs(data)))


class TimedGrid(LocalGrid):
    """A LocalGrid that records the timeout of every send (by message type)."""

    def __init__(self, node_configs: dict[int, dict]) -> None:
        super().__init__(node_configs)
        self.timeouts: list[tuple[str, float]] = []

    def send_and_receive(self, messages, *, timeout=None):
        self.timeouts += [(str(m.metadata.message_type), timeout) for m in messages[:1]]
        return super().send_and_receive(messages, timeout=timeout)


def test_first_contact_waits_for_the_nodes_cold_start(tmp_path, bert_dir):
    """A node's first answer (its site) includes its cold start — installing the app, starting its
    ClientApp, importing torch — so it waits ``join_timeout`` (default: the larger of the round
    ``timeout`` and 300 s), not a short round timeout that would leave every node out before
    round 1; so does the first round a node trains in (it builds the node's runtime: the model,
    its data); later rounds wait ``timeout``. The run config key is ``join-timeout``."""
    from fedgalore.flower.strategy import FedGaLoreStrategy

    data = site_files(tmp_path)
    cfg = config(tmp_path / "nodes", bert_dir, "fedit", "nodes", rounds=2)
    assert FedGaLoreStrategy(cfg, timeout=30).join_timeout == 300.0
    assert FedGaLoreStrategy(cfg, timeout=900).join_timeout == 900.0
    grid = TimedGrid(node_configs(data))
    strategy = FedGaLoreStrategy(cfg, run_dir=tmp_path / "nodes" / "run", timeout=30, join_timeout=45)
    strategy.settle_s = 0.0
    strategy.start(grid)
    kinds = dict(grid.timeouts[:1])
    assert kinds == {str(MessageType.QUERY): 45.0}  # the site query: join_timeout
    train = [t for k, t in grid.timeouts if k == str(MessageType.TRAIN)]
    assert train == [45.0, 30]  # round 1 (every node's first training): join_timeout; round 2: timeout


class BusyGrid(TimedGrid):
    """A TimedGrid whose nodes miss the first ``late`` train waves of round ``busy_in``: every
    reply comes after the wave's timeout (nodes still busy with an earlier job)."""

    def __init__(self, node_configs: dict[int, dict], busy_in: int, late: int) -> None:
        super().__init__(node_configs)
        self.busy_in, self.late = busy_in, late

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        out = super().send_and_receive(messages, timeout=timeout)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN and \
                messages[0].metadata.group_id == str(self.busy_in) and self.late > 0:
            self.late -= 1
            return []
        return out


def test_a_retried_round_waits_twice_as_long_at_each_retry(tmp_path, bert_dir):
    """A round with too few uploads is retried (federation.min_clients); a SuperNode handles one
    message at a time, so a node that missed the wait is still busy with the last attempt's job
    and a retry with the same wait would miss it again. Each retry of a round doubles the wait
    (timeout · 2^attempt); the next round starts again from ``timeout``."""
    from fedgalore.flower.strategy import FedGaLoreStrategy

    data = site_files(tmp_path)
    cfg = config(tmp_path / "nodes", bert_dir, "fedit", "nodes", rounds=3, min_clients=2, max_round_retries=2)
    grid = BusyGrid(node_configs(data), busy_in=2, late=2)
    strategy = FedGaLoreStrategy(cfg, run_dir=tmp_path / "nodes" / "run", timeout=30, join_timeout=45)
    strategy.settle_s = 0.0
    res = strategy.start(grid)
    assert res.summary["status"] == "finished"
    train = [t for k, t in grid.timeouts if k == str(MessageType.TRAIN)]
    assert train == [45.0, 30, 60, 120, 30]  # round 1 cold; round 2: 30, then 2 retries; round 3: 30 again
    errors = [(r["round"], r.get("attempt")) for r in read_jsonl(tmp_path / "nodes" / "run" / "clients.jsonl") if r.get("error")]
    assert len(errors) == 2 * 3 and {r for r, _ in errors} == {2}  # 3 clients missed 2 attempts of round 2


def test_client_level_dp_on_nodes_equals_the_simulation(tmp_path, bert_dir, monkeypatch):
    """privacy.client with distributed noise over the Grid: each node clips its own upload to the
    round's clip norm (which travels in the broadcast; adaptive clipping moves it) and adds its
    share of the noise before the upload leaves — the same numbers as the files simulation, and
    the same privacy.json accountant. (The noise comes from OS entropy and a deployment refuses
    privacy.reproducible; to compare the two paths draw for draw, the test pins the entropy.)"""
    from fedgalore.flower.strategy import FedGaLoreStrategy

    monkeypatch.setattr("fedgalore.privacy.randomness.entropy_seed", lambda: 20261201)

    data = site_files(tmp_path)
    priv = {"client": {"clip": 0.5, "noise_multiplier": 1.0, "noise": "distributed", "delta": 1e-3,
                       "adaptive_clipping": {"count_noise_multiplier": 1.0}}}

    def private(cfg):
        d = cfg.to_dict()
        d["privacy"] = priv
        d["method"]["options"] = {"projector": "random", "view_basis": "seeded"}
        d["train"]["weight_decay"] = 0.0  # FedGaLore's decay·W0 term would sit outside the clip (refused)
        d["federation"]["client_eval"] = True  # per-site metrics leave the nodes only when asked for (NOT protected)
        return FederatedConfig.from_dict(d)

    sim = fedgalore.run(private(config(tmp_path / "sim", bert_dir, "fedgalore", "files", {"sites": data})))
    strategy = FedGaLoreStrategy(private(config(tmp_path / "nodes", bert_dir, "fedgalore", "nodes")),
                                 run_dir=tmp_path / "nodes" / "run")
    strategy.settle_s = 0.0
    dep = strategy.start(LocalGrid(node_configs(data)))
    assert dep.summary["status"] == "finished"
    a, b = read_jsonl(Path(sim.run_dir) / "metrics.jsonl"), read_jsonl(Path(dep.run_dir) / "metrics.jsonl")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert y["eval/client_mean_loss"] == pytest.approx(x["eval/client_mean_loss"], abs=1e-5)
        assert y["dp_client_epsilon"] == pytest.approx(x["dp_client_epsilon"], rel=1e-12)
        assert y["dp_clip"] == pytest.approx(x["dp_clip"], rel=1e-6)
    assert b[1]["dp_clip"] != pytest.approx(0.5)  # adaptive: moved after round 1 by the nodes' noised bits
    doc = json.loads((Path(dep.run_dir) / "privacy.json").read_text())
    assert doc["client"]["mechanism"]["noise"] == "distributed" and doc["client"]["history"][0][1] == 3
    recs = [r for r in read_jsonl(Path(dep.run_dir) / "clients.jsonl") if r.get("round") == 1]
    assert recs and not any("loss_mean" in r for r in recs)  # the losses stayed on the nodes
