"""Issue 33: does a synchronised second moment make any coordinate step larger than a cold start?

For every client, round and step the optimizer tracks ``|U| / |U_cold|`` on every coordinate
(``track_cold``; the first moments are shared, so it is the ratio of the denominators
``sqrt(v̂_cold) + eps`` over ``sqrt(v̂) + eps``). This runs a small federation (the ``tiny_text``
task: 12 clients, Dirichlet 0.3, 4 per round, 8 rounds, two local epochs, rank 4, τ = 2 so that
refreshes move the state in-round, lr 1e-2) for the FedGaLore protocols and reports, per round, the worst
client's maximum and 99th percentile of the ratio and the mean share of entries above 1:

* ``aligned`` — the default (evidence, squared moves, cold cap on);
* ``aligned_uncapped`` — the same without the cold cap (``cold_cap: false``): what the aligned
  mode did before issue 33 apart from the evidence-weighted pooling;
* ``paper`` — Algorithm 1 as written (raw buffer, linear re-projection + clamp, AdamW's
  correction restarting with the round).

The toy does not learn in 8 rounds at this heterogeneity (every variant, and FedAvg-Full, stays
near chance): it probes the optimizer's state, not accuracy.

Usage: ``python benchmarks/step_inflation.py [--rounds 8] [--out benchmarks/results/step_inflation.json]``
(about a minute on one core). Single-threaded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
#: the client rate (FedGaLore's scale 0.25 makes its steps a quarter of AdamW's at the same rate)
LR = 1e-2
VARIANTS = {
    "aligned": {"moment_protocol": "aligned"},
    "aligned_uncapped": {"moment_protocol": "aligned", "cold_cap": False},
    "paper": {"moment_protocol": "paper"},
}


def run(rounds: int, out_dir: Path) -> dict:
    import fedgalore
    from fedgalore.job.config import FederatedConfig

    result: dict = {"budget": None, "variants": {}}
    for label, opts in VARIANTS.items():
        d = {
            "name": f"inflation-{label}", "seed": 0,
            "task": {"name": "tiny_text", "options": {"n_train": 384, "n_test": 128}},
            "method": {"name": "fedgalore", "rank": 4, "options": {"update_proj_gap": 2, **opts}},
            "federation": {"num_clients": 12, "clients_per_round": 4, "rounds": rounds, "eval_every": rounds,
                           "partition": {"kind": "dirichlet", "alpha": 0.3, "min_size": 5}},
            "train": {"lr": LR, "batch_size": 16, "local_epochs": 2, "weight_decay": 0.01},
            "output": {"dir": str(out_dir), "progress": "quiet", "checkpoint_every": rounds},
        }
        result["budget"] = {k: d[k] for k in ("task", "federation", "train")} | {"rank": 4, "update_proj_gap": 2}
        res = fedgalore.run(FederatedConfig.from_dict(d))
        diag = [json.loads(line) for line in (res.run_dir / "diagnostics.jsonl").read_text().splitlines() if line.strip()]
        rows = [{"round": i + 1, **{k: r.get(k) for k in ("update_ratio_max", "update_ratio_p99", "update_ratio_above",
                                                          "update_norm_vs_cold", "prior_retained", "warm_clamped")}}
                for i, r in enumerate(diag)]
        later = [r for r in rows[1:] if r["update_ratio_max"] is not None]
        result["variants"][label] = {
            "options": opts, "rounds": rows, "final": res.summary.get("final", {}),
            "rounds_2_on": {
                "max": max(r["update_ratio_max"] for r in later),
                "median_of_round_max": statistics.median(r["update_ratio_max"] for r in later),
                "max_p99": max(r["update_ratio_p99"] for r in later),
                "mean_share_above_1": statistics.mean(r["update_ratio_above"] for r in later),
            } if later else None,
        }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_inflation.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(a.rounds, Path(tmp))
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'variant':<18} {'max |U|/|U_cold|':>17} {'median round max':>17} {'max p99':>8} {'share > 1':>10} {'test acc':>9}")
    for label, v in result["variants"].items():
        s = v["rounds_2_on"]
        print(f"{label:<18} {s['max']:>17.3f} {s['median_of_round_max']:>17.3f} {s['max_p99']:>8.3f} "
              f"{s['mean_share_above_1']:>10.3f} {100 * v['final'].get('accuracy', float('nan')):>8.1f}%")
    print(f"(rounds 2-{a.rounds}: the rounds with a synchronised state; written to {a.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
