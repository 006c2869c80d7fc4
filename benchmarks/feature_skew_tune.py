"""Feature skew through ``fedgalore tune``: do the rates (and ranks) our grids fixed by hand survive
a search, and does the verdict of RESULTS §12 survive once the rank is chosen rather than fixed?

Task and split: ``conf/pipeline/offline_vision_domains.yaml`` on the ``domain_label`` split (a
Dirichlet(0.1) over (domain, class) pairs: label and feature skew together), M = 50, K = 5, E = 2,
R = 20 rounds, 10 % of the training pool held out for validation; the objective is the mean
validation accuracy after rounds 15 and 20 (``eval_every: 5``, ``--last 2``: the committed grid's
criterion), seed 0. Rows: FedGaLore, FedGaLore⁻, FedIT, FlexLoRA, FedAvg-Full.

Stages (each is ``fedgalore tune`` into ``benchmarks/runs/feature_skew_tune/<stage>``; its report,
plots and held-out cells are copied to ``benchmarks/results/feature_skew_tune/<stage>/``, and
copied back before a re-run, so the confirmation resumes from committed cells; the search's SQLite
file is not committed: on a fresh machine a stage's search runs again)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_tune.py grid        # the full rate grid, rank 8, no pruning
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_tune.py rate        # the same grid, pruned (median)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_tune.py rank        # rate and rank {8,16,32}, TPE; held-out seeds 1-4 at 20 and 50 rounds
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_skew_tune.py sync_check  # FedGaLore⁻ at FedGaLore's tuned rate and rank
    .venv/bin/python benchmarks/feature_skew_tune.py report                        # summary.{json,md}

``--workers N`` (default 2) runs N tune workers. ``grid`` and ``rate`` search the
rates of the committed feature-skew grid (``feature_skew_study.py``'s, rank 8) with the grid
sampler, row by row, the config's rate (1e-3) first where the row's grid has it, else the row's
first rate; ``rank`` searches the learning rate over two decades around the row's rate
(``fedgalore.tune.space.METHOD_RATES``) and, for the four low-rank rows, ``method.rank`` in
{8, 16, 32}, 8 trials per row (TPE), then confirms each row's best on seeds 1–4 at 20 and 50 rounds
(``--close 0``: the best only).
"""
# fedgalore-bench: not-in-all (a long study with stages; run it by name)
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "pipeline" / "offline_vision_domains.yaml"
RUNS = ROOT / "benchmarks" / "runs" / "feature_skew_tune"  # tune folders with run directories: never committed
OUT = ROOT / "benchmarks" / "results" / "feature_skew_tune"
ROWS = ("fedgalore", "fedgalore_minus", "fedit", "flexlora", "fedavg_full")
LOW_RANK = ("fedgalore", "fedgalore_minus", "fedit", "flexlora")
#: the committed grid's rates per row (benchmarks/feature_skew_study.py VARIANTS)
GRID = {"fedavg_full": [3e-4, 1e-3, 3e-3], "fedit": [1e-3, 3e-3, 1e-2], "fedgalore": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2],
        "fedgalore_minus": [1e-3, 3e-3, 1e-2, 3e-2], "flexlora": [1e-3, 3e-3, 1e-2]}
#: the committed grid's choice on domain_label (RESULTS §12, seed 0 validation, the unpinned backbone)
COMMITTED = {"fedavg_full": 1e-3, "fedit": 3e-3, "fedgalore": 1e-2, "fedgalore_minus": 1e-2, "flexlora": 3e-3}
SPLIT = ["federation.partition.kind=dirichlet", "federation.partition.alpha=0.1", "federation.partition.by=domain_label",
         "federation.partition.min_size=1", "federation.partition.max_retries=1000", "federation.validation_fraction=0.1"]
KEEP = ("tune_report.json", "tune_report.md", "tune_search.png", "tune_history.png", "tune_heldout.png")


def _grid_space() -> list[str]:
    return [f"--space={row}:train.lr=choice:" + ",".join(f"{r:g}" for r in rates) for row, rates in GRID.items()]


def stage_args(stage: str, workers: int) -> list[str]:
    """The ``fedgalore tune`` arguments of a stage."""
    common = ["tune", "--config", str(CONFIG), "--methods", ",".join(ROWS), "--last", "2", "--workers", str(workers),
              "--out", str(RUNS / stage)]
    if stage in ("grid", "rate"):
        pruner = {"grid": "none", "rate": "median"}[stage]
        return common + ["--sampler", "grid", "--pruner", pruner, "--trials", "5", "--no-confirm", "--no-widen", *_grid_space(), *SPLIT]
    if stage == "rank":
        return common + ["--sampler", "tpe", "--pruner", "median", "--trials", "8", f"--space={','.join(LOW_RANK)}:method.rank=choice:8,16,32",
                         "--heldout-seeds", "1,2,3,4", "--confirm-rounds", "20,50", "--close", "0", *SPLIT]
    if stage == "sync_check":  # the sync on and off at one configuration: FedGaLore's tuned one
        rank = _search("rank")
        best = next(r for r in rank["search"] if r["label"] == "fedgalore")["best_params"]
        return ["tune", "--config", str(CONFIG), "--methods", "fedgalore_minus", "--workers", str(workers), "--out", str(RUNS / stage),
                "--sampler", "grid", "--trials", "1", "--last", "2", f"--space=train.lr=choice:{best['train.lr']!r}",
                f"--space=method.rank=choice:{best['method.rank']}", "--heldout-seeds", "1,2,3,4", "--confirm-rounds", "20,50", *SPLIT]
    raise SystemExit(f"unknown stage {stage!r}")


def run_stage(stage: str, workers: int) -> None:
    out, res = RUNS / stage, OUT / stage
    if (res / "cells").is_dir():  # resume the confirmation from committed cells
        (out / "cells").mkdir(parents=True, exist_ok=True)
        for f in (res / "cells").glob("*.json"):
            if not (out / "cells" / f.name).exists():
                shutil.copy2(f, out / "cells" / f.name)
    cmd = [sys.executable, "-m", "fedgalore.cli", *stage_args(stage, workers)]
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    res.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (out / name).is_file():
            shutil.copy2(out / name, res / name)
    if (out / "cells").is_dir():
        (res / "cells").mkdir(exist_ok=True)
        for f in (out / "cells").glob("*.json"):
            shutil.copy2(f, res / "cells" / f.name)


def _paired(a: list[float], b: list[float]) -> dict:
    """Mean of a − b over paired seeds with its 95 % t interval (fedgalore.tune.confirm.paired)."""
    from fedgalore.tune.confirm import paired

    return paired(a, b)


def _search(stage: str) -> dict | None:
    path = OUT / stage / "tune_report.json"
    return json.loads(path.read_text()) if path.is_file() else None


def report() -> None:
    """summary.{json,md}: the pruned searches against the full grid (choice, validation,
    client-rounds), and the rank stage's held-out verdict."""
    grid = _search("grid")
    doc: dict = {"committed_choice": COMMITTED, "stages": {}}
    lines = ["# Feature skew through fedgalore tune (`domain_label`)", ""]
    full = {s["label"]: s for s in grid["search"]} if grid else {}
    for stage in ("grid", "rate"):
        d = _search(stage)
        if d is None:
            continue
        rows = []
        for s in d["search"]:
            ref = full.get(s["label"])
            rows.append({"row": s["label"], "choice": (s["best_params"] or {}).get("train.lr"), "value": s["best_value"],
                         "grid_choice": (ref["best_params"] or {}).get("train.lr") if ref else None,
                         "grid_value": ref["best_value"] if ref else None, "committed": COMMITTED.get(s["label"]),
                         "client_rounds": s["client_rounds"], "grid_client_rounds": ref["client_rounds"] if ref else None,
                         "finished": s["finished"], "pruned": s["pruned"]})
        total = sum(r["client_rounds"] for r in rows)
        gtotal = sum(r["grid_client_rounds"] or 0 for r in rows)
        doc["stages"][stage] = {"rows": rows, "client_rounds": total, "grid_client_rounds": gtotal,
                                "share": total / gtotal if gtotal else None, "wall_s": d["tuning_cost"]["wall_s"]}
        lines += [f"## {stage}: {total} client-rounds ({100 * total / gtotal:.0f} % of the full grid's {gtotal})" if gtotal else f"## {stage}", "",
                  "| row | chosen rate | validation | full grid's choice | its validation | committed (unpinned backbone) | finished / pruned | client-rounds |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['row']} | {r['choice']:g} | {r['value']:.4f} | {r['grid_choice'] if r['grid_choice'] is None else format(r['grid_choice'], 'g')} | "
                         f"{'–' if r['grid_value'] is None else format(r['grid_value'], '.4f')} | {r['committed']:g} | "
                         f"{r['finished']} / {r['pruned']} | {r['client_rounds']} |")
        lines.append("")
    rank = _search("rank")
    if rank is not None:
        doc["rank"] = {"search": [{k: s[k] for k in ("label", "best_params", "best_value", "client_rounds", "client_rounds_unpruned",
                                                     "finished", "pruned", "at_edge", "widened")} for s in rank["search"]],
                       "tuning_cost": rank["tuning_cost"], "heldout": []}
        t = rank["tuning_cost"]
        lines += [f"## rank: search {t['client_rounds']} client-rounds ({100 * t['client_rounds'] / t['client_rounds_unpruned']:.0f} % of "
                  f"{t['client_rounds_unpruned']} unpruned), {t['wall_s']:.0f} s of trial time", "",
                  "| row | chosen | validation | finished / pruned | client-rounds |", "|---|---|---:|---:|---:|"]
        for s in rank["search"]:
            chosen = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in (s["best_params"] or {}).items())
            lines.append(f"| {s['label']} | {chosen} | {s['best_value']:.4f} | {s['finished']} / {s['pruned']} | {s['client_rounds']} |")
        lines.append("")
        for h in rank["heldout"]:
            if not h["rows"]:
                continue
            by = {r["label"]: r for r in h["rows"] if r["role"] == "best"}
            refs = [x for x in ("fedgalore", "fedgalore_minus") if x in by]
            lines += [f"### held-out seeds {', '.join(map(str, h['seeds']))}, {h['rounds']} rounds", "",
                      "| row | rate, rank | rank / width | test % | per seed | − " + " | − ".join(refs)
                      + " | up / down KiB per client-round | up vs dense | client memory MiB |",
                      "|---|---|---:|---:|---|" + "---:|" * len(refs) + "---:|---:|---:|"]
            table = []
            for r in h["rows"]:
                if r["role"] != "best":
                    continue
                diffs = []
                for ref in refs:
                    if ref == r["label"]:
                        diffs.append("–")
                        continue
                    d = _paired([100 * v for v in r["per_seed"]], [100 * v for v in by[ref]["per_seed"]])
                    diffs.append(f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]")
                lr = r["params"].get("train.lr")
                rk = r["params"].get("method.rank", r.get("rank"))
                rw = f"{r['rank']} / {r['width']}" if r.get("rank") and r.get("width") and "method.rank" in r["params"] else "–"
                ratio = r.get("up_vs_dense")
                lines.append(f"| {r['label']} | {lr:.2g}, {rk if 'method.rank' in r['params'] else '–'} | {rw} | {100 * r['mean']:.1f} | "
                             f"{', '.join(f'{100 * v:.1f}' for v in r['per_seed'])} | {' | '.join(diffs)} | "
                             f"{r['bytes_up_per_client_round'] / 1024:.0f} / {r['bytes_down_per_client_round'] / 1024:.0f} | "
                             f"{'–' if ratio is None else f'{ratio:.2f}×'} | {r['client_training_bytes'] / 2 ** 20:.2f} |")
                table.append({**{k: r[k] for k in ("label", "params", "mean", "per_seed", "rank", "width", "bytes_up_per_client_round",
                                                   "bytes_down_per_client_round", "up_vs_dense", "client_training_bytes")}, "diffs": diffs})
            doc["rank"]["heldout"].append({"rounds": h["rounds"], "seeds": h["seeds"], "rows": table})
            lines.append("")
    sync = _search("sync_check")
    if sync is not None and rank is not None:
        lines += ["## sync_check: FedGaLore⁻ at FedGaLore's tuned rate and rank (the sync on / off, nothing else changed)", "",
                  "| rounds | FedGaLore⁻ test % | per seed | − FedGaLore (sync on) | − FlexLoRA | − FedAvg-Full | up / down KiB |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        doc["sync_check"] = []
        for h in sync["heldout"]:
            if not h["rows"]:
                continue
            r = h["rows"][0]
            ref = next(x for x in rank["heldout"] if x["rounds"] == h["rounds"])
            by = {x["label"]: x for x in ref["rows"] if x["role"] == "best"}
            diffs = {lab: _paired([100 * v for v in r["per_seed"]], [100 * v for v in by[lab]["per_seed"]])
                     for lab in ("fedgalore", "flexlora", "fedavg_full")}
            doc["sync_check"].append({"rounds": h["rounds"], "mean": r["mean"], "per_seed": r["per_seed"], "paired": diffs,
                                      "bytes_up_per_client_round": r["bytes_up_per_client_round"],
                                      "bytes_down_per_client_round": r["bytes_down_per_client_round"]})
            lines.append(f"| {h['rounds']} | {100 * r['mean']:.1f} | {', '.join(f'{100 * v:.1f}' for v in r['per_seed'])} | "
                         + " | ".join(f"{d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]" for d in diffs.values())
                         + f" | {r['bytes_up_per_client_round'] / 1024:.0f} / {r['bytes_down_per_client_round'] / 1024:.0f} |")
        lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (OUT / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("grid", "rate", "rank", "sync_check", "report"))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    if args.stage == "report":
        report()
    else:
        run_stage(args.stage, args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
