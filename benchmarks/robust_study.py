"""One hostile site against robust aggregation (issue 42): accuracy with and without a defence.

Federation (CPU, nothing to download): ``tiny_text`` (random-weight 2-layer BERT, hidden 32, its
learnable 4-class synthetic task, 160 training examples) over 6 sites (Dirichlet α = 0.5, at least
5 examples each), every site in every round, 8 rounds of 3 local epochs, batch 16, rank 4. Site 0 is
hostile (``federation.attack``): its update ×50 (``scale``) or ×−5 (``sign_flip:5``) — for FedIT the
change of each uploaded factor from what it started with (fedgalore.engine.stages.attack).

Defences (``federation.robust``): none, ``norm_filter`` (drop ‖ΔW_i‖ > 3 × the round's median),
``krum`` (Multi-Krum, f = 1, keep 4 of 6), and for the dense FedAvg-Full the coordinate-wise
``median`` and ``trimmed_mean`` (β = 0.2: one site cut at each end of each coordinate).

Rates: FedAvg-Full 1e-2 (tiny_text's default), FedIT 5e-2 (at 1e-2 FedIT reaches only 37.5 % in 8
rounds); chosen on seed 0 by its *test* accuracy without attack (tiny_text has no separate
validation split at this size) — seeds 1–3 did not take part in any choice, and the tests'
margins (tests/engine/test_robust_federation.py) were set on seed 0 too.

Each finished run is ``benchmarks/results/robust/cells/<method>-<attack>-<defence>-s<seed>.json``
(final test accuracy and loss, the clients each round excluded); re-running skips finished cells.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/robust_study.py            # every cell, seeds 0-3
    .venv/bin/python benchmarks/robust_study.py report                      # results/robust/robust.{json,md}
"""
# fedgalore-bench: not-in-all (a study with stages; run it by name)
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "robust"
SEEDS = (0, 1, 2, 3)
RATES = {"fedavg_full": 1e-2, "fedit": 5e-2}
ATTACKS = {"none": None, "scale": {"clients": [0], "kind": "scale"},
           "sign_flip:5": {"clients": [0], "kind": "sign_flip", "factor": 5.0}}
DEFENCES = {"none": None, "norm_filter": {"kind": "norm_filter"},
            "krum": {"kind": "krum", "num_malicious": 1, "to_keep": 4},
            "median": {"kind": "median"}, "trimmed_mean": {"kind": "trimmed_mean", "beta": 0.2}}


def cells():
    for method in RATES:
        for attack in ATTACKS:
            for defence in DEFENCES:
                if attack == "none" and defence != "none":
                    continue
                if method != "fedavg_full" and defence in ("median", "trimmed_mean"):
                    continue  # coordinate-wise statistics are refused for factored uploads
                for seed in SEEDS:
                    yield method, attack, defence, seed


def config(method: str, attack: str, defence: str, seed: int, out: Path) -> dict:
    fed = {"num_clients": 6, "clients_per_round": 6, "rounds": 8, "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}}
    if ATTACKS[attack] is not None:
        fed["attack"] = ATTACKS[attack]
    if DEFENCES[defence] is not None:
        fed["robust"] = DEFENCES[defence]
    return {"name": "robust", "seed": seed, "task": {"name": "tiny_text", "options": {"n_train": 160, "n_test": 64}},
            "method": {"name": method, "rank": 4}, "federation": fed,
            "train": {"lr": RATES[method], "batch_size": 16, "local_epochs": 3, "weight_decay": 0.01},
            "output": {"dir": str(out), "progress": "quiet"}}


def run_all() -> None:
    import torch

    import fedgalore
    from fedgalore.job.config import FederatedConfig
    from fedgalore.jsonl import read_jsonl

    torch.set_num_threads(1)
    (OUT / "cells").mkdir(parents=True, exist_ok=True)
    for method, attack, defence, seed in cells():
        path = OUT / "cells" / f"{method}-{attack.replace(':', '')}-{defence}-s{seed}.json"
        if path.is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(method, attack, defence, seed, Path(tmp))
            t0 = time.perf_counter()
            res = fedgalore.run(FederatedConfig.from_dict(cfg))
            excluded = [[r["round"], r["client"]] for r in read_jsonl(res.run_dir / "clients.jsonl") if r.get("robust_excluded")]
            rec = {"method": method, "attack": attack, "defence": defence, "seed": seed,
                   "accuracy": float(res.summary["final"]["accuracy"]), "loss": float(res.summary["final"]["loss"]),
                   "excluded": excluded, "seconds": time.perf_counter() - t0, "load": os.getloadavg()[0],
                   "config": {k: v for k, v in cfg.items() if k != "output"}}
        path.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"{path.name}: accuracy {rec['accuracy']:.3f}", flush=True)


def report() -> None:
    recs = [json.loads(p.read_text()) for p in sorted((OUT / "cells").glob("*.json"))]
    rows, md = [], ["| method | attack | defence | test accuracy, seed 0 | held-out seeds 1–3 (mean ± std) | hostile site excluded (rounds, seeds 1–3) | honest sites excluded per round |",
                    "|---|---|---|---:|---:|---:|---:|"]
    for method in RATES:
        for attack in ATTACKS:
            for defence in DEFENCES:
                mine = [r for r in recs if (r["method"], r["attack"], r["defence"]) == (method, attack, defence)]
                if not mine:
                    continue
                s0 = [r["accuracy"] for r in mine if r["seed"] == 0]
                held = [r for r in mine if r["seed"] != 0]
                acc = [r["accuracy"] for r in held]
                hostile = sum(1 for r in held for rd, c in r["excluded"] if c == 0)
                honest = sum(1 for r in held for rd, c in r["excluded"] if c != 0) / max(8 * len(held), 1)
                row = {"method": method, "attack": attack, "defence": defence, "seed0": s0[0] if s0 else None,
                       "held_out_mean": statistics.mean(acc) if acc else None,
                       "held_out_std": statistics.stdev(acc) if len(acc) > 1 else 0.0, "seeds": [r["seed"] for r in held],
                       "hostile_excluded_rounds": hostile, "honest_excluded_per_round": honest}
                rows.append(row)
                md.append(f"| {method} | {attack} | {defence} | {row['seed0']:.3f} | "
                          f"{row['held_out_mean']:.3f} ± {row['held_out_std']:.3f} | "
                          f"{hostile if attack != 'none' else '–'} / {8 * len(held)} | {honest:.2f} |")
    (OUT / "robust.json").write_text(json.dumps(rows, indent=1) + "\n")
    (OUT / "robust.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", nargs="?", default="run", choices=("run", "report"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT.parent / "src"))
    run_all() if args.stage == "run" else report()
