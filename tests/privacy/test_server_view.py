"""The server's view, declared once and enforced at one choke point (fedgalore.privacy.view; issue
"Privacy the site controls"), tested the way the second audit worked: canary strings and values are
planted in a site's errors, its upload's fields and its sizes, every privacy level runs through the
simulation and through the Flower path, and every file of the run directory, the console, the
report and the exported model card are searched for anything the declaration does not allow.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import fedgalore
from fedgalore.cli import main
from fedgalore.federated.client import ClientError
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.jsonl import read_jsonl
from fedgalore.methods.base import register
from fedgalore.methods.fedavg_full import FedAvgFull
from fedgalore.privacy.view import CLIENT_FAILED, LEVELS, declare, threat_table

from fedgalore_testing import REPO
from fedgalore_testing.runs import cdp_cfg, tiny_cfg

pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

#: planted in a client's error text (made to look like the server's own timeout message) and in a field of its upload
CANARY = "CANARY7Q3"
CANARY_NUM = 271828.1828
CANARY_TIME = "9.87s"


@register
class _CanaryFedAvg(FedAvgFull):
    """FedAvg-Full whose clients plant canaries: every upload carries an undeclared field, and every odd client
    fails in round 1 with a message that starts as the server's timeout does and quotes its data."""

    name = "test_canary_fedavg"
    failed: set = set()  # (run, client): each odd client fails once, so a retried round (SecAgg+) goes through

    def client_update(self, model, broadcast, ctx):
        key = (id(self), ctx.client)
        if ctx.client % 2 == 1 and ctx.round == 0 and key not in self.failed:
            self.failed.add(key)
            raise ClientError(f"timed out: {CANARY_TIME} > federation.client_timeout_s=1 (name={CANARY}, row 'x {CANARY}')")
        up = super().client_update(model, broadcast, ctx)
        up.meta["canary_stat"] = CANARY_NUM
        return up


def _privacy(level: str) -> tuple[dict, dict]:
    """``(privacy, federation extras)`` of a level."""
    if level == "none":
        return {}, {}
    if level == "record":
        return {"record": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-3}}, {}
    noise = "central" if level == "client_central" else "distributed"
    fed = {"secure_aggregation": {"num_shares": 3, "reconstruction_threshold": 2}} if level.endswith("secagg") else {}
    return {"client": {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5, "noise": noise}}, fed


def _leaks(root: Path, text: str = "") -> list[str]:
    """Every file under ``root`` (and ``text``: the console, the report) holding a canary."""
    found = []
    needles = [CANARY.encode(), repr(CANARY_NUM).encode()[:9], CANARY_TIME.encode()]
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            found += [f"{p.relative_to(root)}: {n.decode()}" for n in needles if n in data]
    found += [f"console/report: {n.decode()}" for n in needles if n.decode() in text]
    return found


def _check_records(run_dir: Path, level: str) -> None:
    """clients.jsonl, metrics.jsonl and partition.json hold only what the level declares."""
    view = declare(FederatedConfig.from_dict(_cfg_of(run_dir)).privacy, level.endswith("secagg"))
    recs = read_jsonl(run_dir / "clients.jsonl")
    assert recs
    for r in recs:
        assert view.record(r) == r, r  # nothing undeclared was written
        if level != "none":
            assert "time" not in r and "canary_stat" not in r
            if "error" in r and r["client"] % 2 == 1 and r["round"] == 1:  # its own text replaced at the site
                assert r["error"].endswith(CLIENT_FAILED) or r["error"].endswith(CLIENT_FAILED + ")"), r
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        assert ("time_clients" in m) is (level == "none")
        assert not any(k.startswith("eval/client_") for k in m) or level == "none"
    part = json.loads((run_dir / "partition.json").read_text())
    if level.startswith("client"):
        assert "sizes" not in part and "histograms" not in part and "clients" not in part
        assert all("num_examples" not in r for r in recs)
    doc = json.loads((run_dir / "privacy.json").read_text()) if level != "none" else None
    if doc is not None:
        assert doc["server_view"] == level and doc["upload_fields"] == view.fields()["upload_fields"]


def _cfg_of(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))


# ----------------------------------------------------------------------------- the declaration
def test_the_docs_table_is_generated_from_the_declaration():
    """docs/privacy.md's table of the server's view is :func:`threat_table`'s output, verbatim."""
    doc = (REPO / "docs" / "privacy.md").read_text()
    m = re.search(r"<!-- server-view:begin[^>]*-->\n(.*?)\n<!-- server-view:end -->", doc, re.S)
    assert m, "docs/privacy.md has no generated server-view table"
    assert m.group(1) == threat_table(), "regenerate it: python -m fedgalore.privacy.view"


def test_every_level_declares_less_as_it_protects_more():
    from types import SimpleNamespace as NS

    none = declare(NS(record=None, client=None))
    rec = declare(NS(record=NS(release_metrics=False), client=None))
    cen = declare(NS(record=None, client=NS(noise="central", release_metrics=False, adaptive_clipping=None)))
    assert none.upload_meta is None and none.client_error_text and none.client_time
    assert rec.site_size and not rec.client_error_text and not rec.client_time  # audit finding 12
    assert not rec.allows_meta("loss_mean") and rec.allows_meta("dp_steps") and not rec.allows_meta("canary_stat")
    assert not cen.site_size and not cen.site_labels and not cen.site_eval and not cen.site_state
    for key in ("num_examples", "steps", "loss_mean", "dp_sample_rate", "canary_stat"):
        assert not cen.allows_meta(key)
    assert cen.error(f"timed out: 1s (name={CANARY})", "client") == CLIENT_FAILED  # audit finding 5: origin, not text
    assert cen.error("rejected: non-finite", "server") == "rejected: non-finite"
    assert set(LEVELS) == {"none", "record", "client_central", "client_distributed", "client_distributed_secagg"}


def test_every_field_a_method_uploads_is_declared(tmp_path):
    """A new method (or feature) whose upload carries a field no declaration names fails here: under
    record-level DP such a field would silently not leave; say in fedgalore.privacy.view what it is."""
    from fedgalore.engine.backends.sequential import SequentialBackend
    from fedgalore.engine.loop import Federation
    from fedgalore.methods.base import available_methods
    from fedgalore.privacy.view import COUNT_META, DIAGNOSTIC_META, LOSS_META, RECORD_DP_PREFIX, STRUCTURE_META

    declared = set(STRUCTURE_META + COUNT_META + LOSS_META + DIAGNOSTIC_META + ("dp_clip_bit",))
    seen: dict[str, set] = {}

    class Spy(SequentialBackend):
        def run_clients(self, broadcast, jobs, progress=None):
            out = super().run_clients(broadcast, jobs, progress)
            for r in out:
                seen.setdefault(self.runtime.method.name, set()).update(getattr(r.upload, "meta", {}) or {})
            return out

    for name in available_methods():
        if name.startswith("test_"):
            continue
        cfg = tiny_cfg(tmp_path / name, name, rounds=1, diagnostics=True)
        cfg.train.local_steps = 2
        Federation(cfg, backend=Spy()).run()
    undeclared = {m: sorted(k for k in keys if k not in declared and not k.startswith(RECORD_DP_PREFIX))
                  for m, keys in seen.items()}
    assert seen and not any(undeclared.values()), undeclared


# ----------------------------------------------------------------------------- the canaries, simulated
@pytest.mark.parametrize("level", ["none", "record", "client_central", "client_distributed"])
def test_canaries_stay_at_the_sites_in_the_simulation(tmp_path, level, capsys, caplog):
    privacy, fed = _privacy(level)
    cfg = tiny_cfg(tmp_path / "runs", "test_canary_fedavg", rounds=2, privacy=privacy)
    cfg.train.weight_decay = 0.0
    res = fedgalore.run(cfg)
    run_dir = Path(res.run_dir)
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    assert main(["export", str(run_dir), "--out", str(tmp_path / "exported")]) == 0
    out = capsys.readouterr()
    text = out.out + out.err + caplog.text
    leaks = _leaks(run_dir, text) + _leaks(tmp_path / "exported")
    if level == "none":  # nothing is protected: the canaries are there (the search can find them)
        assert any(CANARY in x for x in leaks) and any("271828" in x for x in leaks), leaks
        return
    assert not leaks, leaks
    _check_records(run_dir, level)
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "client sizes" not in card or level == "record"  # audit finding 8: sizes only where public


def test_fedgalore_uploads_are_one_size_whatever_the_site_size(tmp_path):
    """Audit finding 2: under client-level DP FedGaLore's upload (its number of update terms, the
    moment view's evidence) no longer follows a site's size: every upload of a round has the same
    bytes although the Dirichlet sites hold different numbers of rows; local_epochs is refused."""
    res = fedgalore.run(cdp_cfg(tmp_path / "a", "fedgalore", rounds=2, noise="distributed",
                                method_options={"projector": "random", "view_basis": "seeded", "update_proj_gap": 1}))
    ups = [r for r in read_jsonl(Path(res.run_dir) / "ledger.jsonl") if r["direction"] == "up"]
    part = fedgalore.run(tiny_cfg(tmp_path / "b", "fedavg_full", rounds=1)).run_dir
    assert len(set(json.loads((Path(part) / "partition.json").read_text())["sizes"])) > 1  # the sites differ in size
    for k in (1, 2):
        assert len({r["bytes"] for r in ups if r["round"] == k}) == 1, ups
    cfg = cdp_cfg(tmp_path / "c", "fedgalore", method_options={"projector": "random", "view_basis": "seeded"})
    cfg.train.local_steps = None
    with pytest.raises(ConfigError, match="train.local_steps"):
        fedgalore.run(cfg)


def test_fedsa_lora_site_state_stays_out_of_the_run_directory(tmp_path):
    """Audit finding 6: under client-level DP a site's raw local B is never written by the server."""
    res = fedgalore.run(cdp_cfg(tmp_path, "fedsa_lora", rounds=2))
    assert not (Path(res.run_dir) / "sites").exists()
    plain = fedgalore.run(tiny_cfg(tmp_path / "plain", "fedsa_lora", rounds=2))
    assert list((Path(plain.run_dir) / "sites").glob("site-*/round-*.safetensors"))  # the simulation's resume, no DP


# ----------------------------------------------------------------------------- the canaries on Flower
@pytest.mark.parametrize("level", ["record", "client_central", "client_distributed", "client_distributed_secagg"])
def test_canaries_stay_at_the_sites_on_flower(tmp_path, level, monkeypatch, capsys, caplog):
    """The same search through the Flower path (each SuperNode a ClientApp in this process, SecAgg+
    behind Flower's own mod)."""
    pytest.importorskip("flwr")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from fedgalore.flower.strategy import FedGaLoreStrategy
    from fedgalore_testing.flower import SecAggGrid

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    privacy, fed = _privacy(level)
    cfg = FederatedConfig.from_dict({
        "name": "canary", "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 120, "n_test": 48}},
        "method": {"name": "test_canary_fedavg", "rank": 4},
        "federation": {"num_clients": 3, "clients_per_round": None, "rounds": 2, "min_clients": 1, "max_round_retries": 2,
                       "partition": {"kind": "dirichlet", "alpha": 1.0, "min_size": 5}, **fed},
        "train": {"lr": 1e-2, "batch_size": 16, "local_steps": 2, "weight_decay": 0.0},
        "privacy": privacy, "backend": {"name": "flower"},
        "output": {"dir": str(tmp_path), "progress": "quiet"},
    })
    grid = SecAggGrid({101 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)})
    run_dir = tmp_path / "run"
    res = FedGaLoreStrategy(cfg, run_dir=run_dir).start(grid)
    assert res.summary["status"] == "finished", res.summary
    out = capsys.readouterr()
    text = out.out + out.err + caplog.text
    assert not _leaks(run_dir, text), _leaks(run_dir, text)
    _check_records(run_dir, level)


def test_a_nodes_deployment_under_client_dp_sends_no_size_labels_or_site_metrics(tmp_path, bert_dir, monkeypatch):
    """Audit finding 3: with partition.kind nodes and client-level DP the nodes tell the server their
    site's name only — no row count, no label histogram — and evaluate nothing per site unless
    federation.client_eval (declared NOT protected)."""
    pytest.importorskip("flwr")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.supercore.task_identity import TaskIdentity

    from fedgalore.flower.strategy import FedGaLoreStrategy
    from fedgalore_testing.assets import TOPICS, news_site_files
    from fedgalore_testing.flower import LocalGrid

    for k, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    data = news_site_files(tmp_path, ("s1", "s0", "s2"))
    nodes = {}
    for node, s in zip((907, 13, 4242), ("s1", "s0", "s2")):
        one = data[s]
        nodes[node] = {"data": one["train"], "test-data": one["test"], "site": s} if isinstance(one, dict) else {"data": one, "site": s}
    cfg = FederatedConfig.from_dict({
        "name": "sites", "seed": 0,
        "task": {"name": "text_classification", "options": {"model": str(bert_dir), "text_column": "body",
                                                             "label_column": "topic", "max_length": 16, "labels": TOPICS}},
        "method": {"name": "fedit", "rank": 4},
        "federation": {"clients_per_round": None, "rounds": 2, "partition": {"kind": "nodes"}},
        "train": {"lr": 1e-2, "batch_size": 4, "local_steps": 3, "weight_decay": 0.0},
        "privacy": {"client": {"clip": 0.5, "noise_multiplier": 1.0, "noise": "distributed", "delta": 1e-3}},
        "output": {"dir": str(tmp_path / "nodes"), "progress": "quiet"},
    })
    reports: list[dict] = []
    ask = FedGaLoreStrategy.ask_sites

    def spy(self, *a, **k):  # what the nodes told the server
        out = ask(self, *a, **k)
        reports.extend(out[0].values())
        return out

    monkeypatch.setattr(FedGaLoreStrategy, "ask_sites", spy)
    strategy = FedGaLoreStrategy(cfg, run_dir=tmp_path / "nodes" / "run")
    strategy.settle_s = 0.0
    res = strategy.start(LocalGrid(nodes))
    assert res.summary["status"] == "finished"
    run_dir = tmp_path / "nodes" / "run"
    assert reports and all(r["n"] == -1 and r["n_test"] == -1 and r["label_counts"] == [] for r in reports)
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        assert "client_eval" not in m and not any(k.startswith("eval/client_") for k in m)
        assert "bytes_eval" not in m  # the nodes were not asked to evaluate
    part = json.loads((run_dir / "partition.json").read_text())
    assert "sizes" not in part and part["client_names"] == ["s0", "s1", "s2"]
