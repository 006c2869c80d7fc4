"""Plots for run and comparison directories (matplotlib, written as PNG and PDF).

Figures are built on :class:`matplotlib.figure.Figure` directly (Agg canvas), so nothing touches
pyplot's global state or the user's backend. Seed replicates are drawn as their mean with a
± std band. Each function returns the files it wrote (none when the runs lack the data).

* ``curves`` — primary metric vs round, per task (rows) and setting (columns), one line per method;
* ``train_loss`` — mean client training loss vs round, same layout;
* ``iid_vs_noniid`` — final metric per method as dots (mean ± std), IID next to each non-IID
  setting, Δ annotated (a dot plot: its axis is zoomed to the values, which a bar would misstate);
* ``partition`` — per-client label counts of the Dirichlet / IID split (clients × classes
  heatmap, like the paper's Appendix I figure), one panel per setting;
* ``comm_vs_metric`` — metric vs cumulative uplink bytes (log scale);
* ``client_eval`` — the primary metric of every client vs round (``federation.client_eval``;
  :func:`plot_client_eval`);
* ``diagnostics/<key>`` — the headline diagnostics one figure each (``diagnostics/more`` the
  rest, one panel each) vs round, titled in words with one line of what a healthy run shows
  (:data:`DIAG_HINTS`): tail energy beyond rank r, client drift, the
  clients' second moments (dashed: their spread around their mean before sync; solid: each
  client's distance to the synchronised state v̄ it restarts from — not a cross-client mismatch,
  which sync makes 0), and any other diagnostic (wall times are left out).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from fedgalore.job.partition_files import wrap_label
from fedgalore.report import RunRecord, method_display_name
from fedgalore.report.client_eval import evaluated_rounds, run_title
from fedgalore.report.tables import setting_sort_key

__all__ = ["plot_all", "plot_curves", "plot_bars", "iid_vs_noniid_figure", "plot_partition", "plot_client_eval", "plot_comm",
           "plot_diagnostics", "diagnostics_grid", "diag_hint", "DIAG_HINTS", "DIAG_HEADLINE",
           "comm_figure", "diagnostics_figure", "diag_title"]

_DIAG_PREFERRED = ["tail_energy_mean", "tail_energy_max", "drift_mean", "mismatch"]
#: panel titles (what each diagnostics.jsonl key measures; unknown keys get their words)
_DIAG_TITLES = {
    "tail_energy_mean": "aggregate update: energy beyond rank r (mean)",
    "tail_energy_max": "aggregate update: energy beyond rank r (max)",
    "drift_mean": "client drift ‖Δᵢ − Δ̄‖ / ‖Δ̄‖ (mean)",
    "drift_max": "client drift ‖Δᵢ − Δ̄‖ / ‖Δ̄‖ (max)",
    "aggregate_update_norm": "aggregate update norm ‖Δ̄‖_F",
    "client_update_norm_mean": "client update norm ‖Δᵢ‖_F (mean)",
    "client_update_norm_precond": "client update norm (preconditioned)",
    "client_update_norm_cold": "client update norm (cold-start moments)",
    "mismatch": "second moments of the clients (relative)",
    "removed_fraction": "share of the mean moment removed by sync",
    "joint_rank": "rank of the synchronised moment",
    "state_rank": "rank of the broadcast moment state",
    "n_views": "clients synchronised",
    "basis_overlap": "client bases: overlap with the consensus basis",
    "v_warm_cold_ratio": "warm / cold second-moment ratio",
    "ajive_rank": "AJIVE joint rank",
}
#: legend entries explaining the mismatch panel's two line styles
_MISMATCH_STYLES = (
    ("--", "before sync: spread across clients, Σpᵢ‖Vᵢ−V̄‖/‖V̄‖"),
    ("-", "after sync: clients' own V to the synced v̄ they all restart from"),
)


def _figure(nrows: int, ncols: int, w: float = 4.2, h: float = 3.2):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(w * ncols, 4.5), h * nrows), layout="constrained")
    axes = np.atleast_2d(fig.subplots(nrows, ncols, squeeze=False))
    return fig, axes


def _save(fig: Any, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(files[0], dpi=120)
    fig.savefig(files[1])
    return files


def _colors(methods: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _series(runs: Sequence[RunRecord], get: Callable[[RunRecord], list[dict[str, Any]]], key: str,
            x_key: str = "round") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Seed mean ± std of ``record[key]`` per round (and the mean x value, e.g. cumulative bytes)."""
    per_round: dict[int, list[tuple[float, float]]] = {}
    for r in runs:
        for rec in get(r):
            v, x = rec.get(key), rec.get(x_key)
            if isinstance(v, (int, float)) and isinstance(x, (int, float)) and math.isfinite(v):
                per_round.setdefault(int(rec.get("round", 0)), []).append((float(x), float(v)))
    if not per_round:
        return None
    rounds = sorted(per_round)
    xs = np.array([np.mean([p[0] for p in per_round[k]]) for k in rounds])
    ys = [np.array([p[1] for p in per_round[k]]) for k in rounds]
    mean = np.array([y.mean() for y in ys])
    std = np.array([y.std(ddof=1) if y.size > 1 else 0.0 for y in ys])
    return np.array(rounds), xs, mean, std


def _groups(runs: Sequence[RunRecord]) -> tuple[list[str], list[str], list[str]]:
    tasks = list(dict.fromkeys(r.task for r in runs))
    settings = sorted({r.setting for r in runs}, key=setting_sort_key)
    methods = list(dict.fromkeys(r.method for r in runs))
    return tasks, settings, methods


def _select(runs: Sequence[RunRecord], **kw: str) -> list[RunRecord]:
    return [r for r in runs if all(getattr(r, k) == v for k, v in kw.items())]


def _line(ax: Any, s: tuple, label: str, color: Any, use_x: bool = False, **kw: Any) -> None:
    rounds, xs, mean, std = s
    x = xs if use_x else rounds
    ax.plot(x, mean, marker="o" if len(x) < 30 else None, ms=3, label=label, color=color, **kw)
    if np.any(std > 0):
        ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.18, linewidth=0)


def plot_curves(runs: Sequence[RunRecord], out: Path, methods: Sequence[str], key: str | None = None,
                name: str = "curves", ylabel: str | None = None) -> list[Path]:
    """``key`` vs round (default: each task's ``eval/<primary metric>``)."""
    tasks, settings, _ = _groups(runs)
    colors = _colors(methods)
    fig, axes = _figure(len(tasks), len(settings))
    drew = False
    for i, tk in enumerate(tasks):
        for j, st in enumerate(settings):
            ax = axes[i, j]
            sub = _select(runs, task=tk, setting=st)
            k = key or (f"eval/{sub[0].primary_metric}" if sub else "")
            for m in methods:
                s = _series(_select(sub, method=m), lambda r: r.history, k)
                if s is not None:
                    _line(ax, s, method_display_name(m), colors[m])
                    drew = True
            ax.set_title(f"{tk} — {st}", fontsize=10)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel or k.removeprefix("eval/"))
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    return _save(fig, out, name) if drew else []


def plot_bars(comp: dict[str, Any], out: Path) -> list[Path]:
    """Final metric per method, IID next to each non-IID setting, Δ annotated (needs both):
    :func:`iid_vs_noniid_figure`."""
    fig = iid_vs_noniid_figure(comp)
    return _save(fig, out, "iid_vs_noniid") if fig is not None else []


def iid_vs_noniid_figure(comp: dict[str, Any]) -> Any:
    """The ``iid_vs_noniid`` figure: a dot plot — per method one dot (mean over seeds, ± std bar)
    per setting, Δ annotated — whose y axis spans the values, not 0: a bar's length would claim
    a zero baseline the zoomed axis does not show (a bar chart from 67 % makes 2 points look
    like a factor of two). None when the comparison lacks IID or a non-IID setting."""
    non = [s for s in comp["settings"] if s != "iid"]
    tasks = [t for t in comp["tasks"] if comp["delta"] and any(t["name"] in d for d in comp["delta"].values())]
    if "iid" not in comp["settings"] or not non or not tasks:
        return None
    methods = comp["methods"]
    fig, axes = _figure(1, len(tasks), w=max(4.5, 0.9 * len(methods) * (1 + 0.5 * len(non))))
    settings = ["iid"] + non
    width = 0.6 / len(settings)
    markers = ["o", "s", "^", "D", "v", "P"]
    for ax, t in zip(axes[0], tasks):
        sc = 100.0 if t.get("percent") else 1.0
        x = np.arange(len(methods))
        for j, s in enumerate(settings):
            cells = [comp["cells"].get(m, {}).get(t["name"], {}).get(s) for m in methods]
            h = np.array([c["mean"] * sc if c else np.nan for c in cells])
            e = np.array([(c["std"] or 0.0) * sc if c else 0.0 for c in cells])
            pos = x + (j - (len(settings) - 1) / 2) * width
            ax.errorbar(pos, h, yerr=e, fmt=markers[j % len(markers)], ms=6, capsize=3, linestyle="none",
                        label="IID ✓" if s == "iid" else f"non-IID ✗ {s}")
            if s != "iid":
                for xi, m, hi, ei in zip(pos, methods, h, e):
                    d = comp["delta"].get(m, {}).get(t["name"], {}).get(s)
                    if d is None or not np.isfinite(hi):
                        continue
                    arrow = "↓" if d["mean"] <= 0 else "↑"
                    bold = m in comp["best"].get(t["name"], {}).get("delta:" + s, [])
                    ax.annotate(f"Δ{arrow}{abs(d['mean']) * sc:.{1 if sc > 1 else 3}f}", (xi, hi + ei), xytext=(0, 4),
                                textcoords="offset points", ha="center", fontsize=7, fontweight="bold" if bold else "normal")
        finite = [v * sc for c in comp["cells"].values() for cell in c.get(t["name"], {}).values() for v in cell["values"]]
        if finite:
            lo, hi = min(finite), max(finite)
            pad = max((hi - lo) * 0.25, 0.02 * abs(hi) if hi else 0.05)
            ax.set_ylim(lo - pad, hi + 1.6 * pad)  # room for the Δ labels
        ax.set_xticks(x, [method_display_name(m) for m in methods], rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(methods) - 0.4)
        ax.set_ylabel(f"{comp['which']} {t['metric']}{' (%)' if t.get('percent') else ''}")
        ax.set_title(f"{t['name']}: IID vs non-IID (mean ± std over seeds)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_partition(runs: Sequence[RunRecord], out: Path) -> list[Path]:
    """Clients × classes label counts (one panel per task and setting; lowest seed's split)."""
    picked: dict[tuple[str, str], RunRecord] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        if r.partition and r.partition.get("histograms"):
            picked.setdefault((r.task, r.partition.get("setting", r.setting)), r)
    if not picked:
        return []
    keys = sorted(picked, key=lambda k: (k[0], setting_sort_key(k[1])))
    hists = [np.asarray(picked[k].partition["histograms"], dtype=float) for k in keys]
    n_clients = max(h.shape[0] for h in hists)
    n_classes = max(h.shape[1] for h in hists)
    lines = max((wrap_label(n).count("\n") + 1 for k in keys for n in picked[k].partition.get("label_names", [])), default=1)
    fig, axes = _figure(1, len(keys), w=min(max(3.5, 0.28 * n_clients + 2), 12),
                        h=min(max(2.8, (0.12 + 0.12 * lines) * n_classes + 1.6), 12))
    for ax, k, h in zip(axes[0], keys, hists):
        names = [wrap_label(n) for n in picked[k].partition.get("label_names", range(h.shape[1]))]  # whole names, wrapped
        im = ax.imshow(h.T, aspect="auto", cmap="Blues", interpolation="nearest", origin="lower", vmin=0)
        if h.size <= 300:
            vmax = h.max() if h.size else 1
            for (c, y), v in np.ndenumerate(h):
                ax.text(c, y, f"{int(v)}", ha="center", va="center", fontsize=6,
                        color="white" if v > 0.6 * vmax else "black")
        ax.set_xlabel("client")
        ax.set_ylabel("class")
        step = max(1, h.shape[0] // 20)
        clients = picked[k].partition.get("client_names") or list(range(h.shape[0]))  # natural: the data's names
        ax.set_xticks(range(0, h.shape[0], step), [wrap_label(c) for c in clients[::step]],
                      rotation=90 if any(len(str(c)) > 3 for c in clients) else 0, fontsize=7)
        ax.set_yticks(range(h.shape[1]), names if len(names) == h.shape[1] else None, fontsize=7)
        alpha = k[1].split(":", 1)[1] if k[1].startswith("dirichlet:") else None
        title = "IID" if k[1] == "iid" else f"Dirichlet α = {alpha}" if alpha is not None else k[1]
        ax.set_title(f"{k[0]} — {title}", fontsize=10)
        fig.colorbar(im, ax=ax, label="examples", shrink=0.85)
    return _save(fig, out, "partition")


def plot_client_eval(runs: Sequence[RunRecord], out: Path) -> list[Path]:
    """Per run with ``federation.client_eval``: the primary metric of every client vs round, the
    weighted mean in bold and the last round's worst client dashed (none: no files)."""
    picked = [r for r in runs if evaluated_rounds(r)]
    if not picked:
        return []
    ncols = min(3, len(picked))
    fig, axes = _figure(-(-len(picked) // ncols), ncols, w=4.4, h=3.3)
    for idx, ax in enumerate(axes.flat):
        ax.set_visible(idx < len(picked))
    for ax, r in zip(axes.flat, picked):
        hist, p = evaluated_rounds(r), r.primary_metric
        rounds = np.array([h["round"] for h in hist])
        worst = hist[-1]["client_eval"]["worst_client"]
        marker = "o" if len(rounds) < 30 else None  # a one-round run is a point, not an invisible line
        names = list(dict.fromkeys(c for h in hist for c in h["client_eval"]["clients"]))
        for c in names:
            ys = [h["client_eval"]["clients"].get(c, {}).get(p, np.nan) for h in hist]
            ax.plot(rounds, ys, lw=1.6 if c == worst else 0.8, ls="--" if c == worst else "-", marker=marker, ms=3,
                    alpha=1.0 if c == worst else 0.55, label=f"{c} (worst)" if c == worst else (c if len(names) <= 8 else None))
        ax.plot(rounds, [h.get(f"eval/client_mean_{p}", np.nan) for h in hist], color="black", lw=2.2, marker=marker, ms=4,
                label="weighted mean")
        ax.set_title(run_title(r), fontsize=8)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"{p} on each client's held-out share", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _save(fig, out, "client_eval")


def plot_comm(runs: Sequence[RunRecord], out: Path, methods: Sequence[str]) -> list[Path]:
    """Primary metric vs cumulative uplink bytes, per task and setting."""
    fig, drew = comm_figure(runs, methods)
    return _save(fig, out, "comm_vs_metric") if drew else []


def comm_figure(runs: Sequence[RunRecord], methods: Sequence[str]) -> tuple[Any, bool]:
    """The ``comm_vs_metric`` figure and whether it holds any line."""
    tasks, settings, _ = _groups(runs)
    colors = _colors(methods)
    fig, axes = _figure(len(tasks), len(settings))
    drew = False
    for i, tk in enumerate(tasks):
        for j, st in enumerate(settings):
            ax = axes[i, j]
            sub = _select(runs, task=tk, setting=st)
            key = f"eval/{sub[0].primary_metric}" if sub else ""
            for m in methods:
                s = _series(_select(sub, method=m), lambda r: r.history, key, x_key="cum_bytes_up")
                if s is not None and np.all(s[1] > 0):
                    _line(ax, s, method_display_name(m), colors[m], use_x=True)
                    drew = True
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(LogLocator(base=2, numticks=5))  # at most ~5 labels: they must not collide
            ax.xaxis.set_major_formatter(FuncFormatter(_short_bytes))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
            ax.set_xlabel("cumulative uplink bytes (all clients)")
            ax.set_ylabel(key.removeprefix("eval/"))
            ax.set_title(f"{tk} — {st}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            if ax.lines:
                ax.legend(fontsize=8)
    return fig, drew


def _short_bytes(v: float, _pos: object = None) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= size:
            return f"{v / size:.3g} {unit}"
    return f"{v:.3g} B"


def _diag_keys(runs: Sequence[RunRecord]) -> list[str]:
    keys: dict[str, None] = {}
    for r in runs:
        for rec in r.diagnostics:
            for k, v in rec.items():
                if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys[k] = None
    keys = {k: None for k in keys if not (k.startswith("time") or k.endswith("time_s"))}  # wall times: machine load
    panels = [k for k in _DIAG_PREFERRED if k in keys]
    if "mismatch_before" in keys or "mismatch_after" in keys:
        panels = [p for p in panels if p != "mismatch"] + ["mismatch"]
    else:
        panels = [p for p in panels if p != "mismatch"]
    extra = [k for k in keys if k not in _DIAG_PREFERRED and k not in ("mismatch_before", "mismatch_after")]
    return panels + extra


def diag_title(key: str) -> str:
    """The panel title of a diagnostics key (its words when the key is unknown)."""
    return _DIAG_TITLES.get(key) or key.replace("_", " ")


#: one line per diagnostic: what a healthy run shows (the figure's second title line)
DIAG_HINTS = {
    "tail_energy_mean": "good: near 0 — the round's aggregate update lies in r directions (a rank-r adapter keeps it)",
    "tail_energy_max": "good: near 0 — no matrix's aggregate update has much energy beyond rank r",
    "drift_mean": "good: low and falling — clients' updates agree; near or above 1 the clients pull apart (non-IID drift)",
    "drift_max": "good: close to the mean drift — no single client far from the average update",
    "aggregate_update_norm": "good: smooth and slowly shrinking as training settles; spikes mean unstable rounds",
    "client_update_norm_mean": "good: steady across rounds; steady growth means the clients' steps diverge",
    "client_update_norm_precond": "good: close to the cold-start norm — the synced moments do not enlarge the steps",
    "client_update_norm_cold": "reference: the update norm a cold-start second moment would give (compare the warm one)",
    "update_norm_vs_cold": "good: at or below 1 — warm-started steps no larger than a cold start's",
    "mismatch": "dashed (before sync): lower = the clients' second moments agree; solid: how far sync moves each "
                "client's own state (not a mismatch: it may lie above)",
    "removed_fraction": "good: small — sync drops client-specific noise, not most of the shared moment",
    "joint_rank": "good: near the rank r — 0 means AJIVE found no component the clients share",
    "ajive_rank": "good: near the rank r — 0 means AJIVE found no component the clients share",
    "state_rank": "good: near the rank r — the broadcast state keeps the shared directions",
    "n_views": "good: the clients per round — every upload took part in the sync",
    "basis_overlap": "good: near 1 — the clients' bases share the consensus subspace",
    "v_warm_cold_ratio": "good: near 1 — the warm second moment has the scale a cold start would measure",
    "warm_clamped": "good: near 0 — few warm-start entries had to be clamped at 0",
    "prior_retained": "higher: more of the synced prior survives the move to the first basis; near 0: the round starts "
                      "nearly cold",
    "warm_kept": "higher: the warm start keeps more of the synced moment; near 0: the round starts nearly cold",
    "view_step_share": "as your projector schedule intends: the share of local steps on the round's shared basis",
    "upload_kept": "good: near 1 — the upload's moment kept its energy when moved to the shared basis",
    "ajive_fallback": "good: 0 — AJIVE ran (above 0: a degenerate case fell back to the pooled mean for some matrices)",
    "update_ratio_max": "good: at most about 1 — no coordinate stepped much larger than a cold start",
    "update_ratio_p99": "good: at most 1 — warm-started steps no larger than cold-start ones",
    "update_ratio_above": "good: near 0 — few coordinates step larger than a cold start would",
}


def diag_hint(key: str) -> str:
    """The one line under a diagnostic's title: what a healthy run shows."""
    return DIAG_HINTS.get(key) or "no reference level for this quantity: compare it across methods and settings"


#: the diagnostics drawn as a figure of their own (the others share ``diagnostics/more.png``)
DIAG_HEADLINE = ("tail_energy_mean", "drift_mean", "mismatch", "client_update_norm_mean", "aggregate_update_norm",
                 "update_norm_vs_cold", "v_warm_cold_ratio", "joint_rank")


def plot_diagnostics(runs: Sequence[RunRecord], out: Path, methods: Sequence[str]) -> list[Path]:
    """The headline diagnostics (:data:`DIAG_HEADLINE`) one figure each, ``plots/diagnostics/<key>.png``
    (:func:`diagnostics_figure`), and every other one in ``plots/diagnostics/more.png``
    (:func:`diagnostics_grid`), each with its line of what good looks like. PNG only: a fedgalore
    run records two dozen diagnostics, and a PDF of each doubled a report's time."""
    keys = _diag_keys(runs)
    files: list[Path] = []
    folder = out / "diagnostics"
    for key in [k for k in keys if k in DIAG_HEADLINE]:
        fig = diagnostics_figure(runs, methods, key)
        if fig is not None:
            folder.mkdir(parents=True, exist_ok=True)
            fig.savefig(folder / f"{key}.png", dpi=110)
            files.append(folder / f"{key}.png")
    rest = [k for k in keys if k not in DIAG_HEADLINE]
    fig = diagnostics_grid(runs, methods, rest) if rest else None
    if fig is not None:
        folder.mkdir(parents=True, exist_ok=True)
        fig.savefig(folder / "more.png", dpi=100)
        files.append(folder / "more.png")
    return files


def diagnostics_grid(runs: Sequence[RunRecord], methods: Sequence[str], keys: Sequence[str]) -> Any:
    """The diagnostics ``keys`` as panels of one figure (every setting's lines in each panel, the
    settings by line style), each titled in words over its line of what good looks like
    (wrapped); None when no run recorded any of them."""
    import textwrap

    keys = [k for k in keys if any(k in rec for r in runs for rec in r.diagnostics)]
    if not keys:
        return None
    _, settings, _ = _groups([r for r in runs if r.diagnostics])
    colors = _colors(methods)
    from matplotlib.figure import Figure

    ncols = min(4, len(keys))
    nrows = -(-len(keys) // ncols)
    # fixed spacing: constrained layout over many panels with 3-line titles took ~1 s a panel to save
    fig = Figure(figsize=(3.9 * ncols, 3.3 * nrows))
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.35 / nrows, top=1 - 0.75 / (3.3 * nrows), wspace=0.3,
                        hspace=0.75)
    axes = np.atleast_2d(fig.subplots(nrows, ncols, squeeze=False))
    for idx, ax in enumerate(axes.flat):
        ax.set_visible(idx < len(keys))
    styles = ["-", "--", ":", "-."]
    for ax, key in zip(axes.flat, keys):
        for i, st in enumerate(settings):
            for m in methods:
                s = _series(_select(runs, setting=st, method=m), lambda r: r.diagnostics, key)
                if s is not None:
                    label = method_display_name(m) + (f" — {st}" if len(settings) > 1 else "")
                    _line(ax, s, label, colors[m], linestyle=styles[i % len(styles)])
        ax.set_title(f"{diag_title(key)}\n" + textwrap.fill(diag_hint(key), 52), fontsize=7)
        ax.set_xlabel("round", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    return fig


def diagnostics_figure(runs: Sequence[RunRecord], methods: Sequence[str], key: str) -> Any:
    """The figure of diagnostic ``key`` vs round — titled in words, with one line of what good looks
    like (:func:`diag_hint`) — one panel per setting, one line per method (None: no run recorded it)."""
    rs_with = [r for r in runs if any(key in rec or (key == "mismatch" and "mismatch_after" in rec) for rec in r.diagnostics)]
    if not rs_with:
        return None
    _, settings, _ = _groups(rs_with)
    colors = _colors(methods)
    from matplotlib.figure import Figure

    # fixed margins (constrained layout doubled the time of these small figures, two dozen a report)
    import textwrap

    width = max(4.2 * len(settings), 6.0)
    fig = Figure(figsize=(width, 3.8))
    fig.subplots_adjust(left=0.1 / len(settings) + 0.04, right=0.98, bottom=0.14, top=0.72, wspace=0.25)
    axes = np.atleast_2d(fig.subplots(1, len(settings), squeeze=False))
    fig.suptitle(f"{diag_title(key)}\n" + textwrap.fill(diag_hint(key), int(13 * width)), fontsize=9)
    for ax, st in zip(axes[0], settings):
        sub = _select(runs, setting=st)
        for m in methods:
            rs = _select(sub, method=m)
            if key == "mismatch":
                for k, style in (("mismatch_before", "--"), ("mismatch_after", "-")):
                    s = _series(rs, lambda r: r.diagnostics, k)
                    if s is not None:
                        _line(ax, s, method_display_name(m) if style == "-" else None, colors[m], linestyle=style)
            else:
                s = _series(rs, lambda r: r.diagnostics, key)
                if s is not None:
                    _line(ax, s, method_display_name(m), colors[m])
        ax.set_title(st, fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        handles = [line for line in ax.lines if line.get_label() and not line.get_label().startswith("_")]
        if key == "mismatch" and ax.lines:
            from matplotlib.lines import Line2D

            handles += [Line2D([], [], color="0.3", linestyle=ls, label=text) for ls, text in _MISMATCH_STYLES]
        if handles:
            ax.legend(handles=handles, fontsize=6 if key == "mismatch" else 7)
    return fig


def plot_all(runs: Sequence[RunRecord], out: str | Path, comp: dict[str, Any]) -> list[Path]:
    """Every figure the runs have data for; returns the written files."""
    out = Path(out)
    methods = list(comp.get("methods") or dict.fromkeys(r.method for r in runs))
    methods += [m for m in dict.fromkeys(r.method for r in runs) if m not in methods]
    files: list[Path] = []
    files += plot_curves(runs, out, methods)
    files += plot_curves(runs, out, methods, key="train_loss", name="train_loss", ylabel="mean client train loss")
    files += plot_bars(comp, out)
    files += plot_partition(runs, out)
    files += plot_comm(runs, out, methods)
    files += plot_diagnostics(runs, out, methods)
    files += plot_client_eval(runs, out)
    return files
