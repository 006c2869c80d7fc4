"""Client-level DP across sites (DP-FedAvg): accuracy against ε for each method (issue 41, part 4).

Questions: does noise in FedGaLore's r·n seeded-basis coordinates beat noise in LoRA's factors
(FedIT: r·(m+n); FFA-LoRA: B only, m·r) or in the dense m·n (FedAvg-Full)? Is FedGaLore's
second-moment release (a second, composed Gaussian release) worth its share of the budget
against FedGaLore⁻ (no moment release)?

Federation (CPU, nothing to download): ``tiny_text`` (a random-weight 2-layer BERT, hidden 32, on
its learnable 4-class synthetic task; 20,000 examples) split over M = 1000 sites of 2 label shards
each (~18 training examples, mostly 1–2 classes), K = 100 sampled per round (q = 0.1), R = 30
rounds of one local epoch, batch 16, rank 4, 10 % of each site's examples held out for
validation, evaluated every 5th round.

Why this budget (2026-11-28, seed-0 probes, ``/tmp`` runs not kept): client-level DP's noise on
the mean is σ·C/K per coordinate, so K decides. M = 100, K = 20 (the first budget): FedIT at ε = 8
(σ = 3.21) stays at chance (22.6 %; 59.5 % without DP). M = 1000 and 4000 sites, K = 100 and 200,
with the adaptive clip started at C = 0.05: every method at chance at ε = 8 and even ε = 32 (σ
1.0), with FedAvgM (β 0.9, η 0.5) too — the clip needs ~25 of the 30 rounds to grow to the
update norms (median ≈ 2–3). Started at C = 1: FedGaLore⁻ at lr 0.3 reaches 87.5 % test at ε = 8
and 90.2 % at ε = 32 (97.7 % without DP). The FedGaLore family needs rates ~10× FedIT's here
(random rank-4 bases, one or two local steps): at lr 3e-2 it stays at chance without DP while
FedIT reaches 92.6 %. C = 1 was chosen on those probes' validation accuracy.

DP: ``privacy.client`` with central noise, σ calibrated to
ε ∈ {1, 3, 8} at δ = 1e-5 over the 30 rounds (dp-accounting RDP, K of M without replacement,
replace-one), adaptive clipping (start C = 1, target quantile 0.5, lr 0.2); ε = ∞ is the same
federation without DP. FedGaLore runs on seeded bases (``projector: random``, ``view_basis:
seeded``): ``fedgalore`` releases its moments too (σ_m = σ, so each release carries √2 × the noise
of a single one at the same ε), ``fedgalore_minus`` releases none, ``fedgalore_agg`` synchronises
from the noised aggregate (``sync: aggregate``: no second release).

Rates. Each method's learning rate is chosen on seed 0's *validation* accuracy (mean over the last
two evaluations, rounds 25 and 30) from :data:`RATES`, once without DP and once at ε = 8 (the DP rate is then used for every
ε); seeds 1–3 (not used for choosing) give the reported test accuracy, mean ± std.

Resuming: each finished run is ``benchmarks/results/dp_client/cells/<label>.json`` (the config
that made it, per round test/validation accuracy, ε, the clip norm, wall time); a stage skips
cells whose JSON is there with the same config. ``--shard i/n`` runs every n-th cell (two
single-threaded processes: ``--shard 0/2`` and ``--shard 1/2``).

Record level (``--level record``; cells in ``results/dp_record_study/``): DP-SGD at each site
(``privacy.record``) on few large sites, every method on its default bases — see
:func:`record_config_dict`; the same stages, rates chosen the same way (:data:`RECORD_RATES`).
The record budget was redesigned once on seed-0 probes: 8 Dirichlet-0.3 sites of ~2,700
examples, 4 per round, batch 256 (q ≈ 0.09), 10 rounds — without DP FedGaLore reached 75 % at
best (rates 3e-3 … 3e-1), and at ε = 8 every AdamW method at every rate from 1e-3 (FedAvg-Full
3e-4) to 3e-1 sat at chance (25–26 %; FedGaLore 3e-3: 33 %, FFA-LoRA at 3: 35 %): a site's
batch is too small for the noise. Four sites of ~5,400 examples, all in every round, batch 512:
without DP FedGaLore (0.1) reaches 99 %, at ε = 8 FFA-LoRA (3) 62 % and rising.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_client.py probe [--shard 0/2] [--level record]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_client.py seeds [--shard 0/2]
    .venv/bin/python benchmarks/dp_client.py report      # results/dp_client/dp_client.{json,md}
    options: --methods fedgalore,fedit   --quick (M = 20, K = 5, 6 rounds, into benchmarks/runs/dp_client_quick)
"""
# fedgalore-bench: not-in-all (a study with stages; run it by name)
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dp_client"
RUNS = ROOT / "benchmarks" / "runs" / "dp_client"
CELL_VERSION = 2  # 2: M = 1000 sites of 2 label shards, K = 100 (version 1: M = 100 Dirichlet 0.3, K = 20)
METHODS = {
    "fedgalore": {"name": "fedgalore", "options": {"projector": "random", "view_basis": "seeded"}},
    "fedgalore_minus": {"name": "fedgalore_minus", "options": {"projector": "random"}},
    "fedgalore_agg": {"name": "fedgalore", "options": {"projector": "random", "sync": "aggregate"}},
    "fedit": {"name": "fedit", "options": {}},
    "ffa_lora": {"name": "ffa_lora", "options": {}},
    "fedavg_full": {"name": "fedavg_full", "options": {}},
}
RATES = {"fedgalore": [1e-1, 3e-1, 1.0], "fedgalore_minus": [1e-1, 3e-1, 1.0], "fedgalore_agg": [1e-1, 3e-1, 1.0],
         "fedit": [1e-2, 3e-2, 1e-1], "fedavg_full": [3e-3, 1e-2, 3e-2],
         # FFA-LoRA trains B and the head with SGD: its rate is train.sgd_lr (train.lr is not used)
         "ffa_lora": [0.3, 1.0, 3.0, 10.0]}
EPSILONS = [None, 8.0, 3.0, 1.0]  # None: no DP (ε = ∞)
HELD_OUT_SEEDS = [1, 2, 3]
LAST = 2  # validation / test accuracy: mean over the last LAST evaluated rounds (every 5th round: rounds 25, 30)


#: ``--level record``: DP-SGD at each site (privacy.record) instead — few large sites, data-driven bases allowed
RECORD_METHODS = {
    "fedgalore": {"name": "fedgalore", "options": {}},
    "fedgalore_minus": {"name": "fedgalore_minus", "options": {}},
    "fedit": {"name": "fedit", "options": {}},
    "ffa_lora": {"name": "ffa_lora", "options": {}},
    "fedavg_full": {"name": "fedavg_full", "options": {}},
}
#: the second budget's grids (the first budget's probe, in the module doc, put the AdamW methods' best rates
#: without DP at 1e-2 … 1e-1 and showed lower rates no better under DP)
#: (3e-1 added after FedGaLore's best, with and without DP, came at 1e-1, the grid's top)
RECORD_RATES = {"fedgalore": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1], "fedgalore_minus": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
                "fedit": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1], "ffa_lora": [0.3, 1.0, 3.0, 10.0],
                "fedavg_full": [1e-3, 3e-3, 1e-2, 3e-2]}
#: "client" (default) or "record"; set by --level
LEVEL = "client"


def methods_table() -> dict:
    return RECORD_METHODS if LEVEL == "record" else METHODS


def rates_table() -> dict:
    return RECORD_RATES if LEVEL == "record" else RATES


def budget(quick: bool) -> dict:
    if LEVEL == "record":
        if quick:
            return {"num_clients": 4, "clients_per_round": 2, "rounds": 2, "n_train": 2000, "batch_size": 64, "eval_every": 1}
        return {"num_clients": 4, "clients_per_round": 4, "rounds": 10, "n_train": 24000, "batch_size": 512, "eval_every": 2}
    if quick:
        return {"num_clients": 20, "clients_per_round": 5, "rounds": 6, "n_train": 1000}
    return {"num_clients": 1000, "clients_per_round": 100, "rounds": 30, "n_train": 20000}


def config_dict(method: str, lr: float, eps: float | None, seed: int, quick: bool) -> dict:
    if LEVEL == "record":
        return record_config_dict(method, lr, eps, seed, quick)
    b = budget(quick)
    d = {
        "name": "dpc", "seed": seed,
        "task": {"name": "tiny_text", "options": {"n_train": b["n_train"], "n_test": 512}},
        "method": {"name": METHODS[method]["name"], "rank": 4, "options": dict(METHODS[method]["options"])},
        "federation": {"num_clients": b["num_clients"], "clients_per_round": b["clients_per_round"], "rounds": b["rounds"],
                       "partition": {"kind": "shards", "shards_per_client": 2}, "validation_fraction": 0.1,
                       "eval_every": 5},
        "train": {"lr": lr, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.0},
        "output": {"progress": "quiet", "checkpoint_every": 10},
        "diagnostics": False,
    }
    if METHODS[method]["name"] == "ffa_lora":  # SGD: the rate is train.sgd_lr
        d["train"]["sgd_lr"] = lr
    if eps is not None:
        # reproducible: the study's noise is seeded (same distribution as the default OS entropy, and each cell
        # reruns bit for bit); not a deployment's setting — privacy.json says it is not protected against the server
        d["privacy"] = {"client": {"clip": 1.0, "target_epsilon": eps, "delta": 1e-5, "noise": "central",
                                   "adaptive_clipping": {"target_quantile": 0.5, "lr": 0.2}}, "reproducible": True}
        # under privacy.client an upload's size is a public constant: FedGaLore needs fixed steps (fedgalore.privacy.view).
        # The shards are equal, so one epoch's steps of a site, for every method (cells before 2026-12-03 ran local_epochs: 1,
        # whose last batch was partial)
        rows = int(b["n_train"] * (1 - d["federation"]["validation_fraction"])) // b["num_clients"]
        d["train"] = {**{k: v for k, v in d["train"].items() if k != "local_epochs"}, "local_steps": -(-rows // 16)}
    return d


def record_config_dict(method: str, lr: float, eps: float | None, seed: int, quick: bool) -> dict:
    """Record-level cells: 4 sites of a Dirichlet(0.3) label split of 24,000 examples (~5,400
    training examples each), all 4 in every round, 10 rounds of one local epoch of batch 512
    (Poisson q ≈ 0.09 under DP), every method on its default bases (DP-SGD makes the gradient
    private, so RSVD bases and the moments are post-processing); ``privacy.record`` with C = 1 and
    σ calibrated (``calibration: every_round``: every site is in every round)."""
    b = budget(quick)
    m = RECORD_METHODS[method]
    d = {
        "name": "dpr", "seed": seed,
        "task": {"name": "tiny_text", "options": {"n_train": b["n_train"], "n_test": 512}},
        "method": {"name": m["name"], "rank": 4, "options": dict(m["options"])},
        "federation": {"num_clients": b["num_clients"], "clients_per_round": b["clients_per_round"], "rounds": b["rounds"],
                       "partition": {"kind": "dirichlet", "alpha": 0.3, "min_size": 200, "max_retries": 1000},
                       "validation_fraction": 0.1, "eval_every": b["eval_every"]},
        "train": {"lr": lr, "batch_size": b["batch_size"], "local_epochs": 1, "weight_decay": 0.0},
        "output": {"progress": "quiet", "checkpoint_every": 10},
        "diagnostics": False,
    }
    if m["name"] == "ffa_lora":
        d["train"]["sgd_lr"] = lr
    if eps is not None:
        d["privacy"] = {"record": {"max_grad_norm": 1.0, "target_epsilon": eps, "delta": 1e-5, "calibration": "every_round"},
                        "reproducible": True}  # a study: seeded noise (see client_config_dict)
    return d


def label(method: str, lr: float, eps: float | None, seed: int) -> str:
    return f"{method}_lr{lr:g}_eps{'inf' if eps is None else f'{eps:g}'}_s{seed}"


def results_dir(quick: bool) -> Path:
    base = "dp_record_study" if LEVEL == "record" else "dp_client"
    return RESULTS.parent / (base + "_quick" if quick else base)


def cell_path(name: str, quick: bool) -> Path:
    return results_dir(quick) / "cells" / f"{name}.json"


def run_cell(method: str, lr: float, eps: float | None, seed: int, quick: bool) -> dict:
    """Run one cell (or read its JSON when it is there with the same config)."""
    name = label(method, lr, eps, seed)
    path = cell_path(name, quick)
    cfg_d = config_dict(method, lr, eps, seed, quick)
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("version") == CELL_VERSION and old.get("config") == cfg_d:
            return old
    import torch

    import fedgalore
    from fedgalore.job.config import FederatedConfig

    torch.set_num_threads(1)
    out = RUNS.parent / results_dir(quick).name / name
    if out.exists():
        import shutil

        shutil.rmtree(out)
    cfg = FederatedConfig.from_dict({**cfg_d, "output": {**cfg_d["output"], "dir": str(out)}})
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = fedgalore.run(cfg)
    except (FloatingPointError, RuntimeError) as exc:  # a rate that diverges is a result, not a crash
        cell = {"version": CELL_VERSION, "config": cfg_d, "method": method, "lr": lr, "epsilon_target": eps, "seed": seed,
                "error": f"{type(exc).__name__}: {exc}"[:500], "rounds": [], "test_last": float("nan"), "val_last": float("nan"),
                "wall_s": time.perf_counter() - t0}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cell, indent=1))
        print(f"failed {name}: {cell['error']}", flush=True)
        return cell
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rounds = [{"round": h["round"], "test": h.get("eval/accuracy"), "val": h.get("eval/val_accuracy"),
               "epsilon": h.get("dp_client_epsilon"), "clip": h.get("dp_clip")} for h in res.history]
    priv = json.loads((res.run_dir / "privacy.json").read_text())
    cell = {"version": CELL_VERSION, "config": cfg_d, "method": method, "lr": lr, "epsilon_target": eps, "seed": seed,
            "rounds": rounds, **_privacy_numbers(priv),
            "test_last": _last(rounds, "test"), "val_last": _last(rounds, "val"), "wall_s": wall, "cpu_s": cpu,
            "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "loadavg_1m": os.getloadavg()[0]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell, indent=1))
    print(f"done {name}: test {cell['test_last']:.3f} val {cell['val_last']:.3f} ε {cell['epsilon']} ({wall:.0f} s)", flush=True)
    return cell


def _privacy_numbers(priv: dict) -> dict:
    """σ and ε of a run from its privacy.json: the federation's (client level: σ, σ_Δ with the
    clip bits' share taken, σ_m of the moment release) or the largest over the sites (record level)."""
    if LEVEL == "record":
        sites = priv.get("sites") or {}
        sig = [s.get("noise_multiplier") for s in sites.values() if isinstance(s, dict)]
        return {"sigma": max((x for x in sig if x is not None), default=None), "epsilon": priv.get("epsilon_max")}
    c = priv.get("client") or {}
    return {"sigma": c.get("noise_multiplier"), "update_sigma": c.get("update_noise_multiplier"),
            "moment_sigma": c.get("moment_noise_multiplier"), "epsilon": c.get("epsilon")}


def _last(rounds: list[dict], key: str) -> float:
    vals = [r[key] for r in rounds if isinstance(r.get(key), (int, float))][-LAST:]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def _shard(cells: list, shard: str | None) -> list:
    if not shard:
        return cells
    i, n = (int(x) for x in shard.split("/"))
    return cells[i::n]


def chosen_rate(method: str, dp: bool, quick: bool) -> float | None:
    """The rate of ``method`` with the best seed-0 validation accuracy (ties: the smaller rate),
    without DP or at ε = 8; None while a probe cell is missing."""
    eps = 8.0 if dp else None
    vals = []
    for lr in rates_table()[method]:
        p = cell_path(label(method, lr, eps, 0), quick)
        if not p.exists():
            return None
        val = json.loads(p.read_text())["val_last"]
        vals.append((-val if isinstance(val, (int, float)) and math.isfinite(val) else math.inf, lr))
    return min(vals)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["probe", "seeds", "report"])
    ap.add_argument("--level", choices=["client", "record"], default="client",
                    help="client: DP-FedAvg across sites (privacy.client); record: DP-SGD at each site (privacy.record)")
    ap.add_argument("--methods", default=None, help="comma-separated (default: every method of the level)")
    ap.add_argument("--shard", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    global LEVEL
    LEVEL = args.level
    methods = args.methods.split(",") if args.methods else list(methods_table())
    unknown = [m for m in methods if m not in methods_table()]
    if unknown:
        sys.exit(f"--methods: {', '.join(unknown)} not in the {LEVEL} study ({', '.join(methods_table())})")
    if args.stage == "probe":
        cells = [(m, lr, eps, 0) for m in methods for eps in (None, 8.0) for lr in rates_table()[m]]
        for c in _shard(cells, args.shard):
            run_cell(*c, quick=args.quick)
    elif args.stage == "seeds":
        cells = []
        for m in methods:
            for eps in EPSILONS:
                lr = chosen_rate(m, eps is not None, args.quick)
                if lr is None:
                    sys.exit(f"{m}: the probe is not complete; run the probe stage first")
                cells += [(m, lr, eps, s) for s in HELD_OUT_SEEDS]
        for c in _shard(cells, args.shard):
            run_cell(*c, quick=args.quick)
    else:
        report(methods, args.quick)


def report(methods: list[str], quick: bool) -> None:
    rows, table = [], []
    for m in methods:
        row = {"method": m, "rate_no_dp": chosen_rate(m, False, quick), "rate_dp": chosen_rate(m, True, quick)}
        for eps in EPSILONS:
            lr = row["rate_dp"] if eps is not None else row["rate_no_dp"]
            if lr is None:
                continue
            cells = [cell_path(label(m, lr, eps, s), quick) for s in HELD_OUT_SEEDS]
            got = [json.loads(p.read_text()) for p in cells if p.exists()]
            key = "inf" if eps is None else f"{eps:g}"
            if got:
                acc = [100 * c["test_last"] for c in got]
                row[key] = {"test_mean": statistics.mean(acc), "test_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                            "seeds": [c["seed"] for c in got], "sigma": got[0]["sigma"],
                            "epsilon": [c["epsilon"] for c in got], "wall_s": statistics.mean(c["wall_s"] for c in got)}
        rows.append(row)
        cellstr = []
        for eps in EPSILONS:
            r = row.get("inf" if eps is None else f"{eps:g}")
            cellstr.append("–" if r is None else f"{r['test_mean']:.1f} ± {r['test_std']:.1f}" + (
                "" if len(r["seeds"]) == 3 else f" ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})"))
        sig = row.get("8", {}).get("sigma")
        releases = 2 if LEVEL == "client" and m == "fedgalore" else 1
        sigstr = "–" if sig is None else f"{sig:.3g}" + (" (× 2 releases)" if releases == 2 else "")
        table.append(f"| {m} | {row['rate_no_dp']} / {row['rate_dp']} | {sigstr} | " + " | ".join(cellstr) + " |")
    out = results_dir(quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{out.name.removesuffix('_quick')}.json").write_text(json.dumps({"level": LEVEL, "budget": budget(quick), "rows": rows}, indent=1))
    md = ["| method | rate (no DP / DP) | σ at ε = 8 | ε = ∞ | ε = 8 | ε = 3 | ε = 1 |", "|---|---|---|---:|---:|---:|---:|", *table]
    (out / f"{out.name.removesuffix('_quick')}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    _plot(rows, out / f"{out.name.removesuffix('_quick')}.png")


def _plot(rows: list[dict], path: Path) -> None:
    """Test accuracy (mean ± std over the held-out seeds) against ε, one line per method; ε = ∞ at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = {1.0: 0, 3.0: 1, 8.0: 2, None: 3}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in rows:
        pts = [(xs[e], row[k]) for e in EPSILONS if (k := "inf" if e is None else f"{e:g}") in row]
        if not pts:
            continue
        ax.errorbar([x for x, _ in pts], [r["test_mean"] for _, r in pts], yerr=[r["test_std"] for _, r in pts],
                    marker="o", capsize=3, label=row["method"])
    ax.set_xticks(list(xs.values()), ["1", "3", "8", "∞"])
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy % (held-out seeds)")
    ax.set_title(f"{LEVEL}-level DP: accuracy against ε")
    ax.axhline(25, color="grey", lw=0.8, ls=":")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
