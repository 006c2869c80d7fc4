"""`make demo`: each method at its own probed learning rate (conf/demo_rates.yaml), one shared
budget, and a line under the table that says both."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from fedgalore.cli import _read_method_options, main
from fedgalore.report.tables import _fmt_lr
from fedgalore_testing import REPO, TINY_TEXT, minilm_or_skip

import pytest


def demo_argv() -> list[str]:
    """The `fedgalore compare ...` arguments of the Makefile's demo recipe."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = text.split("\ndemo:", 1)[1]
    line = next(x for x in recipe.splitlines() if "fedgalore compare" in x)
    argv = shlex.split(line.strip())
    return argv[argv.index("compare"):]


def test_demo_rates_are_the_probed_rates() -> None:
    """conf/demo_rates.yaml holds each demo method's probed rate; when a probe is re-run (e.g. after
    FedGaLore's state synchronisation changes) this fails until the demo's rates follow."""
    argv = demo_argv()
    methods = argv[argv.index("--methods") + 1].split(",")
    rates = _read_method_options(str(REPO / argv[argv.index("--method-options") + 1]))
    probe = json.loads((REPO / "benchmarks/results/repro_text/lr_choice.json").read_text())
    # FedGaLore's rate comes from the 6-round sync study (RESULTS §5.3: its default, aligned mode, chosen
    # on the validation split at Dirichlet 0.5, seed 0); the other methods' from the rate probe (RESULTS §4.2)
    align = json.loads((REPO / "benchmarks/results/repro_text/alignment/alignment.json").read_text())
    chosen = {m: probe["choice"][m]["lr"] for m in methods if m != "fedgalore"}
    chosen["fedgalore"] = float(align["alphas"]["dirichlet:0.5"]["choice"]["fedgalore_aligned"])
    assert set(rates) == set(methods)
    for m in methods:
        assert rates[m] == {"train": {"lr": chosen[m]}}, f"update conf/demo_rates.yaml for {m}"
    # the demo reports other runs than those the rates were chosen on: another seed, the probe's budget
    assert argv[argv.index("--seeds") + 1] != str(probe["seed"])
    assert argv[argv.index("--config") + 1] == "conf/repro/offline_text_50.yaml"


@pytest.mark.slow
@pytest.mark.assets
def test_make_demo_command_prints_budget_and_rates(tmp_path, monkeypatch, capsys) -> None:
    """The Makefile's demo command at a tiny budget: the table is printed with one line under it
    giving the budget and each method's own learning rate."""
    minilm_or_skip()
    (tmp_path / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path)
    argv = demo_argv()
    rates = _read_method_options(str(REPO / "conf/demo_rates.yaml"))
    assert main([*argv, *TINY_TEXT, "federation.rounds=2"]) == 0
    out = capsys.readouterr().out
    table = out.split("comparison dir:")[0]
    names = {"fedgalore": "FedGaLore", "fedit": "FedIT", "fedavg_full": "FedAvg-Full"}
    order = argv[argv.index("--methods") + 1].split(",")
    expected = ", ".join(f"{names[m]} {_fmt_lr(rates[m]['train']['lr'])}" for m in order)  # the table's row order
    assert [x for x in table.rstrip().splitlines()[-3:] if x] == [
        "Budget (every method): 2 rounds × 2 of 4 clients, 1 local step of batch 16, rank 8, 16 tokens. "
        f"Learning rate, each method's own: {expected}.",
        "Privacy (every method): none — nothing was protected."]  # the demo runs without differential privacy
    assert re.search(r"\| FedIT \| [\d.]+ \| [\d.]+ \|", table) and "s / round" not in table
    header = next(line for line in table.splitlines() if line.startswith("| Method |"))
    assert header in (REPO / "README.md").read_text()  # the README shows the demo's table as printed
    assert (tmp_path / "runs" / "demo" / "runs" / "fedit-dirichlet0.5-s1" / "summary.json").is_file()


def test_readme_demo_table_states_the_demos_budget_and_rates() -> None:
    """The line under the README's demo table is the one `make demo` prints for its budget and rates."""
    from fedgalore.cli import _load_config
    from fedgalore.compare import plan_grid
    from fedgalore.report import RunRecord
    from fedgalore.report.tables import budget_line

    argv = demo_argv()
    cfg, _ = _load_config(str(REPO / argv[argv.index("--config") + 1]), [])
    rates = _read_method_options(str(REPO / argv[argv.index("--method-options") + 1]))
    methods = argv[argv.index("--methods") + 1].split(",")
    cells = plan_grid(cfg, methods, ["iid"], [1], "/tmp/unused", rates)
    runs = [RunRecord(path=Path(c.name), summary={"method": c.method}, config=c.cfg.to_dict(), label=c.label) for c in cells]
    line = budget_line(runs, methods)
    assert line and line in (REPO / "README.md").read_text(), line
