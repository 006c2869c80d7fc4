"""Record-level DP-SGD at each site: accuracy and ε(δ) against no DP (issue 41, part 1).

On ``tiny_text`` (a random-weight 2-layer BERT on a learnable synthetic task; CPU, nothing to
download): 8 sites (IID split of 960 training examples, 120 each), 4 sampled per round, 10
rounds of one local epoch of batch 16 (Poisson-sampled under DP: q = 16/120, 8 steps per
round), rank 4, each method at one learning rate (FedGaLore 1e-2, FedIT 1e-2; not tuned
under DP). Cells: no DP, and ``privacy.record`` with C = 1 and σ ∈ {0 (clipping and Poisson
sampling only, no noise: ε = ∞, to separate the cost of clipping from that of the noise), 1.0,
0.5}, δ = 1e-5, RDP accountant, for FedGaLore and FedIT, seeds 0–2. Per cell: the final test accuracy (mean ± std
over seeds) and ε — the largest over the sites that trained (each site's ε over all its steps
in all rounds it took part in, from privacy.json) — and the run's wall time.

``--large``: the same federation with 10× the examples per site (9,600 training examples, 1,200
per site) and 8× the batch (128; q = 0.107, 10 steps per round), seed 0, σ ∈ {0, 1.0, 0.5, 0.3}:
the noise per coordinate, σ·C/(q·n), is 8× smaller — where record-level DP starts to pay.

Single-threaded (``torch.set_num_threads(1)``; run it with ``OMP_NUM_THREADS=1``). Writes
``benchmarks/results/dp_record.json`` (``dp_record_large.json``) and prints a Markdown table.
``--quick``: seed 0 only.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_record.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_record.py --large
"""
# fedgalore-bench: not-in-all (about 5 min single-threaded; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LR = {"fedgalore": 1e-2, "fedit": 1e-2}
SIGMAS = [None, 0.0, 1.0, 0.5]  # none, clipping only (σ = 0: ε = ∞), the two noise levels


def config(method: str, sigma: float | None, seed: int, out: Path, large: bool = False):
    from fedgalore.job.config import FederatedConfig

    d = {
        "name": "dp", "seed": seed,
        "task": {"name": "tiny_text", "options": {"n_train": 9600 if large else 960, "n_test": 256}},
        "method": {"name": method, "rank": 4},
        "federation": {"num_clients": 8, "clients_per_round": 4, "rounds": 10, "partition": {"kind": "iid"}},
        "train": {"lr": LR[method], "batch_size": 128 if large else 16, "local_epochs": 1, "weight_decay": 0.0},
        "output": {"dir": str(out), "progress": "quiet", "checkpoint_every": 10},
        "diagnostics": False,
    }
    if sigma is not None:
        # a study: seeded noise (privacy.reproducible; same distribution as the default OS entropy, reruns bit for bit)
        d["privacy"] = {"record": {"max_grad_norm": 1.0, "noise_multiplier": sigma, "delta": 1e-5}, "reproducible": True}
    return FederatedConfig.from_dict(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seed 0 only")
    ap.add_argument("--large", action="store_true", help="10x the examples per site, batch 128, σ also 0.3, seed 0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import fedgalore

    torch.set_num_threads(1)
    out_file = args.out or str(ROOT / "benchmarks" / "results" / ("dp_record_large.json" if args.large else "dp_record.json"))
    seeds = [0] if args.quick or args.large else [0, 1, 2]
    sigmas = SIGMAS + [0.3] if args.large else SIGMAS
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in LR:
            for sigma in sigmas:
                accs, eps, walls = [], [], []
                for seed in seeds:
                    t0 = time.perf_counter()
                    res = fedgalore.run(config(method, sigma, seed, Path(tmp) / f"{method}-{sigma}-{seed}", args.large))
                    walls.append(time.perf_counter() - t0)
                    accs.append(float(res.summary["final"]["accuracy"]))
                    doc = json.loads((res.run_dir / "privacy.json").read_text())
                    eps.append(float(doc["epsilon_max"]) if doc["protected"] else float("inf"))
                cell = {"method": method, "noise_multiplier": sigma, "seeds": seeds, "accuracy": accs,
                        "accuracy_mean": statistics.mean(accs),
                        "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                        "epsilon_max": eps, "wall_s": walls, "load_avg": os.getloadavg()}
                cells.append(cell)
                print(f"{method} σ={sigma}: acc {cell['accuracy_mean']:.3f} ± {cell['accuracy_std']:.3f}, "
                      f"ε {max(eps):.3g}, {statistics.mean(walls):.1f} s/run", flush=True)
    out = {"benchmark": "dp_record", "torch": torch.__version__, "platform": platform.platform(),
           "threads": torch.get_num_threads(), "cells": cells,
           "setting": ("tiny_text 9600/256, 8 IID sites (1200 each), batch 128" if args.large else
                       "tiny_text 960/256, 8 IID sites (120 each), batch 16")
           + ", 4 sites per round, 10 rounds, E=1, rank 4, C=1, δ=1e-5, RDP"}
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    Path(out_file).write_text(json.dumps(out, indent=1))
    print("\n| method | DP | accuracy (mean ± std) | ε (max over sites; per seed) | s / run |")
    print("|---|---|---:|---:|---:|")
    for c in cells:
        dp = "none" if c["noise_multiplier"] is None else f"σ = {c['noise_multiplier']:g}, C = 1"
        e = ("∞ (no DP)" if c["noise_multiplier"] is None else "∞ (no noise)" if c["noise_multiplier"] == 0
             else ", ".join(f"{x:.2f}" for x in c["epsilon_max"]))
        print(f"| {c['method']} | {dp} | {100 * c['accuracy_mean']:.1f} ± {100 * c['accuracy_std']:.1f} | {e} | "
              f"{statistics.mean(c['wall_s']):.1f} |")
    print(f"\nwritten to {out_file}")


if __name__ == "__main__":
    main()
