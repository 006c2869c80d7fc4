"""Federated LoRA methods of 2024–2025 beside FedGaLore, and sites at different ranks, on the offline text budget.

Budget: ``conf/repro/offline_text_50.yaml`` (MiniLM-L6 × BBC News, 50 sites, 5 per round, 2 local
epochs, 6 rounds, 64 tokens, rank 8) with 10 % of the training pool held out as a validation split
(``federation.validation_fraction: 0.1``), label skew Dirichlet α ∈ {0.3, 0.1}.

Stages (each skips the cells whose JSON is already in ``benchmarks/results/site_ranks/cells/``
with the same config; ``--shard i/n`` runs every n-th cell, so two processes share a stage)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/site_ranks_study.py probe  --shard 0/2   # rates, seed 0, α 0.3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/site_ranks_study.py seeds  --shard 0/2   # held-out seeds 1-3, α 0.3 and 0.1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/site_ranks_study.py mixed  --shard 0/2   # a third of the sites at rank 2, 8, 32
    .venv/bin/python benchmarks/site_ranks_study.py report    # results/site_ranks/site_ranks.{json,md}

Rates. Each method's rate is chosen on seed 0 at α = 0.3 by the mean *validation* accuracy over the
last two evaluated rounds (ties: the smaller rate) and used unchanged at α = 0.1 (a second probe at
α = 0.1 would double the probe's cost; the report says so). Seeds 1–3 did not take part in any
choice. Comparisons are paired by seed (one partition and one seed chain per seed, the same for
every method); intervals are the mean paired difference ± t₀.₉₇₅ · sd / √n.

Sites at different ranks (stage ``mixed``): the same federation with ``federation.site_ranks`` tiers
rank 2 / 8 / 32 (sites 0–15, 16–32, 33–49; contiguous ids are not correlated with the label mix)
against every site at rank 8 (the seeds stage's cells), for FedGaLore, FLoRA, FlexLoRA and HetLoRA
at each method's rank-8 rate. Uplink and downlink bytes come from each run's ledger; the memory of
a client per tier from ``fedgalore plan`` (exact from shapes, checked against real runs in
tests/cli/test_plan.py): one process trains every site in turn here, so a per-site peak cannot be
measured on this CPU.
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

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "conf" / "repro" / "offline_text_50.yaml"
OUT = ROOT / "benchmarks" / "results" / "site_ranks"
RUNS = ROOT / "benchmarks" / "runs" / "site_ranks"
CELL_VERSION = 1

#: every method of the comparison and its probe rates (train.lr; SGD methods train.sgd_lr): around the rates earlier 6-round studies chose
#: on validation at this budget (benchmarks/horizon.py SIX_ROUND_RATE: FedGaLore and FedGaLore⁻ 1e-2,
#: FedAvg-Full 5e-4, FedIT 5e-3); the newer LoRA methods share FedIT's grid, Fed-SB (an r × r matrix
#: between frozen factors) a grid 4× higher
RATES: dict[str, list[float]] = {
    "fedgalore": [3e-3, 1e-2, 3e-2],
    "flora": [2e-3, 5e-3, 1e-2],
    "fedgalore_minus": [3e-3, 1e-2, 3e-2],
    "fedit": [2e-3, 5e-3, 1e-2],
    "fedavg_full": [2e-4, 5e-4, 1e-3],
    "flexlora": [2e-3, 5e-3, 1e-2],
    "hetlora": [2e-3, 5e-3, 1e-2],
    "fedex_lora": [2e-3, 5e-3, 1e-2],
    "fedsa_lora": [2e-2, 1e-1, 5e-1],  # SGD, its reference optimizer: train.sgd_lr (FFA-LoRA's grid at this budget)
    "fed_sb": [5e-3, 2e-2, 5e-2],
}
#: methods whose reference optimizer is SGD: their rate is train.sgd_lr (train.lr is not read)
SGD_METHODS = ("fedsa_lora",)
PROBE_ALPHA = 0.3
ALPHAS = (0.3, 0.1)
SEEDS = (1, 2, 3)
MIXED_METHODS = ("fedgalore", "flora", "flexlora", "hetlora")
TIERS = [{"rank": 2}, {"rank": 8}, {"rank": 32}]
LAST = 2  # mean over the last LAST evaluated rounds (eval every 2nd round: rounds 4 and 6)


def base_config() -> dict:
    import yaml

    return yaml.safe_load(CONFIG.read_text())


def config_dict(method: str, lr: float, alpha: float, seed: int, mixed: bool = False) -> dict:
    d = base_config()
    d["name"] = "site_ranks"
    d["seed"] = seed
    d["method"] = {"name": method, "rank": 8, "options": dict(d["method"]["options"]) if method.startswith("fedgalore") else {}}
    fed = dict(d["federation"])
    fed["partition"] = {"kind": "dirichlet", "alpha": alpha, "min_size": 1, "max_retries": 1000}  # the horizon study's draws
    fed["validation_fraction"] = 0.1
    if mixed:
        fed["site_ranks"] = {"tiers": [dict(t) for t in TIERS]}
    d["federation"] = fed
    d["train"] = {**d["train"], ("sgd_lr" if method in SGD_METHODS else "lr"): lr}
    d["output"] = {"progress": "quiet", "checkpoint_every": 100, "keep_checkpoints": 1}
    d["diagnostics"] = False
    return d


def label(method: str, lr: float, alpha: float, seed: int, mixed: bool = False) -> str:
    return f"{method}{'_mixed' if mixed else ''}_lr{lr:g}_a{alpha:g}_s{seed}"


def cell_path(name: str) -> Path:
    return OUT / "cells" / f"{name}.json"


def _last(rounds: list[dict], key: str) -> float:
    vals = [r[key] for r in rounds if isinstance(r.get(key), (int, float))][-LAST:]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def _summarize(res, wall: float, cpu: float) -> dict:
    """Per round test/validation accuracy and bytes; the uplink per client from the run's ledger."""
    rounds = [{"round": h["round"], "test": h.get("eval/accuracy"), "val": h.get("eval/val_accuracy"),
               "bytes_up": h.get("bytes_up"), "bytes_down": h.get("bytes_down")} for h in res.history]
    ledger = [json.loads(line) for line in (res.run_dir / "ledger.jsonl").read_text().splitlines()] \
        if (res.run_dir / "ledger.jsonl").is_file() else []
    up_by_client: dict[int, list[int]] = {}
    for r in ledger:
        if r.get("direction") == "up":
            up_by_client.setdefault(int(r["client"]), []).append(int(r["bytes"]))
    return {"rounds": rounds, "test_last": _last(rounds, "test"), "val_last": _last(rounds, "val"),
            "test_final": rounds[-1]["test"] if rounds else float("nan"),
            "bytes_up_total": sum(r["bytes_up"] or 0 for r in rounds), "bytes_down_total": sum(r["bytes_down"] or 0 for r in rounds),
            "up_mean_by_client": {c: statistics.fmean(v) for c, v in sorted(up_by_client.items())}}


def run_cell(method: str, lr: float, alpha: float, seed: int, mixed: bool = False) -> dict:
    """Run one cell, or read its JSON when it is there with the same config."""
    name = label(method, lr, alpha, seed, mixed)
    base = {"method": method, "lr": lr, "alpha": alpha, "seed": seed, "mixed": mixed}
    return cells_lib.run_cell(cell_path(name), config_dict(method, lr, alpha, seed, mixed), base, RUNS / name, _summarize,
                              CELL_VERSION, flush_denormal=False)


def probe_cells(methods: list[str]) -> list[tuple]:
    return [(m, lr, PROBE_ALPHA, 0, False) for m in methods for lr in RATES[m]]


def choice(methods: list[str] | None = None) -> dict[str, float | None]:
    """Each method's rate: the best seed-0 validation accuracy at α = 0.3 (ties: the smaller
    rate); None while its probe is incomplete."""
    out: dict[str, float | None] = {}
    for m in methods or list(RATES):
        scores = {}
        for lr in RATES[m]:
            p = cell_path(label(m, lr, PROBE_ALPHA, 0))
            if not p.exists():
                break
            v = json.loads(p.read_text()).get("val_last", float("nan"))
            scores[lr] = v if isinstance(v, (int, float)) and math.isfinite(v) else -1.0
        out[m] = max(scores, key=lambda lr: (scores[lr], -lr)) if len(scores) == len(RATES[m]) else None
    return out


def _pending(rates: dict[str, float | None]) -> None:
    """Say which methods' cells a stage skips because their probe is not complete (another shard
    may still be running it: run the stage again once every probe cell is in)."""
    missing = [m for m, lr in rates.items() if lr is None]
    if missing:
        print(f"probe incomplete for {', '.join(missing)}: their cells are skipped; run this stage again after the probe",
              flush=True)


def seed_cells(methods: list[str], alphas: tuple[float, ...] = ALPHAS) -> list[tuple]:
    rates = choice(methods)
    _pending(rates)
    return [(m, rates[m], a, s, False) for a in alphas for s in SEEDS for m in methods if rates[m] is not None]


def mixed_cells() -> list[tuple]:
    rates = choice(list(MIXED_METHODS))
    _pending(rates)
    cells = []
    for s in SEEDS:
        for m in MIXED_METHODS:
            if rates[m] is not None:
                cells += [(m, rates[m], PROBE_ALPHA, s, True), (m, rates[m], PROBE_ALPHA, s, False)]
    return cells


def report() -> dict:
    cells_lib.check_one_backbone(OUT / "cells")  # a study's cells share one backbone (_study_cells)
    rates = choice()
    out: dict = {"rates": rates, "probe": {}, "seeds": {}, "mixed": {}, "budget": str(CONFIG.relative_to(ROOT))}
    for m in RATES:
        out["probe"][m] = {f"{lr:g}": json.loads(cell_path(label(m, lr, PROBE_ALPHA, 0)).read_text()).get("val_last")
                           for lr in RATES[m] if cell_path(label(m, lr, PROBE_ALPHA, 0)).exists()}
    for a in ALPHAS:
        rows = {}
        for m, lr in rates.items():
            if lr is None:
                continue
            cells = [json.loads(cell_path(label(m, lr, a, s)).read_text()) for s in SEEDS if cell_path(label(m, lr, a, s)).exists()]
            if not cells:
                continue
            rows[m] = {"lr": lr, "seeds": [c["seed"] for c in cells], "test": [c["test_last"] for c in cells],
                       "mean": statistics.fmean(c["test_last"] for c in cells),
                       "bytes_up_round": statistics.fmean(c["bytes_up_total"] for c in cells) / len(cells[0]["rounds"]),
                       "bytes_down_round": statistics.fmean(c["bytes_down_total"] for c in cells) / len(cells[0]["rounds"])}
        ref = rows.get("fedgalore")
        for m, r in rows.items():
            if ref and m != "fedgalore":
                common = [s for s in r["seeds"] if s in ref["seeds"]]
                r["vs_fedgalore"] = cells_lib.paired([r["test"][r["seeds"].index(s)] for s in common],
                                           [ref["test"][ref["seeds"].index(s)] for s in common])
        out["seeds"][f"{a:g}"] = rows
    for m in MIXED_METHODS:
        lr = rates.get(m)
        if lr is None:
            continue
        mix = {s: json.loads(cell_path(label(m, lr, PROBE_ALPHA, s, True)).read_text()) for s in SEEDS
               if cell_path(label(m, lr, PROBE_ALPHA, s, True)).exists()}
        one = {s: json.loads(cell_path(label(m, lr, PROBE_ALPHA, s)).read_text()) for s in SEEDS
               if cell_path(label(m, lr, PROBE_ALPHA, s)).exists()}
        common = sorted(set(mix) & set(one))
        if not common:
            continue
        tier_up = {}
        for t, (lo, hi) in zip(TIERS, ((0, 16), (16, 33), (33, 50))):
            vals = [v for s in common for c, v in mix[s]["up_mean_by_client"].items() if lo <= int(c) < hi]
            tier_up[str(t["rank"])] = statistics.fmean(vals) if vals else None
        out["mixed"][m] = {"lr": lr, "seeds": common, "mixed_test": [mix[s]["test_last"] for s in common],
                           "uniform_test": [one[s]["test_last"] for s in common],
                           "mixed_minus_uniform": cells_lib.paired([mix[s]["test_last"] for s in common], [one[s]["test_last"] for s in common]),
                           "up_per_client_round_by_tier": tier_up,
                           "uniform_up_per_client_round": statistics.fmean(
                               v for s in common for v in one[s]["up_mean_by_client"].values()),
                           "mixed_bytes_down_round": statistics.fmean(mix[s]["bytes_down_total"] / len(mix[s]["rounds"]) for s in common),
                           "uniform_bytes_down_round": statistics.fmean(one[s]["bytes_down_total"] / len(one[s]["rounds"]) for s in common)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "site_ranks.json").write_text(json.dumps(out, indent=1))
    (OUT / "site_ranks.md").write_text(markdown(out))
    print(markdown(out))
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _kib(x: float | None) -> str:
    return "–" if x is None else f"{x / 1024:.0f}"


def markdown(r: dict) -> str:
    lines = [f"# Federated LoRA methods and sites at different ranks ({r['budget']}, validation 10 %)", "",
             "Rates chosen on seed 0, α = 0.3, by validation accuracy (mean of the last two evaluations); used unchanged at α = 0.1.",
             "", "| method | rate | probe validation accuracy by rate |", "|---|---:|---|"]
    for m, lr in r["rates"].items():
        lines.append(f"| {m} | {'–' if lr is None else f'{lr:g}'} | " + ", ".join(f"{k}: {_pct(v)}" for k, v in r["probe"].get(m, {}).items()) + " |")
    for a, rows in r["seeds"].items():
        lines += ["", f"## Dirichlet α = {a}: test accuracy, seeds {', '.join(map(str, SEEDS))} (held out)", "",
                  "| method | test accuracy % (mean) | per seed | − FedGaLore (paired, 95 % CI) | up KiB / round | down KiB / round |",
                  "|---|---:|---|---:|---:|---:|"]
        for m, row in sorted(rows.items(), key=lambda kv: -kv[1]["mean"]):
            vs = row.get("vs_fedgalore")
            ci = "–" if not vs else f"{100 * vs['mean']:+.1f} [{100 * vs['lo']:+.1f}, {100 * vs['hi']:+.1f}]"
            lines.append(f"| {m} | {_pct(row['mean'])} | {', '.join(_pct(x) for x in row['test'])} | {ci} | "
                         f"{_kib(row['bytes_up_round'])} | {_kib(row['bytes_down_round'])} |")
    if r["mixed"]:
        lines += ["", "## A third of the sites at rank 2, 8 and 32 against every site at rank 8 (α = 0.3)", "",
                  "| method | mixed % | uniform % | mixed − uniform (paired, 95 % CI) | up KiB / client round: rank 2 / 8 / 32 | uniform up KiB | down KiB / round mixed / uniform |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for m, x in r["mixed"].items():
            d = x["mixed_minus_uniform"]
            tiers = " / ".join(_kib(x["up_per_client_round_by_tier"].get(k)) for k in ("2", "8", "32"))
            lines.append(f"| {m} | {_pct(statistics.fmean(x['mixed_test']))} | {_pct(statistics.fmean(x['uniform_test']))} | "
                         f"{100 * d['mean']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | {tiers} | "
                         f"{_kib(x['uniform_up_per_client_round'])} | {_kib(x['mixed_bytes_down_round'])} / {_kib(x['uniform_bytes_down_round'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["probe", "seeds", "mixed", "report"])
    ap.add_argument("--shard", default=None, help="i/n: run every n-th cell from the i-th (two processes: 0/2 and 1/2)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--alphas", default=None, help="seeds stage: comma-separated subset of the Dirichlet alphas (default: 0.3,0.1)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",") if args.methods else list(RATES)
    if args.stage == "report":
        report()
        return 0
    alphas = tuple(float(a) for a in args.alphas.split(",")) if args.alphas else ALPHAS
    cells = {"probe": lambda: probe_cells(methods), "seeds": lambda: seed_cells(methods, alphas),
             "mixed": mixed_cells}[args.stage]()
    for cell in cells_lib.shard(cells, args.shard):
        run_cell(*cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
