"""The site controls its privacy (fedgalore.privacy.site, fedgalore.engine.site_policy): a site's own
policy refuses in one line a job that asks for less, its ledger on its own disk keeps every release
across runs (fsynced before the upload leaves), and it stops at its budget — in a simulation
(``privacy.sites_dir``) and on a Flower SuperNode (node config ``privacy-policy``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("dp_accounting")
pytest.importorskip("opacus")

import fedgalore  # noqa: E402
from fedgalore.cli import main  # noqa: E402
from fedgalore.job.config import ConfigError, FederatedConfig  # noqa: E402
from fedgalore.jsonl import read_jsonl  # noqa: E402
from fedgalore.privacy.site import (LEDGER_FILE, POLICY_FILE, Release, SiteGuard, SiteLedger, SiteRefusal, epsilons,  # noqa: E402
                                    load_policy)
from fedgalore_testing.runs import cdp_cfg  # noqa: E402

#: one distributed-noise upload of 3 clients at σ = 1: the site's own share σ/√3
SHARE = 3 ** -0.5


def _policy(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POLICY_FILE).write_text(text)
    return folder / POLICY_FILE


# ----------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("text, words", [
    ("min_noise: 1.0\n", "unknown key min_noise; valid keys here: accept, budget, max_clip, min_noise_multiplier, site"),
    ("accept: [client_distributed, central]\n", "accept=['client_distributed', 'central'] must list some of none, record"),
    ("budget: {epsilon: -1}\n", "budget.epsilon=-1 must be a positive number"),
    ("budget: {epsilon: 4, delta: 2}\n", "budget.delta=2 must be in (0, 1)"),
    ("max_clip: 0\n", "max_clip=0 must be a positive number"),
    ("min_noise_multiplier: lots\n", "min_noise_multiplier must be a number, got 'lots'"),
    ("budget: [4\n", "not valid YAML (line 2)"),
])
def test_a_bad_policy_is_one_line_naming_the_file(tmp_path, text, words):
    path = _policy(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_policy(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"site policy {path}: ") and words in msg, msg


def test_a_policy_reads_as_written(tmp_path):
    p = load_policy(_policy(tmp_path, "site: clinic\nmin_noise_multiplier: 0.8\nmax_clip: 1.0\n"
                                      "budget: {epsilon: 8, delta: 1.0e-6}\naccept: client_distributed_secagg\n"))
    assert (p.site, p.min_noise_multiplier, p.max_clip, p.budget.epsilon, p.delta, p.accept) == \
        ("clinic", 0.8, 1.0, 8.0, 1e-6, ("client_distributed_secagg",))
    assert load_policy(_policy(tmp_path / "empty", "")).accept == ("record", "client_central", "client_distributed",
                                                                   "client_distributed_secagg")  # any DP, not none


def _guard(tmp_path: Path, text: str) -> SiteGuard:
    path = _policy(tmp_path, text)
    return SiteGuard("s0", load_policy(path), SiteLedger(tmp_path / LEDGER_FILE), path)


@pytest.mark.parametrize("text, release, words", [
    ("min_noise_multiplier: 1.0\n", Release("client_distributed", SHARE, "σ = 1/√3", 0.5),
     "the job's client_distributed release carries noise multiplier 0.5774 (σ = 1/√3), below the site's floor 1"),
    ("max_clip: 0.1\n", Release("client_distributed", 2.0, "", 0.5), "the job's client_distributed clip 0.5 is above the site's ceiling 0.1"),
    ("max_clip: 0.1\n", Release("record", 2.0, "", 1.0, 0.1, 5), "the job's record clip 1 is above the site's ceiling 0.1"),
    ("accept: [client_distributed_secagg]\n", Release("client_distributed", 2.0),
     "the job asks for client-level DP with distributed noise, no secure aggregation (client_distributed), which the site does not accept"),
    ("{}\n", Release("none", 0.0), "the job asks for no differential privacy (none), which the site does not accept"),
    ("accept: [none, record]\nbudget: {epsilon: 100}\n", Release("none", 0.0), "would take each row's ε from 0 to inf"),
])
def test_a_job_asking_for_less_is_refused_in_one_line(tmp_path, text, release, words):
    guard = _guard(tmp_path, text)
    with pytest.raises(SiteRefusal) as e:
        guard.admit([release])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("site s0 refuses: ") and words in msg and msg.endswith("the site does not train"), msg
    assert not (tmp_path / LEDGER_FILE).exists()  # nothing released, nothing recorded


def test_the_budget_counts_every_release_across_runs(tmp_path):
    """Two releases fit a budget between their ε and three releases' ε; the third is refused
    whichever run asks; a record-level release counts for each row, not for the site as a whole."""
    two, three = (epsilons([{"level": "client_distributed", "noise_multiplier": SHARE}] * n, 1e-5)["site"] for n in (2, 3))
    guard = _guard(tmp_path, f"budget: {{epsilon: {(two + three) / 2:.6f}}}\n")
    up = [Release("client_distributed", SHARE, "", 0.5)]
    guard.admit(up)
    guard.record(up, "run-a", "a", 0)
    guard.record(up, "run-b", "b", 0)
    with pytest.raises(SiteRefusal, match=f"the ε of the site's data as a whole from {two:.4g} to {three:.4g}, past"):
        guard.admit(up)
    with pytest.raises(SiteRefusal):  # the check at release time holds too (another run may have released meanwhile)
        guard.record(up, "run-c", "c", 0)
    lines = SiteLedger(tmp_path / LEDGER_FILE).lines()
    assert [ln["run"] for ln in lines] == ["run-a", "run-b"] and all(ln["round"] == 1 for ln in lines)
    eps = epsilons(lines, 1e-5)
    assert eps["site"] == pytest.approx(two) and eps["rows"] == pytest.approx(two, rel=1e-6)  # a plain Gaussian: the same ε
    more = epsilons([*lines, {"level": "record", "noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 10}], 1e-5)
    assert more["site"] == pytest.approx(two) and more["rows"] > two


def test_a_line_cut_by_a_crash_is_skipped_and_stays_apart(tmp_path):
    ledger = SiteLedger(tmp_path / LEDGER_FILE)
    ledger.append([{"level": "record", "noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 3, "site": "s0"}])
    with open(ledger.path, "a") as fh:
        fh.write('{"level": "record", "noise_mul')  # the process died mid-write: that upload never left
    ledger.append([{"level": "client_central", "noise_multiplier": 1.0, "site": "s0"}])
    assert [ln["level"] for ln in ledger.lines()] == ["record", "client_central"]


# ----------------------------------------------------------------------------- a simulation: two runs on one site
def _sites_cfg(tmp_path: Path, sites: Path, rounds: int, seed: int) -> FederatedConfig:
    cfg = cdp_cfg(tmp_path / "runs", rounds=rounds, noise="distributed", federation={"num_clients": 3, "clients_per_round": None})
    cfg.seed = seed
    cfg.train.local_steps, cfg.train.local_epochs = 1, 1
    cfg.privacy.sites_dir = str(sites)
    return cfg


def test_two_runs_on_one_site_the_second_refused_at_the_sites_budget(tmp_path, monkeypatch, capsys):
    """Site 0 holds a budget that fits two of its uploads (σ = 1 shared by 3 clients: σ/√3 each,
    as the server sees it) but not three. Run 1 (one round) and run 2's first round spend two; run
    2's second round is refused by the site — one line in its log —, the round goes on with the
    other two sites, and the site's ledger holds both runs; the other sites keep ledgers too (no
    policy: no limit). Every ledger line is on disk before its upload is handed over."""
    from fedgalore.engine import runtime as rt_mod

    sites = tmp_path / "sites"
    two, three = (epsilons([{"level": "client_distributed", "noise_multiplier": SHARE}] * n, 1e-5)["site"] for n in (2, 3))
    _policy(sites / "0", f"min_noise_multiplier: 0.5\nmax_clip: 1.0\nbudget: {{epsilon: {(two + three) / 2:.6f}, delta: 1.0e-5}}\n"
                         "accept: [client_distributed, client_distributed_secagg]\n")
    seen, now = [], {}
    real, real_execute = rt_mod.transfer, rt_mod.Runtime.execute

    def execute(self, job, broadcast, *a, **k):
        now.update(client=job.client, calls=0)
        return real_execute(self, job, broadcast, *a, **k)

    def transfer(payload):  # in process: the broadcast comes in here, then the upload leaves here (bytes: encode)
        now["calls"] += 1
        if now["calls"] == 2:
            seen.append((now["client"], len(SiteLedger(sites / str(now["client"]) / LEDGER_FILE).lines())))
        return real(payload)

    monkeypatch.setattr(rt_mod.Runtime, "execute", execute)
    monkeypatch.setattr(rt_mod, "transfer", transfer)
    first = fedgalore.run(_sites_cfg(tmp_path, sites, rounds=1, seed=0))
    assert first.summary["rounds_completed"] == 1
    second = fedgalore.run(_sites_cfg(tmp_path, sites, rounds=2, seed=1))
    assert second.summary["rounds_completed"] == 2  # the round went on without the site
    err = capsys.readouterr().err
    refusal = [ln for ln in err.splitlines() if ln.startswith("fedgalore: site 0 refuses: ")]
    assert len(refusal) == 1 and f"take the ε of the site's data as a whole from {two:.4g} to {three:.4g}, past the site's budget" in refusal[0], err[-2000:]
    recs = [r for r in read_jsonl(second.run_dir / "clients.jsonl") if r["round"] == 2]
    assert sorted(r["client"] for r in recs if "error" not in r) == [1, 2]
    # the site's refusal quotes no data: the server records it as it is, even under client-level DP
    assert [r["error"] for r in recs if r["client"] == 0] == [refusal[0].removeprefix("fedgalore: ")]
    # the ledger line of every upload was there (fsynced) when the upload was handed over: the k-th upload of a site sees k lines
    per: dict[int, int] = {}
    for c, n in seen:
        per[c] = per.get(c, 0) + 1
        assert n == per[c], seen
    assert per == {0: 2, 1: 3, 2: 3}
    lines = SiteLedger(sites / "0" / LEDGER_FILE).lines()
    assert len(lines) == 2 and len({ln["run"] for ln in lines}) == 2
    assert all(ln["level"] == "client_distributed" and ln["noise_multiplier"] == pytest.approx(SHARE) for ln in lines)
    assert len(SiteLedger(sites / "1" / LEDGER_FILE).lines()) == 3
    # what the site reads: both runs, what each spent, at its policy's δ
    assert main(["ledger", str(sites / "0"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["budget"]["epsilon"] == pytest.approx((two + three) / 2, rel=1e-5) and doc["releases"] == 2
    assert doc["sites"] == ["0"] and doc["levels"] == {"client_distributed": 2}
    assert doc["epsilon_site"] == pytest.approx(two) and [r["releases"] for r in doc["runs"]] == [1, 1]
    assert main(["ledger", str(sites / "0" / LEDGER_FILE)]) == 0
    out = capsys.readouterr().out
    assert "site 0: 2 release(s) in 2 run(s); ε at δ = 1e-05" in out and out.count(" t ") >= 2
    assert main(["ledger", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"fedgalore: error: {tmp_path / 'nowhere'}: no such ledger file or site folder"


def test_a_policy_beside_per_site_files_is_the_sites(tmp_path):
    """partition.kind files: a ``fedgalore-policy.yaml`` beside a site's training file is that site's
    policy in the simulation (and its ledger goes beside it); a bad one stops the run before it trains."""
    from fedgalore.engine.site_policy import SimulatedSites

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _policy(tmp_path / "a", "max_clip: 0.5\n")
    cfg = FederatedConfig.from_dict({"task": {"name": "text_classification", "options": {
        "data": {"sites": {"a": str(tmp_path / "a" / "train.csv"), "b": {"train": str(tmp_path / "b" / "train.csv")}}}}},
        "federation": {"partition": {"kind": "files"}}})
    sites = SimulatedSites.build(cfg, ["a", "b"])
    assert sites.guard(0).policy.max_clip == 0.5 and sites.guard(0).ledger.path == tmp_path / "a" / LEDGER_FILE
    assert sites.guard(1) is None
    _policy(tmp_path / "b", "budget: 3\n")
    with pytest.raises(ConfigError, match="site policy .*b/fedgalore-policy.yaml: budget must be"):
        SimulatedSites.build(cfg, ["a", "b"])


# ----------------------------------------------------------------------------- a Flower SuperNode
def test_a_flower_node_with_a_policy_refuses_a_job_below_it(tmp_path, capsys, monkeypatch):
    """The node of partition 0 accepts only distributed noise under secure aggregation: a job with
    distributed noise without it is refused by that node (one line in its log), the other nodes
    train; the node with only ``privacy-ledger`` records its releases under the job's key."""
    pytest.importorskip("flwr")
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    from flwr.supercore.task_identity import TaskIdentity

    from fedgalore.flower.strategy import FedGaLoreStrategy
    from fedgalore_testing.flower import LocalGrid

    for k, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # what a ServerApp process has set (fedgalore_testing.flower)
        monkeypatch.setattr(TaskIdentity, k, v)

    _policy(tmp_path / "node0", "accept: [client_distributed_secagg]\n")
    cfg = FederatedConfig.from_dict({
        "name": "fl", "seed": 0, "task": {"name": "tiny_text", "options": {"n_train": 60, "n_test": 24}},
        "method": {"name": "fedavg_full", "rank": 4},
        "federation": {"num_clients": 3, "clients_per_round": None, "rounds": 1,
                       "partition": {"kind": "dirichlet", "alpha": 1.0, "min_size": 5}},
        "train": {"lr": 1e-2, "batch_size": 16, "local_steps": 1, "weight_decay": 0.0},
        "privacy": {"client": {"clip": 0.5, "noise_multiplier": 1.0, "noise": "distributed"},
                    "sites_dir": str(tmp_path / "server-names-this")},
        "backend": {"name": "flower"}, "output": {"dir": str(tmp_path), "progress": "quiet"}})
    nodes = {101: {"partition-id": 0, "num-partitions": 3, "privacy-policy": str(tmp_path / "node0" / POLICY_FILE)},
             102: {"partition-id": 1, "num-partitions": 3, "privacy-ledger": str(tmp_path / "node1" / "ledger.jsonl")},
             103: {"partition-id": 2, "num-partitions": 3}}
    res = FedGaLoreStrategy(cfg, run_dir=tmp_path / "run").start(LocalGrid(nodes))
    assert res.summary["rounds_completed"] == 1
    out = capsys.readouterr()
    line = [ln for ln in (out.err + out.out).splitlines() if "refuses" in ln]
    assert line == ["fedgalore: site partition 0 refuses: the job asks for client-level DP with distributed noise, no secure "
                    f"aggregation (client_distributed), which the site does not accept (policy {tmp_path / 'node0' / POLICY_FILE} "
                    "accepts: client_distributed_secagg); the site does not train"]
    recs = read_jsonl(tmp_path / "run" / "clients.jsonl")
    assert sorted(r["client"] for r in recs if "error" not in r) == [1, 2]
    assert [r["error"] for r in recs if r["client"] == 0] == [line[0].removeprefix("fedgalore: ")]  # as the site said it
    assert not (tmp_path / "node0" / LEDGER_FILE).exists()
    lines = SiteLedger(tmp_path / "node1" / "ledger.jsonl").lines()
    assert len(lines) == 1 and lines[0]["site"] == "partition 1" and len(lines[0]["run"]) == 16
    assert not (tmp_path / "server-names-this").exists()  # the server's sites_dir is not the nodes'
    assert os.listdir(tmp_path / "node0") == [POLICY_FILE]
