"""The issue-33 horizon study's driver (benchmarks/horizon.py): the rate choice and its widening,
the per-cell result JSONs that make it resumable (a changed config runs again), the report's
metrics against the cells, and ``--quick`` through every stage with real runs."""
from __future__ import annotations

import importlib
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def hz(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("horizon")


def _budget(hz, tmp_path: Path):
    return replace(hz.FULL, runs=tmp_path / "runs", results=tmp_path / "results")


def _fake(hz, budget, cell, test: dict[int, float], val: dict[int, float] | None = None, **extra) -> dict:
    """A result JSON as cell_record writes it, with the config the stages would run now."""
    rounds = []
    for k in range(1, budget.rounds + 1):
        r = {"round": k, "clients": [k % 50, (k + 7) % 50], "dropped": [], "steps": [6, 7], "train_loss": 0.5,
             "diag": {"mismatch_before": 0.1 * k, "drift_mean": 1.0}}
        if k in test:
            r["test"] = {"accuracy": test[k]}
            r["val"] = {"accuracy": (val or test)[k]}
        rounds.append(r)
    rec = {"version": hz.CELL_VERSION, "alpha": cell.alpha, "row": cell.row, "label": cell.label, "lr": cell.lr,
           "seed": cell.seed, "status": "complete", "config": hz.planned_config(budget, cell),
           "source": {"fedgalore": "0", "mechanism_digest": "d"}, "partition_digest": f"p{cell.seed}", "client_sizes": [1],
           "bytes_up_per_client_round": 2**20, "bytes_down_per_client_round": 2**21, "wall_time_s": 600.0,
           "time_per_round_s": 12.0, "rounds": rounds, **extra}
    hz._write_json(hz.cell_json(budget, cell), rec)
    return rec


def _evaluated_rounds(budget) -> list[int]:
    return sorted({*range(budget.eval_every, budget.rounds + 1, budget.eval_every),
                   *range(budget.rounds - budget.last + 1, budget.rounds + 1)})


def test_full_budget_is_the_issue_budget(hz) -> None:
    from fedgalore.job.config import load_config

    cfg = load_config(hz.FULL.config, hz.FULL.overrides)
    f = cfg.federation
    assert (f.num_clients, f.clients_per_round, f.rounds, f.eval_every, f.eval_last) == (50, 5, 50, 2, 10)
    assert (f.validation_fraction, f.partition.min_size, f.partition.max_retries) == (0.1, 1, 1000)
    assert (cfg.train.local_epochs, cfg.method.rank, cfg.task.options["max_length"]) == (2, 8, 64)
    # the 6-round rates are the issue-17 choices at alpha 0.3 (paper mode's excepted: old paper mode)
    choice = json.loads((BENCH / "results/repro_text/alignment/alignment.json").read_text())["alphas"]["dirichlet:0.3"]["choice"]
    src = {"fedgalore": "fedgalore_aligned", "fedgalore_minus": "fedgalore_minus", "fedavg_full": "fedavg_full",
           "fedit_prox": "fedit", "fedit": "fedit", "fedavg_full_prox": "fedavg_full", "fedavg_full_scaffold": "fedavg_full"}
    assert {row: float(choice[s]) for row, s in src.items()} == {row: hz.SIX_ROUND_RATE[row] for row in src}
    # alpha 0.1 grids reach 10x below the choice; the row options are what the rows say
    for row in hz.ROWS:
        grid = hz.probe_rates(row, hz.ALPHA_01)
        assert grid[0] == hz.SIX_ROUND_RATE[row] and grid[0] / grid[-1] >= 10 - 1e-9
    cfg = hz.planned_config(hz.FULL, hz.CellSpec("dirichlet:0.3", "fedit_prox", 5e-3, 1))
    assert (cfg["method"]["name"], cfg["train"]["prox_mu"], cfg["train"]["lr"], cfg["seed"]) == ("fedit", 0.1, 5e-3, 1)
    assert hz.planned_config(hz.FULL, hz.CellSpec("dirichlet:0.3", "fedgalore_paper", 1e-2, 0))["method"]["options"][
        "moment_protocol"] == "paper"
    assert "dir" not in cfg["output"] and "run_name" not in cfg["output"]


def test_choice_uses_validation_over_the_last_rounds_and_widens_once_at_an_edge(hz, tmp_path) -> None:
    b = _budget(hz, tmp_path)
    ev = _evaluated_rounds(b)
    a, row = hz.ALPHA_01, "fedgalore_minus"

    def put(lr, val_last, test_last=0.5, val_early=0.99):
        # validation is best early at every rate: only the last-10 mean may decide
        val = {k: (val_last if k > b.rounds - b.last else val_early) for k in ev}
        _fake(hz, b, hz.CellSpec(a, row, lr, 0), {k: test_last for k in ev}, val)

    for lr, v in ((1e-2, 0.3), (3e-3, 0.5), (1e-3, 0.6), (3e-4, 0.7)):
        put(lr, v, test_last=1.0 - v)  # test says the opposite of validation
    st = hz.probe_state(b, row, a)
    assert st["widened"] == 1e-4 and [c.lr for c in st["todo"]] == [1e-4] and st["choice"] is None
    put(1e-4, 0.7)  # a tie with 3e-4: the smaller rate
    st = hz.probe_state(b, row, a)
    assert st["choice"] == 1e-4 and st["scores"][3e-4] == pytest.approx(0.7)
    put(1e-4, 0.69)
    assert hz.probe_state(b, row, a)["choice"] == 3e-4
    # best at the top edge: one step up; inside the grid: no widening; alpha 0.3: never
    assert hz.widen_rate(b, "fedavg_full", a, 5e-4) == 1e-3 and hz.widen_rate(b, "fedit_prox", a, 5e-3) == 1e-2
    assert hz.widen_rate(b, row, a, 1e-3) is None
    assert hz.widen_rate(b, row, "dirichlet:0.3", 5e-3) is None and hz.probe_rates("fedavg_full", "dirichlet:0.3") == [5e-4, 2.5e-4]
    assert hz.rate_tag(2.5e-4) == "2.5e-4" and hz.rate_tag(1.25e-4) == "1.25e-4" and hz.rate_tag(1e-2) == "1e-2"


def test_a_cell_with_another_config_or_version_runs_again(hz, tmp_path, capsys) -> None:
    b = _budget(hz, tmp_path)
    cell = hz.CellSpec("dirichlet:0.3", "fedavg_full", 5e-4, 1)
    rec = _fake(hz, b, cell, {50: 0.9})
    assert hz.load_cell(b, cell) == rec
    assert hz.run_cells(b, [cell], workers=1, dry_run=True) == [] and "0 cell(s) to run" in capsys.readouterr().out
    rec["config"]["train"]["weight_decay"] = 0.0
    hz._write_json(hz.cell_json(b, cell), rec)
    hz._SAID.clear()
    assert hz.load_cell(b, cell) is None and "train.weight_decay" in capsys.readouterr().out
    assert hz.load_cell(b, cell, check=False) == rec  # readable, but not current
    hz.run_cells(b, [cell], workers=1, dry_run=True)
    assert f"would run {cell.key}" in capsys.readouterr().out
    _fake(hz, b, cell, {50: 0.9}, version=hz.CELL_VERSION + 1)
    assert hz.load_cell(b, cell) is None


def test_report_metrics_and_paired_intervals_from_the_cells(hz, tmp_path) -> None:
    from scipy import stats

    b = _budget(hz, tmp_path)
    ev = _evaluated_rounds(b)
    a = "dirichlet:0.3"
    # IID reference: 0.9 over the last 10 rounds -> target 0.81
    _fake(hz, b, hz.iid_cell(b), {k: 0.9 for k in ev})
    curves = {}
    for row, base in (("fedgalore", 0.80), ("fedgalore_minus", 0.70)):
        _fake(hz, b, hz.CellSpec(a, row, 1e-2, 0), {k: base for k in ev})
        _fake(hz, b, hz.CellSpec(a, row, 5e-3, 0), {k: base - 0.1 for k in ev})
        for s in b.seeds:
            acc = {k: min(1.0, base + 0.01 * s + 0.002 * k) for k in ev}
            acc[30] = 0.2 + 0.01 * s  # one collapse after round 10
            val = {k: 0.5 for k in ev}
            val[20] = val[44] = 0.6  # best validation twice: the earliest round
            curves[row, s] = acc
            _fake(hz, b, hz.CellSpec(a, row, 1e-2, s), acc, val)
    res = hz.report(hz.Plan(b, ["fedgalore", "fedgalore_minus"], [a]))
    entry = res["alphas"][a]
    assert res["iid_reference"]["target_90"] == pytest.approx(0.81)
    assert entry["probe"]["fedgalore"]["choice"] == 1e-2 and entry["missing"] == []
    for (row, s), acc in curves.items():
        m = entry["rows"][row]["per_seed"][s]
        assert m["last"] == pytest.approx(statistics.mean(acc[k] for k in ev if k > 40))
        assert m["val_pick_round"] == 20 and m["val_pick"] == acc[20]
        assert m["worst_after"] == pytest.approx(0.2 + 0.01 * s)
        assert m["std_after"] == pytest.approx(statistics.pstdev(acc[k] for k in ev if k >= 10))
        target = res["iid_reference"]["target_90"]
        assert m["rounds_to_target"] == min((k for k in ev if acc[k] >= target), default=b.rounds + 1)
        assert m["rounds_to_target_stay"] == min((k for k in ev if all(acc[j] >= target for j in ev if j >= k)), default=b.rounds + 1)
    p = entry["paired"]["fedgalore-fedgalore_minus"]["last"]
    d = [entry["rows"]["fedgalore"]["per_seed"][s]["last"] - entry["rows"]["fedgalore_minus"]["per_seed"][s]["last"] for s in b.seeds]
    half = stats.t.ppf(0.975, 3) * statistics.stdev(d) / 2
    assert p["mean"] == pytest.approx(statistics.mean(d)) and p["t95"] == pytest.approx([p["mean"] - half, p["mean"] + half])
    assert p["bootstrap95"][0] <= p["mean"] <= p["bootstrap95"][1]
    rr = entry["rows"]["fedgalore"]
    assert rr["curve"]["round"] == ev and rr["curve"]["test_mean"][0] == pytest.approx(statistics.mean(curves["fedgalore", s][2] for s in b.seeds))
    assert rr["drift"]["mismatch_before"]["last_rounds_mean"] == pytest.approx(statistics.mean(0.1 * k for k in range(41, 51)))
    pj = rr["projector"]
    assert (pj["refreshes_max"], pj["seeded_refreshes"], pj["client_rounds"]) == (1, 0, 4 * 50 * 2)
    assert res["pairing"]["problems"] == []  # the fakes share clients per round; partitions per seed
    assert (b.results / "accuracy_a0.3.png").stat().st_size > 0 and (b.results / "drift_a0.3.png").is_file()
    md = (b.results / "horizon.md").read_text()
    assert "| fedgalore | 1e-2 | 4 |" in md and "Paired fedgalore − fedgalore_minus" in md
    # a held-out cell that ran another config is not reported
    rec = json.loads(hz.cell_json(b, hz.CellSpec(a, "fedgalore", 1e-2, 4)).read_text())
    rec["config"]["seed"] = 7
    hz._write_json(hz.cell_json(b, hz.CellSpec(a, "fedgalore", 1e-2, 4)), rec)
    entry = hz.report(hz.Plan(b, ["fedgalore", "fedgalore_minus"], [a]))["alphas"][a]
    assert entry["rows"]["fedgalore"]["seeds"] == [1, 2, 3] and entry["missing"] == ["a0.3/fedgalore_lr1e-2-s4"]
    assert math.isclose(entry["paired"]["fedgalore-fedgalore_minus"]["last"]["mean"], statistics.mean(d[:3]))


def test_every_row_gets_the_same_partition_validation_split_and_batches_per_seed(hz, tmp_path) -> None:
    """The pairing the study rests on: for one seed and setting, every row's run holds out the same
    validation examples, gives each client the same examples and draws the same mini-batches
    (client sampling takes no method either: ``sample_clients(seed, round, M, K)``)."""
    import torch

    from fedgalore.job.config import FederatedConfig
    from fedgalore.engine.runtime import Runtime

    b = hz.quick_budget(tmp_path)
    ref = None
    for row in hz.ROWS:
        rt = Runtime(FederatedConfig.from_dict(hz.planned_config(b, hz.CellSpec("dirichlet:0.3", row, 1e-3, 3))))
        gen, n = rt.batches(client=4, round_idx=7)
        got = ([p.tolist() for p in rt.parts], rt.validation_idx.tolist(), [x["input_ids"] for x in gen()])
        assert n > 0 and len(rt.validation_idx) > 0
        if ref is None:
            ref = got
        assert got[:2] == ref[:2], row
        assert len(got[2]) == len(ref[2]) and all(torch.equal(x, y) for x, y in zip(got[2], ref[2])), row


def test_pairing_check_names_a_cell_with_other_clients(hz) -> None:
    cells = [{"alpha": "dirichlet:0.1", "seed": 1, "label": lab, "partition_digest": lab, "client_sizes": [5, 7],
              "rounds": [{"clients": cl}]} for lab, cl in (("a", [1, 2]), ("b", [1, 2]), ("c", [1, 3]))]
    # partition.json's digest may differ (its format changed between code versions): the sizes decide
    assert hz.pairing_check(cells) == ["a0.1 seed 1: c differs from a in its client samples"]
    cells[1]["client_sizes"] = [6, 6]
    assert hz.pairing_check(cells)[0] == "a0.1 seed 1: b differs from a in its partition"


@pytest.mark.slow
def test_quick_runs_every_stage_end_to_end_and_resumes(hz, tmp_path, capsys) -> None:
    """``--quick``: real ``fedgalore compare`` workers on tiny_text for the probe (with its
    widening), the held-out seeds and the report; the report's numbers are the cells'; a second
    pass runs nothing; a cell whose JSON is lost but whose run finished is recovered without
    running; the engine gives every row the same partition and client samples per seed."""
    root = ["--quick", "--root", str(tmp_path), "--workers", "2"]
    assert hz.main(["horizon_probe", *root]) == 0
    assert hz.main(["horizon_seeds", *root]) == 0
    assert hz.main(["horizon_report", *root]) == 0
    b = hz.quick_budget(tmp_path)
    cells = sorted(p.relative_to(b.results / "cells").as_posix() for p in (b.results / "cells").rglob("*.json"))
    assert len(cells) == 2 * 3 + 1 + 2 * 2, cells  # 2 rows x (2 rates + 1 widening), IID, 2 rows x 2 seeds
    res = json.loads((b.results / "horizon.json").read_text())
    assert res["pairing"] == {"cells": 10, "problems": []}
    entry = res["alphas"]["dirichlet:0.3"]
    for row in hz.QUICK_ROWS:
        st = hz.probe_state(b, row, "dirichlet:0.3")
        assert st["widened"] is not None and entry["probe"][row]["choice"] == st["choice"] == hz.choose(st["scores"])
        for s in b.seeds:
            rec = hz.load_cell(b, hz.CellSpec("dirichlet:0.3", row, st["choice"], s))
            assert rec["config"] == hz.planned_config(b, hz.CellSpec("dirichlet:0.3", row, st["choice"], s))
            assert [r["round"] for r in rec["rounds"] if "test" in r] == [2, 3, 4]  # eval_every 2 + eval_last 2
            assert all("accuracy" in r["val"] for r in rec["rounds"] if "test" in r)
            assert entry["rows"][row]["per_seed"][str(s)]["last"] == pytest.approx(
                statistics.mean(r["test"]["accuracy"] for r in rec["rounds"] if r["round"] > 2))
            assert rec["bytes_up_per_client_round"] > 0 and all(r["steps"] for r in rec["rounds"])
    capsys.readouterr()
    lost = hz.cell_json(b, hz.CellSpec("dirichlet:0.3", "fedavg_full", entry["probe"]["fedavg_full"]["choice"], 2))
    kept = lost.read_text()
    lost.unlink()
    assert hz.main(["horizon_probe", *root]) == 0 and hz.main(["horizon_seeds", *root]) == 0
    out = capsys.readouterr().out
    assert " start " not in out and lost.read_text() == kept


def test_a_cell_run_on_a_gpu_is_the_same_cell_and_the_report_names_its_device(hz, tmp_path, capsys) -> None:
    """``--device cuda`` changes where a cell runs, not which cell it is: its JSON (config.device
    cuda) is accepted as the cell, any other change still runs it again, the workers get the
    override, and the report lists the GPU cells and times the CPU cells alone."""
    b = _budget(hz, tmp_path)
    cell = hz.CellSpec("dirichlet:0.3", "fedavg_full", 5e-4, 1)
    rec = _fake(hz, b, cell, {50: 0.9})
    rec["config"]["device"] = "cuda"
    hz._write_json(hz.cell_json(b, cell), rec)
    assert hz.load_cell(b, cell) == rec and hz.cell_device(rec) == "cuda"
    assert hz.same_run(rec["config"], hz.planned_config(b, cell)) is None
    other = json.loads(json.dumps(rec))
    other["config"]["train"]["lr"] = 1e-3
    assert "train.lr" in hz.same_run(other["config"], hz.planned_config(b, cell))
    argv = hz.worker_argv(b, cell, "cuda")
    assert argv[-2:] == ["device=cuda", "--no-report"] and "device=cuda" not in hz.worker_argv(b, cell)
    cpu = _fake(hz, b, replace(cell, seed=2), {50: 0.8}, wall_time_s=600.0, cpu_time_s=700.0)
    rr = hz.row_report(b, [rec, cpu], None)
    assert rr["devices"] == {1: "cuda", 2: "cpu"}
    assert rr["wall_time_min"] == pytest.approx(10.0) and rr["cpu_time_min"] == pytest.approx(700 / 60)


def test_seeds_and_device_options_select_and_refuse_with_one_line(hz, monkeypatch) -> None:
    for argv, msg in ((["horizon_seeds", "--seeds", "7"], "--seeds: 7 is not a held-out seed"),
                      (["horizon_seeds", "--seeds", "a"], "--seeds takes integers"),
                      (["horizon_seeds", "--device", "tpu"], "--device 'tpu' must be cpu, cuda[:N] or mps")):
        with pytest.raises(SystemExit, match=msg.replace("[", r"\[").replace("]", r"\]")):
            hz.main([*argv, "--dry-run"])
    seen = {}

    def fake_run(budget, cells, workers, dry_run=False, followups=lambda: [], device=None):
        seen.update(cells=cells, device=device, workers=workers)
        return []

    monkeypatch.setattr(hz, "run_cells", fake_run)
    monkeypatch.setattr(hz, "probe_state", lambda b, row, a: {"choice": 1e-3})
    assert hz.main(["horizon_seeds", "--seeds", "4,3", "--rows", "fedavg_full", "--device", "cuda", "--workers", "15"]) == 0
    assert [c.seed for c in seen["cells"]] == [4, 4, 3, 3]  # in the order asked, both alphas of each
    assert {c.alpha for c in seen["cells"]} == {hz.ALPHA_01, "dirichlet:0.3"} and {c.row for c in seen["cells"]} == {"fedavg_full"}
    assert seen["device"] == "cuda" and seen["workers"] == 15
    assert hz.main(["horizon_seeds", "--rows", "fedavg_full"]) == 0
    assert [c.seed for c in seen["cells"]] == [1, 1, 2, 2, 3, 3, 4, 4] and seen["device"] is None


def test_tolerance_stage_runs_the_six_round_rates_and_the_report_pairs_them(hz, tmp_path, capsys) -> None:
    """``horizon_tolerance``: the rows at their 6-round rate on the held-out seeds (the GaLore rows
    at alpha 0.1 by default); the report gives them their own table and paired differences, and
    only when some row's 6-round rate is not its chosen one."""
    b = _budget(hz, tmp_path)
    a = hz.ALPHA_01
    plan = hz.Plan(b, hz.TOLERANCE_ROWS, [a], seeds=(2, 1))
    cells = hz.tolerance_cells(plan)
    assert [(c.row, c.lr, c.seed) for c in cells[:3]] == [(r, 1e-2, 2) for r in hz.TOLERANCE_ROWS]
    assert len(cells) == 6 and {c.alpha for c in cells} == {a}
    assert hz.stage_tolerance(replace(plan, dry_run=True)) == []
    assert "6 cell(s) to run" in capsys.readouterr().out
    ev = _evaluated_rounds(b)
    _fake(hz, b, hz.iid_cell(b), {k: 0.9 for k in ev})
    for row, low in (("fedgalore", 0.9), ("fedgalore_minus", 0.5)):  # seed 0 chooses 3e-3 for both
        for lr in hz.probe_rates(row, a):
            _fake(hz, b, hz.CellSpec(a, row, lr, 0), {k: 0.95 if lr == 3e-3 else 0.6 for k in ev})
        _fake(hz, b, hz.CellSpec(a, row, 1e-4, 0), {k: 0.5 for k in ev})  # the widening below 3e-4 does not win
        for s in b.seeds:
            _fake(hz, b, hz.CellSpec(a, row, 3e-3, s), {k: 0.95 for k in ev})
            _fake(hz, b, hz.CellSpec(a, row, 1e-2, s), {k: low + 0.01 * s for k in ev})
    res = hz.report(hz.Plan(b, ["fedgalore", "fedgalore_minus"], [a]))
    entry = res["alphas"][a]
    assert entry["probe"]["fedgalore"]["choice"] == 3e-3 and entry["rows"]["fedgalore"]["lr"] == 3e-3
    tol = entry["tolerance"]
    assert tol["rows"]["fedgalore"]["lr"] == 1e-2 and tol["rows"]["fedgalore"]["seeds"] == [1, 2, 3, 4]
    assert tol["paired"]["fedgalore-fedgalore_minus"]["last"]["mean"] == pytest.approx(0.4)
    assert "fedgalore-fedgalore_minus" in entry["paired"] and entry["paired"]["fedgalore-fedgalore_minus"]["last"]["mean"] == pytest.approx(0.0)
    md = (b.results / "horizon.md").read_text()
    assert "### At the 6-round rate" in md and "| fedgalore | 1e-2 | 4 | 92.5 ± 1.3 |" in md
    assert (b.results / "accuracy_tolerance_a0.1.png").stat().st_size > 0
    # each cell counted once, whichever sections show it (probe grid, held-out, tolerance)
    assert res["pairing"]["cells"] == sum(len(hz.probe_rates(r, a)) + 2 * len(b.seeds) for r in ("fedgalore", "fedgalore_minus"))


def test_driver_and_config_share_one_device_rule(hz) -> None:
    """``--device`` is checked by the config's own rule (job/config.py ``device_error``), so the driver
    cannot accept a device that every worker would then refuse, nor refuse one they accept."""
    from fedgalore.job.config import ConfigError, device_error, load_config

    for ok in ("cpu", "mps", "cuda", "cuda:3"):
        assert device_error(ok) is None and load_config(None, [f"device={ok}"]).device == ok
    assert device_error("cuda:") and device_error("cuda:x")
    for bad in ("cudax", "tpu", "gpu"):
        with pytest.raises(ConfigError, match=f"device='{bad}' must be cpu"):
            load_config(None, [f"device={bad}"])
        with pytest.raises(SystemExit, match=f"--device '{bad}' must be cpu"):
            hz.main(["horizon_seeds", "--device", bad, "--dry-run"])


def test_paired_differences_name_the_seeds_that_pair_cells_across_devices(hz) -> None:
    """A device effect enters a paired difference only where its two cells ran on different devices;
    the report names those seeds (the device check found GPU twins' worst rounds 5-13 points lower)."""
    metrics = {m: 0.9 for m in hz.METRICS}
    rows = {"fedgalore": {"per_seed": {1: metrics, 2: metrics, 3: metrics}, "devices": {1: "cpu", 2: "cpu", 3: "cpu"}},
            "fedgalore_minus": {"per_seed": {1: metrics, 2: metrics, 3: metrics}, "devices": {1: "cpu", 2: "cuda", 3: "cpu"}}}
    pairs = hz._paired_rows(rows, [("fedgalore", "fedgalore_minus")])
    assert pairs["fedgalore-fedgalore_minus"]["last"]["cross_device"] == [2]
    assert "; seed 2 pairs a CPU cell with a GPU cell:" in hz._paired_md(pairs)[0]
    rows["fedgalore_minus"]["devices"][2] = "cpu"
    assert "GPU" not in hz._paired_md(hz._paired_rows(rows, [("fedgalore", "fedgalore_minus")]))[0]


def test_epoch_study_probes_its_galore_grids_fixes_fedavg_and_compares_with_the_step_schedule(hz, tmp_path, monkeypatch) -> None:
    """Issue 40's budget: the epoch schedule in every cell's config, the GaLore rows probed on
    their own grids (widened once at either edge, at both alphas), FedAvg-Full at issue 33's rate
    (not probed: it has no projector), issue 33's IID level, and a report section that pairs a
    row's cells with issue 33's cells of the same row on the seeds where both ran on the CPU."""
    e = replace(hz.EPOCH, runs=tmp_path / "runs", results=tmp_path / "results", iid_from=_budget(hz, tmp_path / "old"))
    old = e.iid_from
    cfg = hz.planned_config(e, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, 1))
    assert cfg["method"]["options"]["projector_schedule"] == "epoch"
    assert hz.planned_config(old, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, 1))["method"]["options"]["projector_schedule"] == "steps"
    assert hz.probe_rates("fedgalore_paper", hz.ALPHA_01, e) == [1e-2, 3e-3, 1e-3]
    assert hz.probe_rates("fedgalore", "dirichlet:0.3", e) == [1e-2, 5e-3, 2.5e-3]
    assert hz.probe_rates("fedavg_full", hz.ALPHA_01, e) == []
    st = hz.probe_state(e, "fedavg_full", hz.ALPHA_01)
    assert st["choice"] == st["fixed"] == 2e-4 and not st["todo"]
    assert hz.widen_rate(e, "fedgalore", "dirichlet:0.3", 2.5e-3) == 1.25e-3
    assert hz.widen_rate(e, "fedgalore", hz.ALPHA_01, 1e-2) == 3e-2 and hz.widen_rate(e, "fedgalore", hz.ALPHA_01, 3e-3) is None
    ev = _evaluated_rounds(e)
    # seed 0 probe of the default row; held-out seeds 1, 2 of the default row and FedAvg-Full, with the
    # new diagnostics; issue 33's default row on seed 1 (CPU) and seed 2 (a GPU cell: left out of the pairing)
    for lr, v in ((1e-2, 0.5), (3e-3, 0.9), (1e-3, 0.6)):
        _fake(hz, e, hz.CellSpec(hz.ALPHA_01, "fedgalore", lr, 0), {k: v for k in ev})
    for s, acc in ((1, 0.95), (2, 0.93)):
        rec = _fake(hz, e, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, s), {k: acc for k in ev})
        for r in rec["rounds"]:
            r["diag"].update(view_step_share=0.5, upload_kept=1.0, warm_kept=0.02)
        hz._write_json(hz.cell_json(e, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, s)), rec)
        _fake(hz, e, hz.CellSpec(hz.ALPHA_01, "fedavg_full", 2e-4, s), {k: acc - 0.01 for k in ev})
    for lr in (1e-2, 3e-3, 1e-3, 3e-4):
        _fake(hz, old, hz.CellSpec(hz.ALPHA_01, "fedgalore", lr, 0), {k: 0.9 if lr == 3e-3 else 0.5 for k in ev})
    _fake(hz, old, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, 1), {k: 0.92 for k in ev})
    gpu = _fake(hz, old, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, 2), {k: 0.80 for k in ev})
    gpu["config"]["device"] = "cuda"
    hz._write_json(hz.cell_json(old, hz.CellSpec(hz.ALPHA_01, "fedgalore", 3e-3, 2)), gpu)
    monkeypatch.setattr(hz, "EPOCH", e)  # the report compares with the module's FULL
    monkeypatch.setattr(hz, "FULL", old)
    out = hz.report(hz.Plan(e, ["fedgalore", "fedavg_full"], [hz.ALPHA_01]))
    entry = out["alphas"][hz.ALPHA_01]
    assert entry["probe"]["fedgalore"]["choice"] == 3e-3 and set(entry["rows"]) == {"fedgalore", "fedavg_full"}
    sw = entry["rows"]["fedgalore"]["sync_where_it_acts"]
    assert sw["view_step_share"]["mean"] == pytest.approx(0.5) and sw["upload_kept"]["min_cell"] == 1.0
    comp = entry["step_schedule"]["fedgalore"]
    assert comp["seeds"] == [1]  # seed 2's old cell ran on a GPU
    assert comp["paired"]["last"]["mean"] == pytest.approx(0.95 - 0.92)
    md = (e.results / "horizon.md").read_text()
    assert "Issue 40" in md and "step schedule" in md and "view_step_share 0.5" in md


def test_a_killed_launch_leaves_the_cpu_time_unmeasured_and_the_report_says_over_how_many_cells(hz, tmp_path) -> None:
    """A worker killed with the machine never reports its CPU time: the cell, resumed and finished
    by a second launch, would otherwise claim the second launch's seconds as the whole run's. Its
    ``cpu_time_s`` is None, and the row's CPU minutes are the mean over the measured cells, with
    their count shown."""
    out = tmp_path / "cell"
    out.mkdir()
    hz._note_source(out)                      # launch 1, killed: no exit
    hz._note_source(out)                      # launch 2
    hz._note_source(out, 120.0)               # launch 2 exits
    rec = json.loads((out / "source.json").read_text())
    assert (rec["launches"], rec["exits"], rec["cpu_s"]) == (2, 1, 120.0)
    assert hz.measured_cpu_s(rec) is None
    one = tmp_path / "one"
    one.mkdir()
    hz._note_source(one)
    hz._note_source(one, 90.0)
    assert hz.measured_cpu_s(json.loads((one / "source.json").read_text())) == 90.0
    # a record an older driver wrote (no counts): kept as it was; launched again: not known
    old = {"mechanism_digests": ["d"], "cpu_s": 50.0}
    assert hz.measured_cpu_s(old) == 50.0
    (out / "source.json").write_text(json.dumps(old))
    hz._note_source(out)
    hz._note_source(out, 30.0)
    again = json.loads((out / "source.json").read_text())
    assert again["cpu_s"] == 80.0 and hz.measured_cpu_s(again) is None
    b = _budget(hz, tmp_path)
    cell = hz.CellSpec("dirichlet:0.3", "fedavg_full", 5e-4, 1)
    recs = [_fake(hz, b, replace(cell, seed=s), {50: 0.9}, wall_time_s=600.0, cpu_time_s=cpu)
            for s, cpu in ((1, 600.0), (2, None), (3, 1200.0))]
    rr = hz.row_report(b, recs, None)
    assert rr["cpu_time_min"] == pytest.approx(15.0) and (rr["cpu_time_cells"], rr["cpu_cells"]) == (2, 3)
    assert hz._cpu_share(rr) == " (2 of 3 cells)"
    table = "\n".join(hz._rows_table(b, {"fedavg_full": rr}))
    assert "| 10.0 / 15.0 (2 of 3 cells) |" in table and "whose every launch was measured" in table
    rr_all = hz.row_report(b, [recs[0], recs[2]], None)
    assert "whose every launch" not in "\n".join(hz._rows_table(b, {"fedavg_full": rr_all}))
