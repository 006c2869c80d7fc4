"""Side-by-side federated runs on one pipeline: final metric, per-round curve, bytes, timings.

Usage (from the repo root)::

    python benchmarks/federated_comparison.py --config conf/pipeline/offline_text.yaml \
        --methods fedgalore,fedgalore_minus,fedavg_full --settings dirichlet:0.5 --seeds 0 \
        --name engine_offline_text [key=value ...]

Each (method, setting, seed) cell is an ordinary ``fedgalore.run`` with the same budget; cells
whose run directory is complete are reused (the script can be restarted). Writes
``benchmarks/results/<name>.json`` (+ a Markdown table next to it) with, per cell: final and
best primary metric, the per-round curve, uplink/downlink bytes per client per round, wall time
per round and the server's share of round time (aggregation + sync).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import fedgalore
from fedgalore.job.config import load_config
from fedgalore.federated.partition import parse_setting

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--settings", default="dirichlet:0.5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--name", required=True)
    ap.add_argument("--runs", default=str(ROOT / "benchmarks" / "runs"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    torch.set_flush_denormal(True)
    cells = []
    for setting in a.settings.split(","):
        for method in a.methods.split(","):
            for seed in [int(s) for s in a.seeds.split(",")]:
                cfg = load_config(a.config, list(a.overrides) + [f"method.name={method}", f"seed={seed}"])
                cfg.federation.partition = parse_setting(setting)
                cfg.output.dir = a.runs
                cfg.output.run_name = f"{a.name}/{method}__{setting.replace(':', '')}__s{seed}"
                cfg.output.progress = "plain"
                run_dir = Path(a.runs) / cfg.output.run_name
                t0 = time.perf_counter()
                if (run_dir / "summary.json").exists():
                    res = fedgalore.resume(run_dir)
                else:
                    res = fedgalore.run(cfg)
                s = res.summary
                key = f"eval/{s['primary_metric']}"
                cell = {
                    "method": method,
                    "setting": setting,
                    "seed": seed,
                    "final": s["final"],
                    "best": s["best"],
                    "curve": [(h["round"], h.get(key)) for h in res.history if key in h],
                    "bytes_up_per_client_round": s["bytes_up_per_client_round"],
                    "bytes_down_per_client_round": s["bytes_down_per_client_round"],
                    "time_per_round": s["time_per_round"],
                    "server_time_fraction": s["server_time_fraction"],
                    "server_time_per_round": statistics.mean(h["time_server"] for h in res.history),
                    "wall_time": s["wall_time"],
                    "this_invocation_s": time.perf_counter() - t0,
                }
                cells.append(cell)
                print(json.dumps({k: v for k, v in cell.items() if k != "curve"}), flush=True)
    out = {
        "config": a.config,
        "overrides": a.overrides,
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "cells": cells,
    }
    res_dir = ROOT / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    lines = ["| method | setting | seed | final | best | up B/client/round | down B/client/round | s/round | server share |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        pm = next(iter(c["final"]))
        lines.append(
            f"| {c['method']} | {c['setting']} | {c['seed']} | {c['final'].get('accuracy', c['final'][pm]):.4f} | "
            f"{c['best'].get('accuracy', 0):.4f} | {c['bytes_up_per_client_round']:.0f} | {c['bytes_down_per_client_round']:.0f} | "
            f"{c['time_per_round']:.1f} | {100 * c['server_time_fraction']:.2f}% |"
        )
    (res_dir / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
