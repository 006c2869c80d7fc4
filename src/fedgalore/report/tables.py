"""Comparison tables in the paper's layout (Tables 2-4), as Markdown and LaTeX.

Rows are methods; per task the columns are IID (✓), non-IID (✗, one per Dirichlet setting) and
``Δ = ✗ − ✓`` (shown as ↓/↑ and its magnitude, like the paper), followed by the communication
columns (uplink / downlink bytes per client per round, measured from the serialised payloads),
and under the table one line with the budget and each method's learning rate (from the runs'
``config.yaml``). Wall time is listed per run only: it measures the machine's load, not a
method. Values are the final-round (or best-round) primary metric, mean ± std (sample std,
``ddof=1``) over seeds; Δ is the mean ± std of the per-seed differences when both
settings ran the same seeds. The best value of every column is bold: the highest (lowest for
lower-is-better metrics) mean, and for Δ the smallest degradation; ties at the displayed
precision are all bold.

Runs with ``federation.client_eval`` add a **worst site** column after each setting's value: the
primary metric on the worst client's held-out share at the last round that evaluated the clients
(mean ± std over seeds), and that client's name — each seed's, when they differ (:func:`worst_site`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from fedgalore.report import METHOD_ORDER, RunRecord, method_display_name

__all__ = ["aggregate", "to_markdown", "to_latex", "write_tables", "format_bytes", "format_count", "budget_line", "worst_site"]

_NOT_PERCENT = ("loss", "mse", "mae", "perplexity", "ppl", "rmse")


def _mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var)


def setting_sort_key(setting: str) -> tuple[int, float, str]:
    """IID first, then Dirichlet settings from the mildest (largest alpha) to the most skewed."""
    if setting == "iid":
        return (0, 0.0, setting)
    if setting.startswith("dirichlet:"):
        try:
            return (1, -float(setting.split(":", 1)[1]), setting)
        except ValueError:
            pass
    return (2, 0.0, setting)


def _order_methods(names: Iterable[str], preferred: Sequence[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    if preferred:
        first = [m for m in preferred if m in names]
        return first + [m for m in names if m not in first]
    known = [m for m in METHOD_ORDER if m in names]
    return known + [m for m in names if m not in known]


def worst_site(r: RunRecord) -> tuple[float, str] | None:
    """(primary metric, name) of the worst client of the run's last round that evaluated its
    clients (``federation.client_eval``); None when no round did."""
    metric = f"eval/client_worst_{r.primary_metric}"
    for rec in reversed(r.history):
        ce = rec.get("client_eval")
        if isinstance(ce, dict) and isinstance(rec.get(metric), (int, float)) and math.isfinite(rec[metric]):
            return float(rec[metric]), str(ce.get("worst_client", "?"))
    return None


def _run_row(r: RunRecord, which: str) -> dict[str, Any]:
    s = r.summary
    return {
        "run_dir": str(r.path),
        "method": r.method,
        "task": r.task,
        "setting": r.setting,
        "seed": r.seed,
        "status": s.get("status"),
        "rounds_completed": s.get("rounds_completed"),
        "rounds": s.get("rounds"),
        "primary_metric": r.primary_metric,
        "value": r.metric(which=which),
        "final": s.get("final", {}),
        "best": s.get("best", {}),
        "bytes_up_per_client_round": s.get("bytes_up_per_client_round"),
        "bytes_down_per_client_round": s.get("bytes_down_per_client_round"),
        "bytes_up_total": s.get("bytes_up_total"),
        "bytes_down_total": s.get("bytes_down_total"),
        "time_per_round": s.get("time_per_round"),
        "wall_time": s.get("wall_time"),
    }


def aggregate(
    runs: Sequence[RunRecord],
    which: str = "final",
    method_order: Sequence[str] = (),
    include_incomplete: bool = False,
) -> dict[str, Any]:
    """Group runs by (method, task, setting) and reduce over seeds (the ``comparison.json`` data)."""
    if which not in ("final", "best"):
        raise ValueError(f"which={which!r} must be 'final' or 'best'")
    used = [r for r in runs if include_incomplete or r.complete]
    excluded = len(runs) - len(used)

    tasks: dict[str, dict[str, Any]] = {}
    for r in used:
        tasks.setdefault(r.task, {"name": r.task, "metric": r.primary_metric, "higher_is_better": r.higher_is_better})
    settings = sorted({r.setting for r in used}, key=setting_sort_key)
    methods = _order_methods((r.method for r in used), method_order)

    values: dict[tuple[str, str, str], dict[int, float]] = {}
    worst: dict[tuple[str, str, str], dict[int, tuple[float, str]]] = {}
    for r in used:
        v = r.metric(tasks[r.task]["metric"], which)
        if v is not None and math.isfinite(v):
            values.setdefault((r.method, r.task, r.setting), {})[r.seed] = v
        w = worst_site(r)
        if w is not None:
            worst.setdefault((r.method, r.task, r.setting), {})[r.seed] = w
    for t in tasks.values():
        vals = [v for (m, tk, s), d in values.items() if tk == t["name"] for v in d.values()]
        name = t["metric"].lower()
        t["percent"] = bool(vals) and t["higher_is_better"] and not any(k in name for k in _NOT_PERCENT) and all(0.0 <= v <= 1.0 for v in vals)

    cells: dict[str, dict[str, dict[str, Any]]] = {}
    worst_cells: dict[str, dict[str, dict[str, Any]]] = {}
    delta: dict[str, dict[str, dict[str, Any]]] = {}
    for m in methods:
        for tk in tasks:
            for s in settings:
                d = values.get((m, tk, s))
                if not d:
                    continue
                mean, std = _mean_std(list(d.values()))
                cells.setdefault(m, {}).setdefault(tk, {})[s] = {
                    "seeds": sorted(d), "values": [d[k] for k in sorted(d)], "mean": mean, "std": std, "n": len(d)}
                w = worst.get((m, tk, s))
                if w:
                    wmean, wstd = _mean_std([w[k][0] for k in sorted(w)])
                    worst_cells.setdefault(m, {}).setdefault(tk, {})[s] = {
                        "seeds": sorted(w), "values": [w[k][0] for k in sorted(w)], "sites": [w[k][1] for k in sorted(w)],
                        "mean": wmean, "std": wstd, "n": len(w)}
            iid = values.get((m, tk, "iid"))
            for s in settings:
                non = values.get((m, tk, s))
                if s == "iid" or not iid or not non:
                    continue
                common = sorted(set(iid) & set(non))
                if common:
                    mean, std = _mean_std([non[k] - iid[k] for k in common])
                    entry = {"mean": mean, "std": std, "n": len(common), "paired": True}
                else:
                    mean = _mean_std(list(non.values()))[0] - _mean_std(list(iid.values()))[0]
                    entry = {"mean": mean, "std": None, "n": 0, "paired": False}
                delta.setdefault(m, {}).setdefault(tk, {})[s] = entry

    comm: dict[str, dict[str, Any]] = {}
    for m in methods:
        rs = [r for r in used if r.method == m]
        entry: dict[str, Any] = {}
        for key in ("bytes_up_per_client_round", "bytes_down_per_client_round", "time_per_round"):
            xs = [float(r.summary[key]) for r in rs if isinstance(r.summary.get(key), (int, float))]
            mean, std = _mean_std(xs) if xs else (None, None)
            entry[key] = mean
            entry[key + "_std"] = std
        comm[m] = entry

    comp = {
        "budget": budget_line([r for r in used if r.method in methods], methods),
        "which": which,
        "tasks": list(tasks.values()),
        "settings": settings,
        "methods": methods,
        "cells": cells,
        "worst": worst_cells,
        "delta": delta,
        "comm": comm,
        "runs": [_run_row(r, which) for r in runs],
        "excluded_incomplete": excluded,
    }
    comp["best"] = _best(comp)
    return comp


def _fmt_lr(v: float) -> str:
    """1e-3, 2e-4, 2.5e-4 (the way learning rates are written in configs)."""
    mant, exp = f"{float(v):.2e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}"


def _is_sgd(method: str) -> bool:
    from fedgalore.methods.base import available_methods, method_class

    return method in available_methods() and method_class(method).traits.optimizer == "sgd"


def _run_budget(cfg: dict[str, Any]) -> str:
    f, t, m = cfg["federation"], cfg["train"], cfg["method"]
    k = f.get("clients_per_round") or f["num_clients"]
    local = (f"{t['local_steps']} local step{'' if t['local_steps'] == 1 else 's'}" if t.get("local_steps") is not None
             else f"{float(t['local_epochs']):g} local epoch{'' if float(t['local_epochs']) == 1 else 's'}")
    text = f"{f['rounds']} rounds × {k} of {f['num_clients']} clients, {local} of batch {t['batch_size']}, rank {m['rank']}"
    max_len = (cfg.get("task") or {}).get("options", {}).get("max_length")
    return text + (f", {max_len} tokens" if max_len else "")


def _run_lr(cfg: dict[str, Any]) -> str:
    t, m = cfg["train"], cfg["method"]
    if _is_sgd(str(m["name"])):
        from fedgalore.methods.lora_common import DEFAULT_SGD_LR

        v = t.get("sgd_lr") or (m.get("options") or {}).get("sgd_lr") or DEFAULT_SGD_LR
        return f"{_fmt_lr(v)} (SGD)" + _remedies(cfg)
    return _fmt_lr(t["lr"]) + _remedies(cfg)


def _remedies(cfg: dict[str, Any]) -> str:
    """The heterogeneity remedies a run used (docs/remedies.md), after its learning rate: FedProx's
    μ, SCAFFOLD, a server optimizer other than plain FedAvg and its η; "" for none."""
    t, opt = cfg["train"], (cfg["federation"].get("server_optimizer") or {})
    out = []
    if float(t.get("prox_mu") or 0.0) > 0:
        out.append(f"FedProx μ={float(t['prox_mu']):g}")
    if t.get("scaffold"):
        out.append("SCAFFOLD")
    name, lr = opt.get("name", "fedavg"), opt.get("lr")
    if name != "fedavg" or (lr is not None and float(lr) != 1.0):
        out.append(f"server {name}" + (f" η={_fmt_lr(lr)}" if lr is not None else ""))
    return "".join(f" + {x}" for x in out)


def budget_line(runs: Sequence[RunRecord], methods: Sequence[str]) -> str | None:
    """One line with the training budget and each method's learning rate, from the runs'
    ``config.yaml`` (None when a run has none): what a reader needs to judge the table."""
    try:
        budgets = {r.method: set() for r in runs}
        lrs: dict[str, list[str]] = {m: [] for m in methods}
        for r in runs:
            budgets[r.method].add(_run_budget(r.config))
            lr = _run_lr(r.config)
            if lr not in lrs.setdefault(r.method, []):
                lrs[r.method].append(lr)
    except (TypeError, KeyError, ValueError):
        return None
    if not runs:
        return None
    every = set().union(*budgets.values())
    if len(every) == 1:
        text = f"Budget (every method): {next(iter(every))}."
    else:
        text = "Budgets differ: " + "; ".join(f"{method_display_name(m)}: {' | '.join(sorted(budgets[m]))}"
                                              for m in methods if budgets.get(m)) + "."
    rates = {m: "/".join(v) for m, v in lrs.items() if v}
    if len(set(rates.values())) == 1:
        text += f" Learning rate {next(iter(rates.values()))} for every method."
    else:
        text += " Learning rate, each method's own: " + ", ".join(f"{method_display_name(m)} {v}" for m, v in rates.items()) + "."
    return text


# ----------------------------------------------------------------------------- formatting
def _scale(task: dict[str, Any]) -> float:
    return 100.0 if task.get("percent") else 1.0


def _prec(task: dict[str, Any]) -> int:
    return 1 if task.get("percent") else 3


def _best(comp: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """Per task and column, the methods to set in bold (rounded to the displayed precision)."""
    best: dict[str, dict[str, list[str]]] = {}
    for t in comp["tasks"]:
        tk, sc, pr, hib = t["name"], _scale(t), _prec(t), t["higher_is_better"]
        out = best.setdefault(tk, {})
        for s in comp["settings"]:
            got = {m: round(c[tk][s]["mean"] * sc, pr) for m, c in comp["cells"].items() if s in c.get(tk, {})}
            if len(got) > 1:
                target = max(got.values()) if hib else min(got.values())
                out[s] = [m for m, v in got.items() if v == target]
            low = {m: round(c[tk][s]["mean"] * sc, pr) for m, c in comp.get("worst", {}).items() if s in c.get(tk, {})}
            if len(low) > 1:
                target = max(low.values()) if hib else min(low.values())
                out["worst:" + s] = [m for m, v in low.items() if v == target]
            # degradation: how much worse non-IID is than IID (smaller is better)
            deg = {m: round((-d[tk][s]["mean"] if hib else d[tk][s]["mean"]) * sc, pr) for m, d in comp["delta"].items() if s in d.get(tk, {})}
            if len(deg) > 1:
                target = min(deg.values())
                out["delta:" + s] = [m for m, v in deg.items() if v == target]
    return best


def format_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float | None) -> str:
    """A parameter (or any) count for people: ``1.10 B``, ``123.5 M``, ``0.2 M``, ``12.3 k``, ``950``
    — billions from 10⁹, millions from 10⁵ (a 200 000-parameter model is ``0.2 M``, not ``0.00 B``),
    thousands from 10³."""
    if n is None:
        return "–"
    a = abs(float(n))
    if a >= 1e9:
        return f"{n / 1e9:.2f} B"
    if a >= 1e5:
        return f"{n / 1e6:.1f} M"
    if a >= 1e3:
        return f"{n / 1e3:.1f} k"
    return f"{n:.0f}"


def _fmt_value(cell: dict[str, Any] | None, task: dict[str, Any], latex: bool) -> str:
    if cell is None:
        return "–"
    sc, pr = _scale(task), _prec(task)
    text = f"{cell['mean'] * sc:.{pr}f}"
    if cell.get("std") is not None:
        text += (r" $\pm$ " if latex else " ± ") + f"{cell['std'] * sc:.{pr}f}"
    return text


def _fmt_delta(d: dict[str, Any] | None, task: dict[str, Any], latex: bool) -> str:
    if d is None:
        return "–"
    sc, pr = _scale(task), _prec(task)
    mag = abs(d["mean"]) * sc
    down = round(d["mean"] * sc, pr) <= 0
    arrow = (r"$\downarrow$" if down else r"$\uparrow$") if latex else ("↓" if down else "↑")
    text = f"{arrow}{mag:.{pr}f}"
    if d.get("std") is not None:
        text += (r" $\pm$ " if latex else " ± ") + f"{d['std'] * sc:.{pr}f}"
    return text


def _columns(comp: dict[str, Any]) -> list[tuple[dict[str, Any], str, str]]:
    """(task, kind, setting) per metric column; kind in value | delta."""
    non_iid = [s for s in comp["settings"] if s != "iid"]
    cols = []
    for t in comp["tasks"]:
        have = {s for c in comp["cells"].values() for s in c.get(t["name"], {})}
        worst = {s for c in comp.get("worst", {}).values() for s in c.get(t["name"], {})}
        if "iid" in have:
            cols.append((t, "value", "iid"))
            if "iid" in worst:
                cols.append((t, "worst", "iid"))
        for s in non_iid:
            if s not in have:
                continue
            cols.append((t, "value", s))
            if s in worst:
                cols.append((t, "worst", s))
            if "iid" in have:
                cols.append((t, "delta", s))
    return cols


def _header(kind: str, setting: str, multi: bool, latex: bool) -> str:
    alpha = f" α={setting.split(':', 1)[1]}" if setting.startswith("dirichlet:") else f" {setting}"
    if latex:
        alpha = alpha.replace("α", r"$\alpha$")
        base = {"value_iid": r"\ding{51}", "value": r"\ding{53}", "delta": r"$\Delta$"}
    else:
        base = {"value_iid": "✓", "value": "✗", "delta": "Δ"}
    if kind == "worst":
        return "worst site " + (base["value_iid"] if setting == "iid" else base["value"] + (alpha if multi else ""))
    if kind == "value" and setting == "iid":
        return base["value_iid"]
    return base[kind] + (alpha if multi else "")


def _cell_text(comp: dict[str, Any], m: str, t: dict[str, Any], kind: str, s: str, latex: bool) -> str:
    tk = t["name"]
    site = ""  # the worst client's name, after the (bold) number
    if kind == "worst":
        cell = comp.get("worst", {}).get(m, {}).get(tk, {}).get(s)
        text = _fmt_value(cell, t, latex)
        if cell is not None:
            names = ", ".join(dict.fromkeys(cell["sites"]))  # each seed's worst client, once
            site = f" ({_tex_escape(names) if latex else names})"
        bold = m in comp["best"].get(tk, {}).get("worst:" + s, [])
    elif kind == "value":
        text = _fmt_value(comp["cells"].get(m, {}).get(tk, {}).get(s), t, latex)
        bold = m in comp["best"].get(tk, {}).get(s, [])
    else:
        text = _fmt_delta(comp["delta"].get(m, {}).get(tk, {}).get(s), t, latex)
        bold = m in comp["best"].get(tk, {}).get("delta:" + s, [])
    if bold and text != "–":
        text = rf"\textbf{{{text}}}" if latex else f"**{text}**"
    return text + site


def _comm_text(comp: dict[str, Any], m: str, latex: bool) -> list[str]:
    # no time column: wall time per round measures the machine and its load (other jobs, threads),
    # not a method's cost; it stays in the per-run list below, labelled as wall time
    c = comp["comm"].get(m, {})
    return [format_bytes(c.get("bytes_up_per_client_round")), format_bytes(c.get("bytes_down_per_client_round"))]


def _caption(comp: dict[str, Any], latex: bool) -> str:
    tasks = ", ".join(f"{t['name']}: {t['metric']}{' (%)' if t.get('percent') else ''}{'' if t['higher_is_better'] else ' (lower is better)'}" for t in comp["tasks"])
    ns = sorted({c["n"] for mc in comp["cells"].values() for tc in mc.values() for c in tc.values()})
    seeds = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}–{ns[-1]}" if ns else "n = 0"
    non = [s for s in comp["settings"] if s != "iid"]
    text = (f"{comp['which'].capitalize()}-round {tasks}; mean ± std over seeds ({seeds}). "
            f"✓ = IID, ✗ = non-IID ({', '.join(non) or 'none'}), Δ = ✗ − ✓; best in bold. "
            + ("Worst site: the metric on the worst client's held-out share (federation.client_eval) at the last round "
               "that evaluated the clients, and that client. " if comp.get("worst") else "")
            + "Communication: bytes per participating client per round (serialised payloads), averaged over each method's runs.")
    if comp.get("excluded_incomplete"):
        text += f" {comp['excluded_incomplete']} unfinished run(s) not included."
    if latex:
        text = (text.replace("✓", r"\ding{51}").replace("✗", r"\ding{53}").replace("Δ", r"$\Delta$")
                .replace("±", r"$\pm$").replace("−", "$-$").replace("–", "--").replace("%", r"\%").replace("_", r"\_"))
    return text


def to_markdown(comp: dict[str, Any]) -> str:
    cols = _columns(comp)
    multi = len([s for s in comp["settings"] if s != "iid"]) > 1
    head = ["Method"] + [f"{t['name']} {_header(kind, s, multi, latex=False)}" for t, kind, s in cols]
    head += ["Up / client / round", "Down / client / round"]
    lines = [f"### Comparison ({', '.join(t['name'] for t in comp['tasks'])})", "", _caption(comp, False), ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" + "---:|" * (len(head) - 1))
    for m in comp["methods"]:
        row = [method_display_name(m)] + [_cell_text(comp, m, t, k, s, False) for t, k, s in cols] + _comm_text(comp, m, False)
        lines.append("| " + " | ".join(row) + " |")
    if comp.get("budget"):
        lines += ["", comp["budget"]]
    if comp.get("privacy"):
        lines += ["", comp["privacy"]]
    lines += ["", "### Runs", "",
              "Wall s / round is wall-clock time on the machine that ran the run: it depends on that machine's load "
              "(other jobs, threads) and is not a comparison of the methods' cost.", ""]
    lines.append("| Method | Task | Setting | Seed | Status | Rounds | Metric | Up total | Down total | Wall s / round | Run dir |")
    lines.append("|---|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    for r in sorted(comp["runs"], key=lambda r: (r["method"], r["task"], setting_sort_key(r["setting"]), r["seed"])):
        v = r["value"]
        metric = "–" if v is None else f"{r['primary_metric']}={v:.4f}"
        tpr = r["time_per_round"]
        lines.append(
            f"| {method_display_name(r['method'])} | {r['task']} | {r['setting']} | {r['seed']} | {r['status']} | "
            f"{r['rounds_completed']}/{r['rounds']} | {metric} | {format_bytes(r['bytes_up_total'])} | "
            f"{format_bytes(r['bytes_down_total'])} | {'–' if tpr is None else f'{tpr:.2f}'} | {r['run_dir']} |")
    return "\n".join(lines) + "\n"


def _tex_escape(text: str) -> str:
    return text.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&").replace("#", r"\#")


def _group(m: str) -> int:
    """The LaTeX table's row group of method ``m`` (a rule between groups): full fine-tuning (its uploads the
    dense deltas), the LoRA methods, the GaLore methods; a row that is no registered method: the LoRA group."""
    from fedgalore.methods.base import available_methods, method_class

    if m not in available_methods():
        return 1
    traits = method_class(m).traits
    return 0 if traits.uploads_dense_deltas else 2 if traits.optimizer == "galore_adamw" else 1


def to_latex(comp: dict[str, Any]) -> str:
    cols = _columns(comp)
    multi = len([s for s in comp["settings"] if s != "iid"]) > 1
    spec = "@{}l " + " ".join("c" for _ in cols) + " rr@{}"
    out = [
        r"% fedgalore report -- requires \usepackage{booktabs} and \usepackage{pifont} (\ding)",
        r"\begin{table*}[t]",
        r"\caption{" + _caption(comp, True) + (" " + _tex_escape(comp["budget"]).replace("×", r"$\times$")
                                                 if comp.get("budget") else "") + "}",
        r"\label{tab:fedgalore-comparison}",
        r"\centering",
        r"\small",
        r"\begin{tabular}{" + spec + "}",
        r"\toprule",
    ]
    top, rules, col = [r"\textbf{Method}"], [], 2
    for t in comp["tasks"]:
        n = sum(1 for tt, _, _ in cols if tt is t)
        if n == 0:
            continue
        unit = " Acc\\%" if t.get("percent") and t["metric"] == "accuracy" else (" " + _tex_escape(t["metric"]) + (r" (\%)" if t.get("percent") else ""))
        top.append(rf"\multicolumn{{{n}}}{{c}}{{\textbf{{{_tex_escape(t['name'])}}}{unit}}}")
        rules.append(rf"\cmidrule(lr){{{col}-{col + n - 1}}}")
        col += n
    top.append(r"\multicolumn{2}{c}{\textbf{Communication}}")
    rules.append(rf"\cmidrule(lr){{{col}-{col + 1}}}")
    out.append(" & ".join(top) + r" \\")
    out.append(" ".join(rules))
    sub = [""] + ["{" + _header(k, s, multi, latex=True) + "}" for _, k, s in cols] + ["Up/client/rd", "Down/client/rd"]
    out.append(" & ".join(sub) + r" \\")
    out.append(r"\midrule")
    prev = None
    for m in comp["methods"]:
        g = _group(m)
        if prev is not None and g != prev:
            out.append(r"\midrule")
        prev = g
        row = [method_display_name(m, latex=True)] + [_cell_text(comp, m, t, k, s, True) for t, k, s in cols]
        row += [_tex_escape(x).replace("–", "--") for x in _comm_text(comp, m, True)]
        out.append(" & ".join(row) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table*}"]
    return "\n".join(out) + "\n"


def write_tables(comp: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``comparison.json``, ``table.md`` and ``table.tex`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "comparison.json", out / "table.md", out / "table.tex"]
    files[0].write_text(json.dumps(comp, indent=2, default=str) + "\n")
    files[1].write_text(to_markdown(comp))
    files[2].write_text(to_latex(comp))
    return files
