"""Reports from hand-written run directories (the exact format the engine writes)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedgalore.report import ReportError, build_report, find_runs, load_run
from fedgalore.report import tables as T
from fedgalore_testing.reports import LABELS, _md_row, write_run


# accuracy (final) per method / setting / seed
GRID = {
    ("fedavg_full", "iid"): [0.90, 0.92],
    ("fedavg_full", "dirichlet:0.5"): [0.80, 0.84],
    ("fedgalore", "iid"): [0.88, 0.90],
    ("fedgalore", "dirichlet:0.5"): [0.86, 0.88],
}


@pytest.fixture
def comparison_dir(tmp_path: Path) -> Path:
    root = tmp_path / "cmp"
    for (m, s), vals in GRID.items():
        for seed, v in enumerate(vals):
            write_run(root / "runs", m, s, seed, v, up=50_000 if m == "fedavg_full" else 4_000, tpr=1.0 + seed,
                      lr=2e-4 if m == "fedavg_full" else 1e-3)
    return root


def test_load_and_find_runs(comparison_dir: Path) -> None:
    runs = find_runs(comparison_dir)
    assert len(runs) == 8
    r = load_run(runs[0].path)
    assert r.complete and r.history[-1]["round"] == 3 and r.partition["label_names"] == LABELS


def test_aggregate_mean_std_delta_best(comparison_dir: Path) -> None:
    comp = T.aggregate(find_runs(comparison_dir))
    assert comp["methods"] == ["fedavg_full", "fedgalore"]  # paper order
    assert comp["settings"] == ["iid", "dirichlet:0.5"]
    c = comp["cells"]["fedavg_full"]["tiny_text"]["iid"]
    assert c["mean"] == pytest.approx(0.91) and c["std"] == pytest.approx(math.sqrt(2) * 0.01) and c["n"] == 2
    d = comp["delta"]["fedavg_full"]["tiny_text"]["dirichlet:0.5"]
    assert d["mean"] == pytest.approx(-0.09) and d["std"] == pytest.approx(math.sqrt(2) * 0.01) and d["paired"]
    assert comp["delta"]["fedgalore"]["tiny_text"]["dirichlet:0.5"]["mean"] == pytest.approx(-0.02)
    best = comp["best"]["tiny_text"]
    assert best["iid"] == ["fedavg_full"] and best["dirichlet:0.5"] == ["fedgalore"]
    assert best["delta:dirichlet:0.5"] == ["fedgalore"]
    assert comp["comm"]["fedavg_full"]["bytes_up_per_client_round"] == 50_000
    assert comp["comm"]["fedgalore"]["time_per_round"] == pytest.approx(1.5)


def test_report_writes_tables_and_plots(comparison_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    res = build_report(comparison_dir, out)
    md = (out / "table.md").read_text()
    tex = (out / "table.tex").read_text()
    full, gal = _md_row(md, "FedAvg-Full"), _md_row(md, "FedGaLore")
    # columns: method | ✓ | ✗ | Δ | up | down (no wall-time column: that measures the machine's load)
    assert full[1] == "**91.0 ± 1.4**" and full[2] == "82.0 ± 2.8" and full[3] == "↓9.0 ± 1.4"
    assert gal[1] == "89.0 ± 1.4" and gal[2] == "**87.0 ± 1.4**" and gal[3] == "**↓2.0 ± 0.0**"
    assert full[4] == "48.83 KiB" and gal[4] == "3.91 KiB" and gal[5] == "1.95 KiB" and len(gal) == 6
    # one line under the table: the shared budget and each method's learning rate (from config.yaml)
    table = md.split("### Runs")[0]
    assert table.rstrip().splitlines()[-1] == (
        "Budget (every method): 3 rounds × 2 of 4 clients, 2 local steps of batch 8, rank 4. "
        "Learning rate, each method's own: FedAvg-Full 2e-4, FedGaLore 1e-3.")
    assert "s / round" not in table and "| Wall s / round |" in md and "not a comparison of the methods' cost" in md
    assert "Learning rate, each method's own: FedAvg-Full 2e-4" in tex and r"3 rounds $\times$ 2 of 4" in tex
    assert "tiny_text ✓" in md and "tiny_text Δ" in md
    assert r"\textbf{87.0 $\pm$ 1.4}" in tex and r"\textbf{$\downarrow$2.0 $\pm$ 0.0}" in tex
    assert r"\ding{51}" in tex and r"\ding{53}" in tex and r"\begin{tabular}" in tex and r"\bottomrule" in tex
    assert r"FedAvg-Full & \textbf{91.0 $\pm$ 1.4} & 82.0 $\pm$ 2.8 & $\downarrow$9.0 $\pm$ 1.4" in tex
    comp = json.loads((out / "comparison.json").read_text())
    assert comp["cells"]["fedgalore"]["tiny_text"]["dirichlet:0.5"]["values"] == [0.86, 0.88]
    names = {p.name for p in res["files"]}
    for fig in ("curves", "train_loss", "iid_vs_noniid", "partition", "comm_vs_metric"):
        for ext in ("png", "pdf"):
            f = out / "plots" / f"{fig}.{ext}"
            assert f in res["files"] and f.stat().st_size > 1000, f
    for fig in ("tail_energy_mean", "drift_mean", "mismatch", "more"):  # the headline ones alone, the rest together
        f = out / "plots" / "diagnostics" / f"{fig}.png"
        assert f in res["files"] and f.stat().st_size > 1000, f
    assert (out / "plots" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plots" / "curves.pdf").read_bytes()[:5] == b"%PDF-"


def test_single_run_report_one_row(tmp_path: Path) -> None:
    run = write_run(tmp_path, "fedgalore", "dirichlet:0.5", 0, 0.75, status="running")
    res = build_report(run)  # writes into the run dir; an unfinished single run is still reported
    md = (run / "table.md").read_text()
    row = _md_row(md, "FedGaLore")
    assert row[1] == "75.0" and len(row) == 4  # ✗ only (no IID, no Δ) + 2 communication columns
    assert "Learning rate 1e-3 for every method." in md
    assert "tiny_text ✗" in md and "Δ" not in md.split("### Runs")[0].split("\n|")[1]
    files = {p.name for p in res["files"]}
    assert {"curves.png", "partition.png", "drift_mean.png", "comm_vs_metric.pdf"} <= files
    assert "iid_vs_noniid.png" not in files


def test_incomplete_runs_excluded_from_comparison(tmp_path: Path) -> None:
    write_run(tmp_path / "runs", "fedit", "iid", 0, 0.8)
    write_run(tmp_path / "runs", "fedit", "iid", 1, 0.1, status="running")
    comp = build_report(tmp_path, plots=False)["comparison"]
    assert comp["cells"]["fedit"]["tiny_text"]["iid"]["values"] == [0.8]
    assert comp["excluded_incomplete"] == 1
    assert "1 unfinished run(s) not included" in (tmp_path / "table.md").read_text()
    # run folders are given relative to the report (a copied report holds no machine paths)
    assert sorted(r["run_dir"] for r in comp["runs"]) == ["runs/fedit-iid-s0", "runs/fedit-iid-s1"]
    assert str(tmp_path) not in (tmp_path / "table.md").read_text()


def test_lower_is_better_and_multiple_noniid_settings(tmp_path: Path) -> None:
    for m, vals in {"a": (1.0, 1.5, 2.0), "b": (1.2, 1.4, 1.6)}.items():
        for s, v in zip(("iid", "dirichlet:1", "dirichlet:0.1"), vals):
            write_run(tmp_path, m, s, 0, v, metric="mse", higher_is_better=False)
    comp = build_report(tmp_path, plots=False)["comparison"]
    assert comp["settings"] == ["iid", "dirichlet:1", "dirichlet:0.1"]
    assert comp["best"]["tiny_text"]["iid"] == ["a"]  # lower mse wins
    assert comp["best"]["tiny_text"]["delta:dirichlet:0.1"] == ["b"]  # smaller degradation (0.4 < 1.0)
    md = (tmp_path / "table.md").read_text()
    assert "tiny_text ✗ α=0.1" in md and "tiny_text Δ α=1" in md
    row = _md_row(md, "b")
    assert row[1] == "1.200" and row[5] == "**↑0.400**"  # not a percentage; mse went up


def test_ties_are_all_bold(tmp_path: Path) -> None:
    write_run(tmp_path, "x", "iid", 0, 0.5)
    write_run(tmp_path, "y", "iid", 0, 0.5)
    md = build_report(tmp_path, plots=False) and (tmp_path / "table.md").read_text()
    assert _md_row(md, "x")[1] == "**50.0**" and _md_row(md, "y")[1] == "**50.0**"


def test_report_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        find_runs(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no run directories"):
        find_runs(tmp_path / "empty")


def test_tensorboard_sink_writes_the_run_records(comparison_dir: Path, tmp_path: Path) -> None:
    """Event files hold exactly the metrics.jsonl values (read back with tensorboard's reader)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedgalore.report.tensorboard import write_tensorboard

    written = write_tensorboard(comparison_dir, tmp_path / "tb")
    assert written
    run_dir = sorted(p for p in (comparison_dir / "runs").iterdir() if (p / "metrics.jsonl").exists())[0]
    acc = EventAccumulator(str(next(p for p in written if p.name == run_dir.name)))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc_tag = next(t for t in tags if t.endswith("accuracy"))
    got = [(e.step, round(e.value, 5)) for e in acc.Scalars(acc_tag)]
    want = [(r["round"], round(r["eval/accuracy"], 5)) for r in recs if "eval/accuracy" in r]
    assert got == want


def test_budget_line_shared_rate_and_sgd_methods(tmp_path: Path) -> None:
    """One rate for all → said once; SGD baselines show their SGD rate (default 2e-2)."""
    from fedgalore.report import find_runs

    write_run(tmp_path, "fedit", "iid", 0, 0.6, lr=5e-3)
    write_run(tmp_path, "ffa_lora", "iid", 0, 0.5, lr=5e-3)
    comp = T.aggregate(find_runs(tmp_path))
    assert comp["budget"].endswith("Learning rate, each method's own: FedIT 5e-3, FFA-LoRA 2e-2 (SGD).")
    write_run(tmp_path, "fedavg_full", "iid", 0, 0.6, lr=5e-3, rounds=4)
    comp = T.aggregate(find_runs(tmp_path))
    assert comp["budget"].startswith("Budgets differ: FedAvg-Full: 4 rounds")


def test_plots_say_what_they_show(comparison_dir: Path) -> None:
    """Each diagnostic is its own figure, titled in words with one line of what good looks like; the
    mismatch figure explains its two line styles; the comm plot's byte ticks do not run into each other."""
    from fedgalore.report import find_runs
    from fedgalore.report.plots import comm_figure, diag_title, diagnostics_figure

    runs = find_runs(comparison_dir)
    methods = ["fedavg_full", "fedgalore"]
    for key in ("tail_energy_mean", "drift_mean", "mismatch", "ajive_rank", "new_key"):
        fig = diagnostics_figure(runs, methods, key)
        if key == "new_key":
            assert fig is None  # no run recorded it
            continue
        title, *hint = fig._suptitle.get_text().split("\n")
        assert title == diag_title(key) and "_" not in title  # no raw keys such as drift_max
        hint = " ".join(hint)  # one line of what a healthy run shows (wrapped to the figure's width)
        assert hint.startswith("dashed (before sync): lower" if key == "mismatch" else "good: ") and len(hint) < 160, hint
        assert [ax.get_title() for ax in fig.axes] == ["iid", "dirichlet:0.5"]  # one panel per setting
    assert diag_title("drift_max") == "client drift ‖Δᵢ − Δ̄‖ / ‖Δ̄‖ (max)" and diag_title("new_key") == "new key"
    from fedgalore.report.plots import diag_hint, diagnostics_grid

    grid = diagnostics_grid(runs, methods, ["tail_energy_max", "ajive_rank", "new_key"])  # the others, one panel each
    titles = [" ".join(ax.get_title().split()) for ax in grid.axes if ax.get_visible()]  # the hint wrapped to fit
    assert titles == [" ".join(f"{diag_title(k)} {diag_hint(k)}".split()) for k in ("tail_energy_max", "ajive_rank")]
    mism = diagnostics_figure(runs, methods, "mismatch").axes[0]
    legend = [t.get_text() for t in mism.get_legend().get_texts()]
    assert any(t.startswith("before sync: spread across clients") for t in legend)
    assert any(t.startswith("after sync: clients' own V to the synced v̄") for t in legend)

    for r in runs:  # a wide byte range (16 KiB .. 64 GiB): the case whose labels ran together
        for k, rec in enumerate(r.history):
            rec["cum_bytes_up"] = 2 ** (14 + 11 * k)
    fig, drew = comm_figure(runs, methods)
    assert drew
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text() and t.get_visible()
                 and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        assert 2 <= len(boxes) <= 6
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
