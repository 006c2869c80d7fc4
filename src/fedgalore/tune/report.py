"""The report of ``fedgalore tune``: ``tune_report.json``, ``tune_report.md`` and three plots.

* **Recommendation** (per confirmation horizon): the candidate with the best mean test metric
  over the held-out seeds, its values, and what it costs: uplink and downlink per client-round and
  wall time per run as its held-out runs measured, client training memory from ``fedgalore plan``
  (model + gradients + optimizer state + activations of one client), ε under privacy.
* **Held-out table**: every candidate's test metric per seed, its mean, and the paired difference to
  the recommended row with a 95 % t interval (pairs by seed); its rank against the width it
  projects (the shorter side of the adapted matrices) and its uplink against the dense update of
  the same matrices and head (what a full-model method sends): a low-rank row whose upload is
  larger than the dense update is flagged as no longer low-rank (a method whose uploads are the
  dense deltas, ``MethodTraits.uploads_dense_deltas``, has no rank).
* **Search**: per row its trials (finished, pruned, failed), the best search value and values, a
  flag when a value was chosen at the edge of its range (and the widened range searched), and what
  the search cost in rounds, client-rounds and wall time against running every trial to the end.
* **Privacy**: what the sites' ledgers recorded during the tune (ε per site), when tuning ran
  under ``privacy.*``.
* **Plots**: ``tune_search.png`` (each row's search value against its learning rate; pruned
  trials at their last reported value), ``tune_history.png`` (the search value by trial and the
  best so far), ``tune_heldout.png`` (held-out means with their seeds).

Every verdict number is from the held-out cells; the search values appear only in the search table.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from fedgalore.job.config import FederatedConfig
from fedgalore.tune.confirm import Candidate, check_one_setup, paired
from fedgalore.tune.search import Row, TuneSpec, stored_space, open_study, storage_url, trial_config
from fedgalore.tune.space import at_edge

__all__ = ["build_report", "dense_reference", "plan_costs"]


def dense_reference(cfg: FederatedConfig) -> dict[str, Any]:
    """The dense update of the adapted matrices and the head (bytes, float32 as trained) and the
    width a rank projects: the shorter side of the adapted matrices (smallest over them)."""
    from fedgalore.plan import model_spec

    spec, _ = model_spec(cfg)
    shapes = dict(spec.params)
    weights = [shapes[f"{t}.weight"] for t in spec.targets if f"{t}.weight" in shapes]
    heads = [shapes[h] for h in spec.heads if h in shapes]
    count = sum(math.prod(s) for s in weights) + sum(math.prod(s) for s in heads)
    return {"dense_bytes": int(count * 4), "width": int(min(min(s) for s in weights)) if weights else None,
            "widest": int(max(min(s) for s in weights)) if weights else None}


def plan_costs(cfg: FederatedConfig) -> dict[str, Any]:
    """One client's training memory from the plan (model + gradients + optimizer state +
    activations, bytes) and its peak phase."""
    from fedgalore.plan import make_plan

    plan = make_plan(cfg)
    m = plan["methods"][cfg.method.name]["memory"]
    comp = m["components"]
    return {"client_training_bytes": int(sum(comp.get(k, 0) for k in ("model", "gradients", "optimizer_state", "activations"))),
            "components": comp}


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _kib(b: Any) -> str:
    return "–" if b is None else f"{b / 1024:.1f}"


def _mib(b: Any) -> str:
    return "–" if b is None else f"{b / 2 ** 20:.2f}"


def _pct(x: float, scale: float) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * scale:.1f}"


def _search_rows(spec: TuneSpec, rows: Sequence[Row]) -> list[dict[str, Any]]:
    from optuna.trial import TrialState

    url = storage_url(spec)
    out = []
    for row in rows:
        study = open_study(spec, row, url, check=False)
        trials = study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        pruned = [t for t in trials if t.state == TrialState.PRUNED]
        failed = [t for t in trials if t.state == TrialState.FAIL]
        rounds = spec.base.federation.rounds
        k = max((t.user_attrs.get("clients_per_round", 0) for t in trials), default=0)
        counted = done + pruned
        best = None
        if done:
            higher = study.direction.name == "MAXIMIZE"
            best = max(done, key=lambda t: t.value) if higher else min(done, key=lambda t: t.value)
        space = stored_space(study, row)
        edges = []
        if best is not None:
            for key, p in space.items():
                side = at_edge(p, best.params.get(key))
                if side:
                    edges.append(f"{key}={_fmt(best.params.get(key))} at the {side} edge of {p.spec().split('=', 1)[1]}")
        out.append({
            "label": row.label, "method": row.method, "space": [p.spec() for p in space.values()],
            "widened": study.user_attrs.get("widened", []), "at_edge": edges,
            "finished": len(done), "pruned": len(pruned), "failed": len(failed),
            "best_value": best.value if best else None, "best_params": dict(best.params) if best else None,
            "best_trial": best.number if best else None,
            "rounds": int(sum(t.user_attrs.get("rounds_run", 0) for t in trials)),
            "client_rounds": int(sum(t.user_attrs.get("client_rounds", 0) for t in trials)),
            "client_rounds_unpruned": int(len(counted) * rounds * k),
            "wall_s": round(float(sum(t.user_attrs.get("wall_s", 0.0) for t in trials)), 1),
            "trials": [{"number": t.number, "state": t.state.name, "params": dict(t.params), "value": t.value,
                        "intermediate": {int(s): float(v) for s, v in t.intermediate_values.items()},
                        "rounds_run": t.user_attrs.get("rounds_run"), "client_rounds": t.user_attrs.get("client_rounds"),
                        "wall_s": t.user_attrs.get("wall_s"), "dp_epsilon": t.user_attrs.get("dp_epsilon"),
                        "inputs": t.user_attrs.get("inputs"), "error": t.user_attrs.get("error")} for t in trials],
        })
    return out


def _heldout(records: Sequence[dict[str, Any]], rounds: int) -> dict[str, Any]:
    rec = [r for r in records if r["rounds"] == rounds]
    if not rec:
        return {"rounds": rounds, "rows": []}
    primary = rec[0]["primary_metric"]
    higher = rec[0].get("higher_is_better", True)
    by: dict[str, dict[int, float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for r in rec:
        v = (r.get("final") or {}).get(primary)
        if v is None:
            continue
        key = r["name"].rsplit("-s", 1)[0]
        by.setdefault(key, {})[int(r["seed"])] = float(v)
        meta.setdefault(key, {"label": r["label"], "method": r["method"], "role": r["role"], "params": r["params"],
                              "search_value": r["search_value"], "up": [], "down": [], "wall": [], "eps": []})
        m = meta[key]
        m["up"].append(r.get("bytes_up_per_client_round"))
        m["down"].append(r.get("bytes_down_per_client_round"))
        m["wall"].append(r.get("wall_s"))
        if r.get("dp_epsilon") is not None:
            m["eps"].append(r["dp_epsilon"])
    seeds = sorted({s for d in by.values() for s in d})
    full = {k: d for k, d in by.items() if all(s in d for s in seeds)}
    if not full:
        return {"rounds": rounds, "rows": [], "seeds": seeds}
    mean = {k: statistics.fmean(d[s] for s in seeds) for k, d in full.items()}
    best = max(mean, key=mean.get) if higher else min(mean, key=mean.get)
    rows = []
    for k in sorted(full, key=lambda k: -mean[k] if higher else mean[k]):
        m = meta[k]
        vals = [full[k][s] for s in seeds]

        def avg(xs: list) -> float | None:
            xs = [x for x in xs if x is not None]
            return statistics.fmean(xs) if xs else None

        rows.append({"key": k, **{x: m[x] for x in ("label", "method", "role", "params", "search_value")},
                     "mean": mean[k], "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0, "per_seed": vals,
                     "vs_best": None if k == best else paired(vals, [full[best][s] for s in seeds]),
                     "bytes_up_per_client_round": avg(m["up"]), "bytes_down_per_client_round": avg(m["down"]),
                     "wall_s_per_run": avg(m["wall"]), "dp_epsilon": max(m["eps"]) if m["eps"] else None})
    return {"rounds": rounds, "primary_metric": primary, "higher_is_better": higher, "seeds": seeds, "best": best,
            "rows": rows, "incomplete": sorted(set(by) - set(full))}


def build_report(spec: TuneSpec, rows: Sequence[Row], cands: Sequence[Candidate], records: Sequence[dict[str, Any]],
                 privacy: dict[str, Any] | None = None, confirm_wall_s: float | None = None) -> Path:
    """Write ``tune_report.{json,md}`` and the plots into ``spec.out``; returns the markdown's path."""
    check_one_setup(records)
    search = _search_rows(spec, rows)
    horizons = sorted({r["rounds"] for r in records})
    held = [_heldout(records, h) for h in horizons]
    # costs that do not depend on the seed: per candidate (its config at the search's seed)
    costs: dict[str, dict[str, Any]] = {}
    for c in cands:
        cfg = FederatedConfig.from_dict(trial_config(c.row, c.params))
        cache = spec.out / "costs" / f"{c.name}.json"
        if cache.is_file():
            costs[c.name] = json.loads(cache.read_text())
            continue
        from fedgalore.methods.base import method_class

        dense_method = bool(method_class(cfg.method.name).traits.uploads_dense_deltas)  # its uploads are ΔW: no rank
        entry = {"rank": None if dense_method else cfg.method.rank, "dense_method": dense_method, **dense_reference(cfg)}
        try:
            entry.update(plan_costs(cfg))
        except Exception as exc:  # noqa: BLE001 - a model the plan cannot read still gets its report
            entry["plan_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(entry, indent=1, default=str) + "\n")
        costs[c.name] = entry
    for h in held:
        for r in h["rows"]:
            c = costs.get(r["key"], {})
            r["rank"], r["width"], r["dense_method"] = c.get("rank"), c.get("width"), bool(c.get("dense_method"))
            r["client_training_bytes"] = c.get("client_training_bytes")
            dense = c.get("dense_bytes")
            r["dense_bytes"] = dense
            up = r.get("bytes_up_per_client_round")
            r["up_vs_dense"] = (up / dense) if up and dense else None
    tuning = {"client_rounds": sum(s["client_rounds"] for s in search),
              "client_rounds_unpruned": sum(s["client_rounds_unpruned"] for s in search),
              "wall_s": round(sum(s["wall_s"] for s in search), 1),
              "confirm_client_rounds": int(sum(r["rounds"] * (r["config"]["federation"].get("clients_per_round") or 0) for r in records)),
              "confirm_wall_s": round(float(confirm_wall_s if confirm_wall_s is not None else sum(r.get("wall_s") or 0 for r in records)), 1)}
    doc = {"config": spec.base.name, "methods": list(spec.labels), "sampler": spec.sampler, "pruner": spec.pruner,
           "trials_per_row": spec.trials, "objective": f"mean {_objective_name(spec)} "
                                                        f"over the last {spec.last} evaluated rounds, seed {spec.base.seed}",
           "heldout_seeds": list(spec.heldout_seeds), "horizons": horizons, "search": search, "heldout": held,
           "tuning_cost": tuning, "privacy": privacy,
           "inputs": next((r.get("inputs") for r in records if r.get("inputs")), None)}
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / "tune_report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = _markdown(doc)
    path = spec.out / "tune_report.md"
    path.write_text(md)
    try:
        _plots(spec.out, doc)
    except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn does not lose the report
        (spec.out / "tune_plots_error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
    return path


def _objective_name(spec: TuneSpec) -> str:
    from fedgalore.tune.search import objective_key

    return objective_key(spec.base)[0].replace("eval/", "")


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())


def _markdown(doc: dict[str, Any]) -> str:
    lines = [f"# fedgalore tune: {doc['config']}", ""]
    lines.append(f"Rows {', '.join(doc['methods'])}; search: {doc['sampler']} sampler, {doc['pruner']} pruner, "
                 f"{doc['trials_per_row']} trials per row; objective: {doc['objective']}. Held-out seeds "
                 f"{', '.join(map(str, doc['heldout_seeds']))} (none took part in the search); every number of the "
                 "recommendation and the held-out tables is from them.")
    lines.append("")
    for h in doc["heldout"]:
        if not h["rows"]:
            lines += [f"## {h['rounds']} rounds: no held-out cell finished yet", ""]
            continue
        best = h["rows"][0]
        scale = 100.0 if h["primary_metric"] in ("accuracy", "macro_f1", "f1", "exact_match") else 1.0
        unit = " %" if scale == 100.0 else ""
        cost = [f"uplink {_kib(best['bytes_up_per_client_round'])} KiB and downlink {_kib(best['bytes_down_per_client_round'])} KiB per client-round",
                f"client training memory {_mib(best.get('client_training_bytes'))} MiB (plan)",
                f"{best['wall_s_per_run']:.0f} s a run" if best.get("wall_s_per_run") else None,
                f"ε {best['dp_epsilon']:.3g}" if best.get("dp_epsilon") is not None else None]
        lines.append(f"## {h['rounds']} rounds: run **{best['label']}** at {_params_text(best['params'])}")
        lines.append("")
        lines.append(f"Test {h['primary_metric']} {_pct(best['mean'], scale)}{unit} (mean of seeds "
                     f"{', '.join(map(str, h['seeds']))}); it costs {'; '.join(c for c in cost if c)}.")
        lines.append("")
        lines.append(f"| row | values | test {h['primary_metric']} | per seed | − {best['label']} [95 % CI] | rank / width | "
                     "up / down KiB per client-round | up vs dense | client memory MiB (plan) | s a run | ε |")
        lines.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in h["rows"]:
            vs = r["vs_best"]
            vs_t = "–" if vs is None else f"{_pct(vs['mean'], scale)} [{_pct(vs['low'], scale)}, {_pct(vs['high'], scale)}]"
            rw = f"{r['rank']} / {r['width']}" if r.get("rank") and r.get("width") else "–"
            ratio = r.get("up_vs_dense")
            ratio_t = "–" if ratio is None else f"{ratio:.2f}×" + (" (the dense update itself)" if r.get("dense_method") else
                                                                " **(more than dense: not low-rank)**" if ratio > 1 else "")
            role = "" if r["role"] == "best" else f" ({r['role']})"
            lines.append(f"| {r['label']}{role} | {_params_text(r['params'])} | {_pct(r['mean'], scale)} ± {_pct(r['sd'], scale)} | "
                         f"{', '.join(_pct(v, scale) for v in r['per_seed'])} | {vs_t} | {rw} | "
                         f"{_kib(r['bytes_up_per_client_round'])} / {_kib(r['bytes_down_per_client_round'])} | {ratio_t} | "
                         f"{_mib(r.get('client_training_bytes'))} | {r['wall_s_per_run']:.0f} | "
                         f"{'–' if r['dp_epsilon'] is None else format(r['dp_epsilon'], '.3g')} |")
        if h.get("incomplete"):
            lines.append("")
            lines.append(f"Not in the table (held-out cells missing): {', '.join(h['incomplete'])}.")
        lines.append("")
    lines.append("## The search (validation, seed of the config; not a result)")
    lines.append("")
    lines.append("| row | space | finished / pruned / failed | best value | best values | client-rounds (all to the end) | wall s | note |")
    lines.append("|---|---|---:|---:|---|---:|---:|---|")
    for s in doc["search"]:
        note = "; ".join(([f"widened: {'; '.join(s['widened'])}"] if s["widened"] else [])
                         + ([f"**at the edge**: {'; '.join(s['at_edge'])} — widen the range"] if s["at_edge"] else []))
        lines.append(f"| {s['label']} | {'; '.join(s['space'])} | {s['finished']} / {s['pruned']} / {s['failed']} | "
                     f"{'–' if s['best_value'] is None else format(s['best_value'], '.4f')} | "
                     f"{_params_text(s['best_params']) if s['best_params'] else '–'} | {s['client_rounds']} ({s['client_rounds_unpruned']}) | "
                     f"{s['wall_s']:.0f} | {note or '–'} |")
    t = doc["tuning_cost"]
    share = (t["client_rounds"] / t["client_rounds_unpruned"]) if t["client_rounds_unpruned"] else float("nan")
    lines += ["", f"**What the tuning cost**: the search ran {t['client_rounds']} client-rounds "
                  f"({share:.0%} of the {t['client_rounds_unpruned']} its trials would have run unpruned) in {t['wall_s']:.0f} s "
                  f"of run time; the confirmation {t['confirm_client_rounds']} client-rounds in {t['confirm_wall_s']:.0f} s."]
    if doc.get("privacy"):
        p = doc["privacy"]
        lines += ["", "## Privacy spent by the tune", "",
                  f"Every trial and confirmation run released on the same sites; their ledgers ({p['where']}) recorded "
                  f"{p['releases']} release(s) during this tune. ε per site (the site's ledger, at δ = {p['delta']:g}, rows / "
                  "site as a whole): " + "; ".join(f"{k}: {v['rows']:.3g} / {v['site']:.3g}" for k, v in sorted(p["sites"].items()))
                  + ". To tune without spending, search on a public or proxy split (a config without privacy.*) and run "
                    "the chosen configuration privately once."]
    lines.append("")
    return "\n".join(lines)


def _plots(out: Path, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    search = doc["search"]
    n = max(1, len(search))
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), squeeze=False)
    for ax, s in zip(axes[0], search):
        for t in s["trials"]:
            lr = t["params"].get("train.lr")
            if lr is None:
                continue
            if t["state"] == "COMPLETE" and t["value"] is not None:
                ax.scatter([lr], [t["value"]], c="C0", s=18)
            elif t["intermediate"]:
                last = t["intermediate"][max(t["intermediate"])]
                ax.scatter([lr], [last], marker="x", c="C3", s=18)
        ax.set_xscale("log")
        ax.set_title(s["label"], fontsize=9)
        ax.set_xlabel("train.lr")
    axes[0][0].set_ylabel("validation (x: pruned, last report)")
    fig.tight_layout()
    fig.savefig(out / "tune_search.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, s in enumerate(search):
        xs = [t["number"] for t in s["trials"] if t["state"] == "COMPLETE"]
        ys = [t["value"] for t in s["trials"] if t["state"] == "COMPLETE"]
        ax.scatter(xs, ys, s=14, c=f"C{i}", label=s["label"])
        best, run = [], None
        for y in ys:
            run = y if run is None else max(run, y)
            best.append(run)
        ax.plot(xs, best, c=f"C{i}", lw=1)
    ax.set_xlabel("trial")
    ax.set_ylabel("validation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tune_history.png", dpi=110)
    plt.close(fig)

    held = [h for h in doc["heldout"] if h["rows"]]
    if held:
        fig, axes = plt.subplots(1, len(held), figsize=(4 * len(held), 3), squeeze=False)
        for ax, h in zip(axes[0], held):
            labels = [r["label"] + ("" if r["role"] == "best" else "*") for r in h["rows"]]
            ax.bar(range(len(labels)), [r["mean"] for r in h["rows"]], color="C0", alpha=0.6)
            for i, r in enumerate(h["rows"]):
                ax.scatter([i] * len(r["per_seed"]), r["per_seed"], c="k", s=8)
            ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
            ax.set_title(f"held-out, {h['rounds']} rounds", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "tune_heldout.png", dpi=110)
        plt.close(fig)
