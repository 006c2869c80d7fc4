"""The issue-8 grid driver's summaries (benchmarks/repro_offline_text.py): the heterogeneity sweep
and the step-size study read every finished cell of a stage from its run folders."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def driver(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("repro_offline_text")


def _stage(tmp_path: Path, cells: list[tuple[str, str, float, list[float]]]) -> Path:
    out = tmp_path / "stage"
    grid = []
    for label, setting, acc, norms in cells:
        rd = f"runs/{label}-{setting.replace(':', '')}-s0"
        (out / rd).mkdir(parents=True)
        (out / rd / "summary.json").write_text(json.dumps({"status": "complete", "final": {"accuracy": acc}}))
        (out / rd / "diagnostics.jsonl").write_text(
            "".join(json.dumps({"round": i + 1, "client_update_norm_mean": n, "mismatch_after": 0.5}) + "\n"
                    for i, n in enumerate(norms)))
        grid.append({"label": label, "setting": setting, "seed": 0, "run_dir": rd})
    (out / "grid.json").write_text(json.dumps({"cells": grid}))
    return out


def test_alpha_sweep_orders_settings_by_alpha_with_iid_last(driver, tmp_path) -> None:
    out = _stage(tmp_path, [("a", "iid", 0.9, [1]), ("a", "dirichlet:10", 0.85, [1]), ("a", "dirichlet:0.1", 0.3, [1]),
                            ("b", "dirichlet:0.5", 0.6, [1]), ("b", "iid", 0.95, [1])])
    res = driver.alpha_sweep_figure(out, tmp_path / "res")
    assert res["settings"] == ["dirichlet:0.1", "dirichlet:0.5", "dirichlet:10", "iid"]
    assert res["final_accuracy"] == {"a": {"iid": 0.9, "dirichlet:10": 0.85, "dirichlet:0.1": 0.3},
                                     "b": {"dirichlet:0.5": 0.6, "iid": 0.95}}
    assert (tmp_path / "res" / "alpha_sweep.png").stat().st_size > 0
    assert json.loads((tmp_path / "res" / "alpha_sweep.json").read_text()) == res


def test_stepsize_reads_update_norms_per_round(driver, tmp_path) -> None:
    out = _stage(tmp_path, [("fedgalore_lr1e-3", "dirichlet:0.5", 0.8, [0.3, 4.0, 3.0]),
                            ("fedgalore_minus_lr1e-3", "dirichlet:0.5", 0.3, [0.3, 0.5, 0.4])])
    res = driver.stepsize_figure(out, tmp_path / "res")
    assert res["fedgalore_lr1e-3"]["client_update_norm_mean"] == [0.3, 4.0, 3.0]
    assert res["fedgalore_lr1e-3"]["round"] == [1, 2, 3]
    assert res["fedgalore_minus_lr1e-3"]["final_accuracy"] == 0.3
    assert (tmp_path / "res" / "stepsize.png").is_file()


def test_lr_labels_and_keys(driver) -> None:
    assert driver._lr_label("fedit", 5e-3) == "fedit_lr5e-3"
    assert driver._lr_label("ffa_lora", 0.5) == "ffa_lora_sgdlr5e-1"
    assert driver._lr_key("lora_fair") == "sgd_lr" and driver._lr_key("fedgalore") == "lr"
    assert sys.modules["repro_offline_text"].TEXT.config.is_file()


def test_vision_study_covers_every_method(driver) -> None:
    vision = importlib.import_module("repro_offline_vision").VISION
    assert vision.config.is_file() and vision.runs.name == "repro_vision"
    assert set(vision.lrs) == set(driver.METHODS) and all(vision.lrs.values())
    from fedgalore.job.config import load_config

    cfg = load_config(vision.config)
    assert (cfg.federation.num_clients, cfg.federation.clients_per_round, cfg.train.local_epochs) == (50, 5, 2)


def test_math_driver_runs_the_command_it_documents(driver) -> None:
    """The math study's docstring gives the `fedgalore compare` command by hand; the driver must run
    exactly that grid, or a user extending the grid by hand would collide with the driver's cells."""
    import re

    math = importlib.import_module("repro_offline_math")
    doc = " ".join(math.__doc__.replace("\\\n", " ").split())
    cmd = re.search(r"fedgalore compare (.*?) Runs go", doc).group(1).split()
    assert cmd[cmd.index("--methods") + 1].split(",") == math.METHODS
    assert cmd[cmd.index("--settings") + 1].split(",") == math.SETTINGS
    assert cmd[cmd.index("--out") + 1] == str(math.OUT) and not math.OUT.is_absolute()
    assert tuple(a for a in cmd if "=" in a) == math.OVERRIDES
    assert math.MATH.results / math.OUT.name == BENCH / "results" / "repro_math"
    from fedgalore.job.config import load_config

    cfg = load_config(math.MATH.config, math.OVERRIDES)
    assert cfg.task.options["n_test"] == 30 and cfg.federation.eval_every == cfg.federation.rounds == 4
    assert cfg.train.lr == 1e-4  # the paper's shared NLG rate, every method


def test_remedy_rows_are_valid_compare_rows_and_the_choice_uses_validation(driver, tmp_path, monkeypatch) -> None:
    """Issue-21 study: every probe row is a config `fedgalore compare` accepts (the remedy where
    the row says, the issue-17 client rate), labels are unique, and the chosen remedy value is the
    best on *validation* (not test), ties to the smaller value."""
    from fedgalore.compare import plan_grid
    from fedgalore.job.config import load_config

    rows = driver.remedy_probe_rows("dirichlet:0.3")
    assert len(rows) == len(set(rows)) == sum(len(driver._remedy_values(b, r)) for b, r in driver.REMEDY_ROWS)
    cells = plan_grid(load_config(driver.CONFIG), list(rows), ["dirichlet:0.3"], [0], tmp_path / "g", method_options=rows)
    by_label = {c.label: c.cfg for c in cells}
    assert by_label["fedit_prox1e-1"].train.prox_mu == 0.1 and by_label["fedit_prox1e-1"].method.name == "fedit"
    assert by_label["fedavg_full_scaffold"].train.scaffold
    adam = by_label["fedgalore_adam1e-2"].federation.server_optimizer
    assert (adam.name, adam.lr, adam.tau, adam.bias_correction) == ("fedadam", 1e-2, 1e-3, True)
    assert by_label["fedgalore"].train.lr == 1e-2 and by_label["fedavg_full"].train.lr == 5e-4  # issue 17's choice

    probe = tmp_path / "remedies" / "probe_a0.3"
    grid = []
    for label, val, test in (("fedit_prox1e-2", 0.50, 0.90), ("fedit_prox1e-1", 0.60, 0.10), ("fedit_prox1", 0.60, 0.20)):
        rd = f"runs/{label}-dirichlet0.3-s0"
        (probe / rd).mkdir(parents=True)
        (probe / rd / "summary.json").write_text(json.dumps({
            "status": "complete", "final": {"accuracy": test}, "final_validation": {"accuracy": val},
            "bytes_up_per_client_round": 1, "bytes_down_per_client_round": 1}))
        (probe / rd / "diagnostics.jsonl").write_text("")
        grid.append({"label": label, "setting": "dirichlet:0.3", "seed": 0, "run_dir": rd})
    (probe / "grid.json").write_text(json.dumps({"cells": grid}))
    monkeypatch.setattr(driver, "RUNS", tmp_path)
    assert driver.remedy_choice()["dirichlet:0.3"] == {"fedit_prox": 0.1}  # val 0.60 twice: the smaller mu, not test's best
