"""What people read (issue 44): the worst-site column of the comparison table, site names in the
per-round lines, partition heat-map labels that fit, the IID vs non-IID dot plot, one point per
round for a one-round run, and the Hugging Face hub note (once per process, never offline or for
local files)."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg

from fedgalore.report import build_report, find_runs
from fedgalore.report import tables as T
from fedgalore_testing.reports import _md_row, write_run


SITES = ["Lakeview Clinic North", "prescription_refill_requests", "St. Mary's Hospital"]


def add_client_eval(run: Path, worst: float, worst_site: str, rounds: int = 3) -> None:
    """Give a hand-written run per-client evaluations (the engine's metrics.jsonl format)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for rec in rows[-rounds:]:
        clients = {s: {"n": 10, "accuracy": worst if s == worst_site else 0.95} for s in SITES}
        rec["client_eval"] = {"worst_client": worst_site, "clients": clients}
        rec["eval/client_worst_accuracy"] = worst
        rec["eval/client_mean_accuracy"] = (worst + 1.9) / 3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_has_a_worst_site_column_with_its_name(tmp_path):
    root = tmp_path / "cmp"
    for method, worst, site in (("fedgalore", 0.71, SITES[0]), ("fedit", 0.64, SITES[1])):
        for setting in ("iid", "dirichlet:0.5"):
            for seed in (0, 1):
                run = write_run(root / "runs", method, setting, seed, 0.9)
                add_client_eval(run, worst + 0.01 * seed, site)
    res = build_report(root, plots=False)
    md = (root / "table.md").read_text()
    head = next(x for x in md.splitlines() if x.startswith("| Method |"))
    assert "tiny_text worst site ✓" in head and "tiny_text worst site ✗" in head
    row = _md_row(md, "FedGaLore")
    assert "**71.5 ± 0.7** (Lakeview Clinic North)" in row
    assert "64.5 ± 0.7 (prescription_refill_requests)" in _md_row(md, "FedIT")
    assert "Worst site: the metric on the worst client's held-out share" in md
    comp = res["comparison"]
    assert comp["worst"]["fedit"]["tiny_text"]["iid"]["sites"] == [SITES[1], SITES[1]]
    tex = (root / "table.tex").read_text()
    assert r"prescription\_refill\_requests" in tex
    plain = tmp_path / "plain"  # without client_eval: no such column
    write_run(plain / "runs", "fedit", "iid", 0, 0.9)
    build_report(plain, plots=False)
    assert "worst site" not in (plain / "table.md").read_text()


def test_progress_lines_name_the_sites():
    from fedgalore.progress import PlainProgress

    out = io.StringIO()
    p = PlainProgress(out)
    p.start(2, {"run_name": "r", "client_names": SITES})
    p.round_end(0, {"clients": [2, 0], "train_loss": 0.5})
    line = out.getvalue().splitlines()[-1]
    assert "sites St. Mary's Hospital, Lakeview Clinic North |" in line
    numbered = io.StringIO()
    p = PlainProgress(numbered)
    p.start(2, {"run_name": "r"})
    p.round_end(0, {"clients": [2, 0], "train_loss": 0.5})
    assert "clients 2,0 |" in numbered.getvalue()


def _labels_fit(fig, axes_labels) -> None:
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    box = fig.bbox
    for labels, want in axes_labels:
        shown = [t for t in labels if t.get_text()]
        assert ["".join(t.get_text().split()) for t in shown] == ["".join(w.split()) for w in want]  # whole, wrapped
        for t in shown:
            e = t.get_window_extent(renderer)
            assert e.x0 >= box.x0 - 1 and e.x1 <= box.x1 + 1 and e.y0 >= box.y0 - 1 and e.y1 <= box.y1 + 1, t.get_text()
            assert max(len(x) for x in t.get_text().split("\n")) <= 16


def test_partition_heatmap_labels_fit(tmp_path):
    from fedgalore.job.partition_files import partition_figure, wrap_label
    from fedgalore.report.plots import plot_partition

    assert wrap_label("prescription_refill_requests") == "prescription_\nrefill_requests"
    assert wrap_label("site3") == "site3"
    cats = ["prescription_refill_requests", "appointment_scheduling", "billing"]
    rec = {"setting": "natural:site", "by": None, "label_names": cats, "client_names": SITES,
           "histograms": [[5, 3, 1], [0, 7, 2], [4, 4, 4]], "sizes": [9, 9, 12]}
    fig = partition_figure(rec)
    ax = fig.axes[1]
    _labels_fit(fig, [(ax.get_xticklabels(), SITES), (ax.get_yticklabels(), cats)])
    run = write_run(tmp_path, "fedit", "natural:site", 0, 0.9)
    (run / "partition.json").write_text(json.dumps({**rec, "setting": "natural:site"}))
    from fedgalore.report import load_run

    [png, _] = plot_partition([load_run(run)], tmp_path / "plots")
    assert png.stat().st_size > 1000


def test_iid_vs_noniid_is_a_dot_plot(tmp_path):
    from matplotlib.container import BarContainer, ErrorbarContainer

    from fedgalore.report.plots import iid_vs_noniid_figure

    root = tmp_path / "cmp"
    for m, (a, b) in {"fedit": (0.93, 0.91), "fedgalore": (0.95, 0.94)}.items():
        write_run(root / "runs", m, "iid", 0, a)
        write_run(root / "runs", m, "dirichlet:0.5", 0, b)
    fig = iid_vs_noniid_figure(T.aggregate(find_runs(root)))
    ax = fig.axes[0]
    assert not any(isinstance(c, BarContainer) for c in ax.containers) and not ax.patches  # no bars on a zoomed axis
    dots = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(dots) == 2 and [t.get_text() for t in ax.get_legend().get_texts()] == ["IID ✓", "non-IID ✗ dirichlet:0.5"]
    lo, hi = ax.get_ylim()
    assert lo < 91 and hi > 95 and lo > 80  # the values' span, not 0..100 and not cut


def test_one_round_runs_draw_points(tmp_path):
    from fedgalore.report import load_run
    from fedgalore.report.plots import plot_client_eval

    run = write_run(tmp_path, "fedit", "natural:site", 0, 0.9, rounds=1)
    add_client_eval(run, 0.7, SITES[0], rounds=1)
    from matplotlib.figure import Figure

    drawn = []
    orig = Figure.savefig
    Figure.savefig = lambda self, *a, **k: (drawn.append(self), orig(self, *a, **k))[1]
    try:
        plot_client_eval([load_run(run)], tmp_path / "plots")
    finally:
        Figure.savefig = orig
    lines = drawn[0].axes[0].get_lines()
    assert lines and all(line.get_marker() == "o" and len(line.get_xdata()) == 1 for line in lines)


def test_hub_note_once_per_process_and_never_offline_or_for_local_files(monkeypatch, tmp_path):
    from fedgalore import hub

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_noted", False)
    asked = []
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (asked.append(1), (False, "huggingface.co"))[1])
    local = tmp_path / "d.csv"
    local.write_text("text,label\n")
    assert hub.prepare_hub("text_classification", options={"data": str(local), "model": str(tmp_path)}) is None
    assert not asked and os.environ["HF_HUB_OFFLINE"] == "1"  # local files only: offline, silently, no check
    monkeypatch.delenv("HF_HUB_OFFLINE")
    note = hub.prepare_hub("text_classification", options={"data": str(local), "model": "bert-base-uncased"})
    assert note and "unreachable" in note and asked
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub.prepare_hub("glue") is None  # unreachable again, but said once per process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_noted", False)
    assert hub.prepare_hub("glue") is None  # the user's offline setting: no check, no note
    assert hub.names_hub_ids({"data": {"train": str(local), "test": "org/set"}})
    assert not hub.names_hub_ids({"data": {"train": str(local)}})
