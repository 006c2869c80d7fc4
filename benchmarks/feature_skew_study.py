"""Feature skew, where the paper made its strongest claim: does heterogeneity hurt, and does the sync help?

Task: ``offline_vision_domains`` (``conf/pipeline/offline_vision_domains.yaml``): Fashion-MNIST drawn
in five visual domains (photo, sketch, negative, rotated, mosaic), the tiny ViT pretrained on photo
images of classes 0–4, M = 50 clients, K = 5 per round, E = 2, R = 20 rounds, rank 8, 10 % of the
training pool held out as a validation split (``federation.validation_fraction: 0.1``).

Settings (``SETTINGS``): ``iid`` (every client a mix of domains and labels); ``domain`` — every
client holds one domain (``pathological:1@domain``, 10 clients per domain), labels as the domain
has them; ``domain_label`` — label and domain skew together (``dirichlet:0.1@domain_label``).

Stages (each skips the cells whose JSON is already in ``benchmarks/results/feature_skew/cells/``
with the same config; ``--shard i/n`` runs every n-th cell, so two processes share a stage)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_study.py probe --shard 0/2   # rates, seed 0, per setting
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_study.py seeds --shard 0/2   # held-out seeds 1-4
    .venv/bin/python benchmarks/feature_skew_study.py report   # results/feature_skew/feature_skew.{json,md}

The paper's horizon (R = 50, about 2.5x a 20-round cell): ``seeds --rounds 50`` runs the held-out
seeds at 50 rounds with the rates the probe chose at 20 (the choice is not re-made at 50, and the
cosine schedule stretches over the longer run); ``report --rounds 50`` writes
``feature_skew_r50.{json,md,png}``; ``probe --rounds 50`` re-runs seed 0's grid at 50 rounds to
check the 20-round choice (the report shows both; it changes no choice).

``--methods`` and ``--settings`` choose a stage's cells (default: the gap's methods, FedAvg-Full and
FedIT, on iid and domain — does heterogeneity hurt here? — ; the method study:
``--methods fedgalore,fedgalore_synced,fedgalore_minus,fedavg_full,fedit,fedit_prox,flexlora,fed_sb
--settings domain``); the variants (``VARIANTS``) are methods with options: ``fedit_prox`` is
FedIT + FedProx (``train.prox_mu: 0.01``), ``fedgalore_synced`` FedGaLore with the synchronised state
kept across rounds (``first_basis: synced``, not the paper's Algorithm 1). Rates: each method's rate is chosen **per setting** on seed 0 by the mean
*validation* accuracy over the last two evaluated rounds (ties: the smaller rate); seeds 1–4 take
no part in any choice. The gap is paired by seed (every seed trains on the same images — the task's
own seed is fixed — and a run seed draws the split, the client sampling and the round seeds; rates
chosen per setting): non-IID − IID, mean ± t₀.₉₇₅ · sd / √n. The ``seeds`` stage needs the probe of
every cell it runs: run it after both probe shards have finished.
"""
# fedgalore-bench: not-in-all (a long study with stages; run it by name)
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import _study_cells as cells_lib

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "pipeline" / "offline_vision_domains.yaml"
OUT = ROOT / "benchmarks" / "results" / "feature_skew"
RUNS = ROOT / "benchmarks" / "runs" / "feature_skew"  # run directories: never committed
CELL_VERSION = 1

#: partition of each setting (federation.partition)
SETTINGS: dict[str, dict] = {
    "iid": {"kind": "iid"},
    "domain": {"kind": "pathological", "classes_per_client": 1, "by": "domain"},
    "domain_label": {"kind": "dirichlet", "alpha": 0.1, "by": "domain_label", "min_size": 1, "max_retries": 1000},
}
#: the study's variants: a method, its options and train overrides, and its learning-rate grid (the
#: repro_vision probe's neighbourhood: FedAvg-Full and FedGaLore 1e-3, LoRA 3e-3, FedGaLore⁻ 1e-2)
VARIANTS: dict[str, dict] = {
    "fedavg_full": {"method": "fedavg_full", "rates": [3e-4, 1e-3, 3e-3]},
    "fedit": {"method": "fedit", "rates": [1e-3, 3e-3, 1e-2]},
    "fedit_prox": {"method": "fedit", "train": {"prox_mu": 0.01}, "rates": [1e-3, 3e-3, 1e-2, 3e-2]},  # 3e-2: 1e-2 won on domain_label
    # FedGaLore's grid reaches 3e-2 (with the state kept, 1e-1): on the domain split seed 0's validation kept rising at the top
    "fedgalore": {"method": "fedgalore", "rates": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]},
    "fedgalore_synced": {"method": "fedgalore", "options": {"first_basis": "synced"}, "rates": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]},
    "fedgalore_minus": {"method": "fedgalore_minus", "rates": [1e-3, 3e-3, 1e-2, 3e-2]},  # 3e-2: 1e-2 won on the domain split
    "flexlora": {"method": "flexlora", "rates": [1e-3, 3e-3, 1e-2]},
    "fed_sb": {"method": "fed_sb", "rates": [3e-3, 1e-2, 3e-2, 1e-1]},  # 3e-3: 1e-2 won on the domain split
}
RATES = {name: v["rates"] for name, v in VARIANTS.items()}
GAP_METHODS = ("fedavg_full", "fedit")
GAP_SETTINGS = ("iid", "domain")
SEEDS = (1, 2, 3, 4)
LAST = 2  # mean over the last LAST evaluated rounds (eval every 5th round: rounds 15 and 20)


def base_config() -> dict:
    import yaml

    return yaml.safe_load(CONFIG.read_text())


def config_rounds() -> int:
    """The config's rounds: the horizon the probe chooses rates at, and of the unsuffixed cells."""
    return int(base_config()["federation"]["rounds"])


def config_dict(variant: str, lr: float, setting: str, seed: int, rounds: int | None = None) -> dict:
    v = VARIANTS[variant]
    method = v["method"]
    d = base_config()
    d["name"] = "feature_skew"
    d["seed"] = seed
    opts = dict(d["method"]["options"]) if method.startswith("fedgalore") else {}
    d["method"] = {"name": method, "rank": 8, "options": {**opts, **v.get("options", {})}}
    fed = dict(d["federation"])
    fed["partition"] = dict(SETTINGS[setting])
    fed["validation_fraction"] = 0.1
    if rounds is not None:  # a longer horizon (the paper's R = 50); the schedule (cosine, warm-up) spans it
        fed["rounds"] = rounds
    d["federation"] = fed
    d["train"] = {**d["train"], **v.get("train", {}), "lr": lr}
    d["output"] = {"progress": "quiet", "checkpoint_every": 100, "keep_checkpoints": 1}
    d.pop("compare", None)
    return d


def label(method: str, lr: float, setting: str, seed: int, rounds: int | None = None) -> str:
    return f"{method}_{setting}_lr{lr:g}_s{seed}" + (f"_r{rounds}" if rounds is not None else "")


def cell_path(name: str) -> Path:
    return OUT / "cells" / f"{name}.json"


def _last(rounds: list[dict], key: str) -> float:
    vals = [r[key] for r in rounds if isinstance(r.get(key), (int, float))][-LAST:]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def _scalars(h: dict) -> dict:
    """The round's scalar history entries (metrics, bytes, diagnostics), rounded for a small JSON."""
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in h.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (not isinstance(v, float) or math.isfinite(v))}


def _summarize(res, wall: float, cpu: float) -> dict:
    """Per round every scalar of the history (test/validation/per-domain accuracy, bytes, the drift
    and update-space diagnostics), and the study's summaries."""
    diag = {}
    path = Path(res.run_dir) / "diagnostics.jsonl"  # drift, tail energy, the sync's and the clients' numbers
    if path.is_file():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            diag.setdefault(d.get("round"), {}).update({f"diag/{k}": v for k, v in _scalars(d).items() if k != "round"})
    rounds = []
    for h in res.history:
        r = _scalars(h) | diag.get(h.get("round"), {})
        r["test"], r["val"] = h.get("eval/accuracy"), h.get("eval/val_accuracy")
        rounds.append(r)
    domains = [k.removeprefix("eval/accuracy_") for k in (rounds[-1] if rounds else {}) if k.startswith("eval/accuracy_")]
    return {"rounds": rounds, "test_last": _last(rounds, "test"), "val_last": _last(rounds, "val"),
            "test_final": rounds[-1]["test"] if rounds else float("nan"),
            "domain_last": {d: _last(rounds, f"eval/accuracy_{d}") for d in domains},
            "bytes_up_total": sum(r.get("bytes_up") or 0 for r in rounds),
            "bytes_down_total": sum(r.get("bytes_down") or 0 for r in rounds)}


def run_cell(variant: str, lr: float, setting: str, seed: int, rounds: int | None = None) -> dict:
    """Run one cell, or read its JSON when it is there with the same config."""
    name = label(variant, lr, setting, seed, rounds)
    base = {"method": VARIANTS[variant]["method"], "variant": variant, "lr": lr, "setting": setting, "seed": seed}
    return cells_lib.run_cell(cell_path(name), config_dict(variant, lr, setting, seed, rounds), base, RUNS / name,
                              _summarize, CELL_VERSION)


def probe_cells(methods: list[str], settings: list[str], rounds: int | None = None) -> list[tuple]:
    return [(m, lr, s, 0, rounds) for m in methods for s in settings for lr in RATES[m]]


def choice(method: str, setting: str) -> float | None:
    """The rate with the best seed-0 validation accuracy on ``setting`` (ties: the smaller rate);
    None while the probe is incomplete."""
    scores = {}
    for lr in RATES[method]:
        p = cell_path(label(method, lr, setting, 0))
        if not p.exists():
            return None
        v = json.loads(p.read_text()).get("val_last", float("nan"))
        scores[lr] = v if isinstance(v, (int, float)) and math.isfinite(v) else -1.0
    return max(scores, key=lambda lr: (scores[lr], -lr))


def seed_cells(methods: list[str], settings: list[str], rounds: int | None = None) -> list[tuple]:
    cells, missing = [], []
    for m in methods:
        for s in settings:
            lr = choice(m, s)
            if lr is None:
                missing.append(f"{m}@{s}")
                continue
            cells += [(m, lr, s, seed, rounds) for seed in SEEDS]
    if missing:
        print(f"probe incomplete for {', '.join(missing)}: skipped; run this stage again after the probe", flush=True)
    return cells


def _cell(method: str, setting: str, seed: int, rounds: int | None = None) -> dict | None:
    lr = choice(method, setting)
    if lr is None:
        return None
    p = cell_path(label(method, lr, setting, seed, rounds))
    return json.loads(p.read_text()) if p.exists() else None


def _probe_val(method: str, setting: str, rounds: int | None = None) -> dict[float, float | None]:
    """Seed 0's validation accuracy per rate of ``method``'s grid on ``setting`` (the cells there)."""
    paths = {lr: cell_path(label(method, lr, setting, 0, rounds)) for lr in RATES[method]}
    return {lr: json.loads(p.read_text()).get("val_last") for lr, p in paths.items() if p.exists()}


def report(methods: list[str], settings: list[str], rounds: int | None = None) -> dict:
    """Rows, gaps to IID and paired differences against FedGaLore and FedGaLore⁻ of the held-out
    seeds at ``rounds`` (None: the config's); written to ``feature_skew[_r<rounds>].{json,md,png}``.
    Refused when the cells ran on two backbones (:func:`_study_cells.check_one_backbone`)."""
    cells_lib.check_one_backbone(OUT / "cells")
    rows = []
    for m in methods:
        for s in settings:
            probe = _probe_val(m, s)
            # seed 0's grid re-run at the horizon (probe --rounds): a check on the choice, not a choice
            probe_h = _probe_val(m, s, rounds) if rounds is not None else {}
            cells = [c for c in (_cell(m, s, seed, rounds) for seed in SEEDS) if c is not None]
            if not cells and not probe:  # a method the study did not run on this split
                continue
            tests = [c["test_last"] for c in cells]
            dom = {}
            for c in cells:
                for d, v in c.get("domain_last", {}).items():
                    dom.setdefault(d, []).append(v)
            rows.append({"method": m, "setting": s, "lr": choice(m, s), "probe_val": probe, "probe_val_horizon": probe_h,
                         "seeds": [c["seed"] for c in cells],
                         "test": tests, "test_mean": statistics.fmean(tests) if tests else None,
                         "test_sd": statistics.stdev(tests) if len(tests) > 1 else None,
                         "domain_mean": {d: statistics.fmean(v) for d, v in dom.items()},
                         "up_per_client_round": _per_client_round(cells, "bytes_up_total"),
                         "down_per_client_round": _per_client_round(cells, "bytes_down_total"),
                         "wall_s_mean": statistics.fmean([c["wall_s"] for c in cells]) if cells else None,
                         "diagnostics": _diag_means(cells)})
    gaps = []
    for m in methods:
        iid = {c["seed"]: c["test_last"] for c in (_cell(m, "iid", s, rounds) for s in SEEDS) if c}
        for s in settings:
            if s == "iid":
                continue
            other = {c["seed"]: c["test_last"] for c in (_cell(m, s, seed, rounds) for seed in SEEDS) if c}
            common = sorted(set(iid) & set(other))
            if common:
                gaps.append({"method": m, "setting": s, **cells_lib.paired([other[k] for k in common], [iid[k] for k in common]),
                             "seeds": common})
    pairs = []  # every method against FedGaLore and FedGaLore⁻ on each split, paired by seed
    for s in settings:
        for ref in ("fedgalore", "fedgalore_minus"):
            if ref not in methods:
                continue
            base = {c["seed"]: c["test_last"] for c in (_cell(ref, s, seed, rounds) for seed in SEEDS) if c}
            for m in methods:
                if m == ref:
                    continue
                other = {c["seed"]: c["test_last"] for c in (_cell(m, s, seed, rounds) for seed in SEEDS) if c}
                common = sorted(set(base) & set(other))
                if len(common) > 1:
                    pairs.append({"method": m, "against": ref, "setting": s, "seeds": common,
                                  **cells_lib.paired([other[k] for k in common], [base[k] for k in common])})
    out = {"task": "offline_vision_domains", "config": str(CONFIG.relative_to(ROOT)), "settings": SETTINGS,
           "rounds": rounds or config_rounds(), "rates_chosen_at_rounds": config_rounds(),
           "seeds": list(SEEDS), "rows": rows, "gaps": gaps, "pairs": pairs}
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "feature_skew" + (f"_r{rounds}" if rounds is not None else "")
    (OUT / f"{stem}.json").write_text(json.dumps(out, indent=1))
    (OUT / f"{stem}.md").write_text(markdown(out))
    figure(methods, settings, rounds).savefig(OUT / f"{stem}.png", dpi=110)
    print(markdown(out))
    return out


#: the per-round diagnostics the report averages (over rounds and seeds): client drift
#: ‖ΔW_i − ΔW̄‖/‖ΔW̄‖, the aggregate's energy beyond rank r, and FedGaLore's sync and warm start
DIAGNOSTICS = ("drift_mean", "tail_energy_mean", "prior_retained", "warm_kept", "mismatch_before", "mismatch_after")


def _diag_means(cells: list[dict]) -> dict[str, float]:
    out = {}
    for key in DIAGNOSTICS:
        vals = [r[f"diag/{key}"] for c in cells for r in c.get("rounds", []) if isinstance(r.get(f"diag/{key}"), (int, float))]
        if vals:
            out[key] = statistics.fmean(vals)
    return out


def figure(methods: list[str], settings: list[str], rounds: int | None = None):
    """Left: test accuracy over rounds (mean over the held-out seeds) of every method on each
    non-IID setting, FedAvg-Full's IID curve dashed for reference. Right: per-domain test accuracy
    at the end (mean over the last two evaluations and the seeds) on the first non-IID setting."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.2), layout="constrained")
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    skewed = [s for s in settings if s != "iid"]
    styles = ["-", ":", "-."]
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}  # one colour per method, one line style per split
    for m in methods:
        for k, s in enumerate(skewed + (["iid"] if m == "fedavg_full" and "iid" in settings else [])):
            cells = [c for c in (_cell(m, s, seed, rounds) for seed in SEEDS) if c and c.get("rounds")]
            if not cells:
                continue
            xs = [r["round"] for r in cells[0]["rounds"] if isinstance(r.get("test"), (int, float))]
            acc = [statistics.fmean(next(r["test"] for r in c["rounds"] if r["round"] == t) for c in cells) for t in xs]
            left.plot(xs, [100 * a for a in acc], ls="--" if s == "iid" else styles[k % 3], marker="o", ms=3, color=colors[m],
                      label=f"{m} ({s}, n={len(cells)})")
    left.set_xlabel("round")
    left.set_ylabel("test accuracy % (mean over held-out seeds)")
    left.legend(fontsize=6, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    left.set_title(f"feature skew, {rounds or config_rounds()} rounds (line style: the split; dashed: IID)", fontsize=9)
    if skewed:
        rows = []
        for m in methods:
            cells = [c for c in (_cell(m, skewed[0], seed, rounds) for seed in SEEDS) if c and c.get("domain_last")]
            if cells:
                doms = list(cells[0]["domain_last"])
                rows.append((m, doms, [100 * statistics.fmean(c["domain_last"][d] for c in cells) for d in doms]))
        width = 0.8 / max(len(rows), 1)
        for j, (m, doms, vals) in enumerate(rows):
            right.bar([i + (j - (len(rows) - 1) / 2) * width for i in range(len(doms))], vals, width=width, label=m,
                      color=colors[m])
        if rows:
            right.set_xticks(range(len(rows[0][1])), rows[0][1])
        right.set_ylabel(f"test accuracy % per domain ({skewed[0]})")
        right.legend(fontsize=6, ncols=2)
    return fig


def _per_client_round(cells: list[dict], key: str) -> float | None:
    if not cells:
        return None
    c = cells[0]["config"]["federation"]
    return statistics.fmean(cell[key] for cell in cells) / (c["rounds"] * c["clients_per_round"])


def _pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.1f}"


def markdown(r: dict) -> str:
    lines = [f"{r['rounds']} rounds; rates chosen on seed 0's validation split at {r['rates_chosen_at_rounds']} rounds; "
             f"test accuracy is the mean of the last {LAST} evaluations.", "",
             "| method | setting | rate | test accuracy % (seeds) | per domain % | drift | tail energy | up / down KiB per client-round |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for row in r["rows"]:
        sd = f" ± {100 * row['test_sd']:.1f}" if row["test_sd"] is not None else ""
        dom = ", ".join(f"{d} {_pct(v)}" for d, v in row["domain_mean"].items())
        dg = row.get("diagnostics", {})
        num = lambda k: f"{dg[k]:.3f}" if k in dg else "—"  # noqa: E731
        kib = lambda v: f"{v / 1024:,.0f}" if v is not None else "—"  # noqa: E731
        lines.append(f"| {row['method']} | {row['setting']} | {row['lr'] if row['lr'] is not None else '—'} | "
                     f"{_pct(row['test_mean'])}{sd} (n={len(row['test'])}) | {dom} | {num('drift_mean')} | "
                     f"{num('tail_energy_mean')} | {kib(row['up_per_client_round'])} / {kib(row['down_per_client_round'])} |")
    checked = [row for row in r["rows"] if row.get("probe_val_horizon")]
    if checked:
        lines += ["", f"Seed 0's validation % per rate at {r['rounds']} rounds against at {r['rates_chosen_at_rounds']} "
                  "(the choice is made at the latter):", "", "| method | setting | rate: at the horizon / at the choice |", "|---|---|---|"]
        for row in checked:
            cells_txt = ", ".join(f"{lr:g}: {_pct(v)} / {_pct(row['probe_val'].get(lr))}" for lr, v in row["probe_val_horizon"].items())
            lines.append(f"| {row['method']} | {row['setting']} | {cells_txt} |")
    lines += ["", "| method | setting − IID (points) | 95 % interval | n |", "|---|---:|---|---:|"]
    for g in r["gaps"]:
        lines.append(f"| {g['method']} | {100 * g['mean']:+.1f} | [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}] | {g['n']} |"
                     if g["n"] > 1 else f"| {g['method']} | {100 * g['mean']:+.1f} | — | {g['n']} |")
    lines += ["", "| method | − reference (points, paired) | reference | setting | n |", "|---|---:|---|---|---:|"]
    for g in r.get("pairs", []):
        lines.append(f"| {g['method']} | {100 * g['mean']:+.1f} [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}] | "
                     f"{g['against']} | {g['setting']} | {g['n']} |")
    # mismatch_before: the clients' second moments from their mean; mismatch_after: from the broadcast
    # v̄ (the mean minimises the weighted squared distances, so "after" sits at or above "before"
    # unless the spread is very uneven: the column does not measure a drop the sync should cause)
    lines += ["", "| method | setting | prior retained | warm kept | second-moment mismatch: clients to their mean → to the broadcast v̄ |",
              "|---|---|---:|---:|---:|"]
    for row in r["rows"]:
        dg = row.get("diagnostics", {})
        if "prior_retained" in dg or "warm_kept" in dg:
            lines.append(f"| {row['method']} | {row['setting']} | {dg.get('prior_retained', float('nan')):.3f} | "
                         f"{dg.get('warm_kept', float('nan')):.3f} | {dg.get('mismatch_before', float('nan')):.3f} → "
                         f"{dg.get('mismatch_after', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["probe", "seeds", "report"])
    ap.add_argument("--shard", help="i/n: run every n-th cell starting at i (two processes share a stage)")
    ap.add_argument("--methods", help="comma-separated methods (default: " + ",".join(GAP_METHODS) + ")")
    ap.add_argument("--settings", help="comma-separated settings (default: " + ",".join(GAP_SETTINGS) + f"; all: {','.join(SETTINGS)})")
    ap.add_argument("--rounds", type=int, help="the held-out seeds (seeds, report) at this horizon (the paper's R = 50) at the "
                    "rates the probe chose at the config's rounds; probe --rounds N re-runs seed 0's grid at N only to check "
                    "that choice (it chooses nothing); cells and report get the suffix _r<rounds>")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds takes a positive count of rounds, e.g. --rounds 50")
    if args.rounds == config_rounds():
        args.rounds = None  # the config's own horizon: the unsuffixed cells
    methods = args.methods.split(",") if args.methods else list(GAP_METHODS)
    settings = args.settings.split(",") if args.settings else list(GAP_SETTINGS)
    bad = [m for m in methods if m not in RATES] + [s for s in settings if s not in SETTINGS]
    if bad:
        ap.error(f"unknown method or setting {bad[0]!r}; methods: {', '.join(RATES)}; settings: {', '.join(SETTINGS)}")
    if args.stage == "report":
        report(methods, settings, args.rounds)
        return 0
    cells = probe_cells(methods, settings, args.rounds) if args.stage == "probe" else seed_cells(methods, settings, args.rounds)
    todo = cells_lib.shard(cells, args.shard)
    print(f"{args.stage}: {len(todo)} cells in this shard", flush=True)
    for c in todo:
        run_cell(*c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
