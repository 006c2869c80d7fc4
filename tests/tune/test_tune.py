"""``fedgalore tune``: the search space, a tiny search that prunes a hopeless trial and resumes
after a kill, two workers on one study, the confirmation on held-out seeds and its report, and the
refusals (another config or inputs on a stored study; privacy without a site ledger)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from fedgalore.cli import main
from fedgalore.job.config import ConfigError, load_config
from fedgalore.tune import TuneSpec, tune
from fedgalore.tune.confirm import paired
from fedgalore.tune.search import build_rows, open_study, search, storage_url
from fedgalore.tune.space import Param, apply_params, at_edge, parse_param, parse_space, widened

TINY = """\
name: tiny_tune
seed: 0
task: {{name: tiny_text, options: {{n_train: 160, n_test: 32, hidden_size: 16, num_layers: 1, seq_len: 8}}}}
method: {{name: fedit, rank: 4, options: {{}}}}
federation: {{num_clients: 3, clients_per_round: 2, rounds: {rounds}, eval_every: 1, validation_fraction: 0.25,
             partition: {{kind: iid}}}}
train: {{lr: 3.0e-2, batch_size: 16, local_steps: 4}}
output: {{dir: {out}, progress: quiet, checkpoint_every: 1}}
"""


def _config(tmp_path: Path, rounds: int = 4) -> Path:
    path = tmp_path / "tiny_tune.yaml"
    path.write_text(TINY.format(rounds=rounds, out=tmp_path / "runs"))
    return path


def _spec(tmp_path: Path, **kw) -> TuneSpec:
    base = load_config(_config(tmp_path, kw.pop("rounds", 4)))
    labels = kw.pop("labels", ["fedit"])
    space = kw.pop("space", [])
    return TuneSpec(base=base, labels=labels, out=tmp_path / "tune", space=parse_space(space, labels), **kw)


def _trials(spec: TuneSpec, label: str = "fedit"):
    row = next(r for r in build_rows(spec) if r.label == label)
    trials = open_study(spec, row, storage_url(spec), check=False).get_trials(deepcopy=False)
    return [t for t in trials if t.state.name != "WAITING"]  # a grid's queued points


# ----------------------------------------------------------------------------- the space
def test_space_forms_and_their_errors() -> None:
    assert parse_param("train.lr", "log:1e-4:1e-1") == Param("train.lr", "log", 1e-4, 1e-1)
    assert parse_param("method.rank", "choice:8,16,32").choices == (8, 16, 32)
    assert parse_param("train.lr", "choice:3e-2,1e-3").choices == (0.03, 0.001)  # YAML 1.1 would read text
    assert parse_param("train.local_epochs", "int:1:4") == Param("train.local_epochs", "int", 1, 4)
    for bad, says in [("log:0:1", "LOW > 0"), ("float:2:1", "below HIGH"), ("uniform:1:2", "log:LOW:HIGH"),
                      ("choice:8,8", "twice"), ("int:1.5:3", "integers")]:
        with pytest.raises(ConfigError, match=says):
            parse_param("train.lr", bad)
    rows = parse_space(["fedit:method.rank=choice:8,16", "train.lr=log:1e-3:1e-1"], ["fedit", "fedavg_full"])
    assert set(rows["fedit"]) == {"method.rank", "train.lr"} and set(rows["fedavg_full"]) == {"train.lr"}
    with pytest.raises(ConfigError, match="not a row"):
        parse_space(["flora:method.rank=choice:8"], ["fedit"])


def test_edges_widen_and_typos() -> None:
    lr = Param("train.lr", "log", 1e-4, 1e-2)
    assert at_edge(lr, 1.1e-4) == "low" and at_edge(lr, 9e-3) == "high" and at_edge(lr, 1e-3) is None
    assert widened(lr, "high") == Param("train.lr", "log", 1e-4, 1e-1)
    assert widened(Param("train.prox_mu", "float", 0.0, 0.1), "low") == Param("train.prox_mu", "float", 0.0, 0.1)
    assert at_edge(Param("method.rank", "choice", choices=(8, 16, 32)), 32) == "high"
    cfg = {"train": {"lr": 1.0}, "method": {"options": {}}}
    assert apply_params(cfg, {"train.lr": 2.0, "method.options.scale": 0.5}) == {"train": {"lr": 2.0}, "method": {"options": {"scale": 0.5}}}
    with pytest.raises(ConfigError, match="no key 'train.lrr'"):
        apply_params(cfg, {"train.lrr": 1.0})


def test_paired_interval_is_the_t_interval_of_the_differences() -> None:
    from scipy import stats

    a, b = [0.50, 0.55, 0.52, 0.58], [0.45, 0.50, 0.51, 0.50]
    d = [x - y for x, y in zip(a, b)]
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=sum(d) / 4, scale=stats.sem(d))
    got = paired(a, b)
    assert got["mean"] == pytest.approx(sum(d) / 4) and got["low"] == pytest.approx(lo) and got["high"] == pytest.approx(hi)


# ----------------------------------------------------------------------------- search
def test_a_hopeless_rate_is_pruned_and_a_resumed_search_continues_the_same_study(tmp_path) -> None:
    spec = _spec(tmp_path, space=["train.lr=choice:3e-2,1e-6,1e-2"], sampler="grid", trials=2)
    search(spec, build_rows(spec), lambda s: None)
    trials = _trials(spec)
    by_lr = {t.params["train.lr"]: t for t in trials}
    assert by_lr[0.03].state.name == "COMPLETE" and by_lr[0.03].user_attrs["rounds_run"] == 4
    bad = by_lr[1e-6]
    assert bad.state.name == "PRUNED", "the pruner should stop lr=1e-6 (no learning) against the finished lr=3e-2"
    assert bad.user_attrs["rounds_run"] < 4 and bad.user_attrs["client_rounds"] == 2 * bad.user_attrs["rounds_run"]
    first = [(t.number, t.state.name, dict(t.params), t.value) for t in trials]

    spec2 = _spec(tmp_path, space=["train.lr=choice:3e-2,1e-6,1e-2"], sampler="grid", trials=3)  # resumed: one more
    search(spec2, build_rows(spec2), lambda s: None)
    again = _trials(spec2)
    assert [(t.number, t.state.name, dict(t.params), t.value) for t in again[:2]] == first
    assert len(again) == 3 and again[2].params == {"train.lr": 0.01} and again[2].state.name in ("COMPLETE", "PRUNED")

    other = _spec(tmp_path, space=["train.lr=log:1e-3:1e-1"], trials=4)
    with pytest.raises(ConfigError, match="cannot be searched two ways in one study"):
        search(other, build_rows(other), lambda s: None)


def test_a_choice_at_the_edge_of_its_range_is_flagged_and_the_range_widened(tmp_path, monkeypatch) -> None:
    """The best value at the top of its range: the range is widened ×10 on that side once, searched
    for half as many trials again, and the study remembers it (a resumed search keeps the wider range).
    The objective is replaced by the rate itself (higher is better), so no run is needed."""
    import fedgalore.tune.search as search_mod
    from fedgalore.tune.search import stored_space

    monkeypatch.setattr(search_mod, "_objective", lambda spec, row, say: lambda trial: row.space["train.lr"].suggest(trial))
    spec = _spec(tmp_path, trials=2, space=["train.lr=log:1e-7:1e-6"])
    row = build_rows(spec)[0]
    study = open_study(spec, row, storage_url(spec))
    study.enqueue_trial({"train.lr": 9.5e-7})  # the first trial at the top edge
    search(spec, [row], lambda s: None)
    study = open_study(spec, row, storage_url(spec), check=False)
    trials = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(trials) == 3 and max(t.params["train.lr"] for t in trials[2:]) > 1e-7
    assert study.user_attrs["widened"] == ["train.lr high: log:1e-07:1e-06 -> log:1e-07:1e-05"]
    assert stored_space(study, row)["train.lr"] == Param("train.lr", "log", 1e-7, 1e-5)
    search(spec, [row], lambda s: None)  # resumed: nothing more to do, nothing widened twice
    assert len(open_study(spec, row, storage_url(spec), check=False).trials) == 3


def test_a_study_refuses_another_config_or_other_data(tmp_path) -> None:
    spec = _spec(tmp_path, trials=1, rounds=1)
    open_study(spec, build_rows(spec)[0], storage_url(spec))
    other = _spec(tmp_path, trials=1, rounds=1)
    other.base.task.options["n_train"] = 150  # other data: nothing was learned yet, so the row starts afresh
    assert open_study(other, build_rows(other)[0], storage_url(other)).user_attrs["identity"]["config"]["task"]["options"]["n_train"] == 150
    search(other, build_rows(other), lambda s: None)  # one finished trial: now the study holds results
    third = _spec(tmp_path, trials=1, rounds=1)
    third.base.task.options["seed"] = 1  # other data and model weights: another setup
    with pytest.raises(ConfigError, match=r"another config or inputs \(task.options.n_train: 150 -> 160\)"):
        open_study(third, build_rows(third)[0], storage_url(third))


def _cli(*args: str, timeout: int = 300) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fedgalore.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def test_a_killed_tune_resumes_its_trial_from_the_checkpoint(tmp_path) -> None:
    cfg = _config(tmp_path, rounds=8)
    out = tmp_path / "tune"
    args = ["tune", "--config", str(cfg), "--methods", "fedit", "--trials", "1", "--no-confirm", "--out", str(out),
            "output.progress=plain"]
    proc = _cli(*args)
    t0 = time.time()
    metrics = None
    while time.time() - t0 < 240:
        found = list(out.glob("trials/fedit/*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            metrics = found[0]
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert metrics is not None, f"the trial never reached round 3: {proc.communicate()[0][-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(metrics.read_text().splitlines())
    assert done_before < 8
    second = _cli(*args)
    log = second.communicate(timeout=300)[0]
    assert second.returncode == 0, log[-2000:]
    assert "re-queued" in log and "resuming" in log
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 9)), "the resumed run continues the killed one's rounds, none twice"
    spec = _spec(tmp_path, rounds=8, trials=1)
    trials = _trials(spec)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[1].user_attrs["retry_of"] == 0 and trials[1].params == trials[0].params
    assert sorted(trials[1].intermediate_values) == list(range(1, 9)), "the rounds before the kill are reported again"
    assert trials[1].user_attrs["run_dir"] == trials[0].user_attrs["run_dir"]


def test_two_workers_share_one_study_and_its_trial_budget(tmp_path) -> None:
    spec = _spec(tmp_path, rounds=3, trials=4, workers=2, space=["train.lr=log:1e-3:1e-1"], widen=False)
    tune(spec, lambda s: None, confirm=False)
    trials = _trials(spec)
    counted = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert 4 <= len(counted) <= 5, "the budget is the study's, not each worker's (a worker may start one last trial)"
    assert len({t.user_attrs["worker"]["pid"] for t in trials}) == 2


def test_confirmation_report_recommends_from_held_out_seeds_only(tmp_path, capsys) -> None:
    cfg = _config(tmp_path, rounds=3)
    out = tmp_path / "tune"
    rc = main(["tune", "--config", str(cfg), "--methods", "fedit,fedavg_full", "--trials", "2", "--heldout-seeds", "1,2",
               "--space", "fedit:method.rank=choice:2,16", "--out", str(out), "--close", "0"])
    assert rc == 0
    doc = json.loads((out / "tune_report.json").read_text())
    held = doc["heldout"][0]
    assert held["rounds"] == 3 and held["seeds"] == [1, 2] and {r["label"] for r in held["rows"]} == {"fedit", "fedavg_full"}
    assert len(held["rows"]) == len({c["name"].rsplit("-s", 1)[0] for c in (json.loads(p.read_text()) for p in (out / "cells").glob("*.json"))})
    cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    configs = {c["name"].rsplit("-s", 1)[0] for c in cells}  # a best per row, and a runner-up tied with it (close 0)
    assert len(cells) == 2 * len(configs) and {c["seed"] for c in cells} == {1, 2}
    assert {c["role"] for c in cells if c["label"] == "fedit"} >= {"best"}
    for row in held["rows"]:
        mine = [c for c in cells if c["name"].rsplit("-s", 1)[0] == row["key"]]
        assert row["per_seed"] == [c["final"]["accuracy"] for c in sorted(mine, key=lambda c: c["seed"])]
        for c in mine:  # every cell records the model and data files its run read (tiny_text reads none)
            assert c["inputs"] == json.loads((out / "confirm" / c["name"] / "identity.json").read_text())["inputs"]
        assert row["client_training_bytes"] > 0 and row["dense_bytes"] > 0
        assert row["up_vs_dense"] == pytest.approx(row["bytes_up_per_client_round"] / row["dense_bytes"])
    fedit = next(r for r in held["rows"] if r["label"] == "fedit" and r["role"] == "best")
    assert fedit["rank"] in (2, 16) and fedit["width"] == 16
    md = (out / "tune_report.md").read_text()
    assert f"run **{held['rows'][0]['label']}**" in md
    if fedit["up_vs_dense"] > 1:
        assert "not low-rank" in md
    cost = doc["tuning_cost"]
    assert cost["client_rounds"] <= cost["client_rounds_unpruned"] and cost["confirm_client_rounds"] == len(cells) * 3 * 2
    for png in ("tune_search.png", "tune_history.png", "tune_heldout.png"):
        assert (out / png).stat().st_size > 1000
    assert "tune dir:" in capsys.readouterr().out


def test_tuning_under_privacy_without_a_site_ledger_is_refused_in_one_line(tmp_path, capsys) -> None:
    cfg = _config(tmp_path)
    rc = main(["tune", "--config", str(cfg), "--methods", "fedit", "--out", str(tmp_path / "t"),
               "privacy.client.clip=0.5", "privacy.client.noise_multiplier=1.0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "spends privacy budget on every trial" in err[0] and "privacy.sites_dir" in err[0] and "proxy split" in err[0]
    assert not (tmp_path / "t" / "tune.db").exists()


def test_tuning_under_privacy_is_accounted_in_the_sites_ledgers(tmp_path) -> None:
    from fedgalore.job.config import FederatedConfig

    spec = _spec(tmp_path, rounds=2, trials=1, heldout_seeds=[1])
    d = spec.base.to_dict()
    d["privacy"].update({"client": {"clip": 0.5, "noise_multiplier": 1.0}, "sites_dir": str(tmp_path / "sites")})
    spec.base = FederatedConfig.from_dict(d)
    tune(spec, lambda s: None)
    doc = json.loads((spec.out / "tune_report.json").read_text())
    p = doc["privacy"]
    ledgers = list((tmp_path / "sites").glob("*/fedgalore-ledger.jsonl"))
    lines = sum(len(f.read_text().splitlines()) for f in ledgers)
    assert ledgers and p["releases"] == lines > 0, "every trial's and confirmation's release is in the sites' ledgers"
    assert all(math.isfinite(v["rows"]) and v["rows"] > 0 for v in p["sites"].values())
    assert "Privacy spent by the tune" in (spec.out / "tune_report.md").read_text()
    assert all("plan_probe" not in f.read_text() for f in ledgers), "the report's plan releases nothing on the sites"
