"""Per-site evaluation at the cost of one pass: the global model on every site's held-out rows.

Issue 44, item 8 ("per-site evaluation dominates the round at scale": 200 sites, 10 per round,
57.8 s of a 73 s round spent evaluating). ``federation.client_eval`` evaluates the global model on
each client's held-out share every evaluation round. Three ways to do it, interleaved in one
process (variant by variant, repetition by repetition) on the same model and rows:

* ``per_site`` — before issue 44: one ``task.evaluate`` per site (batches never span sites, one
  partial batch each);
* ``one_pass`` — now (:func:`fedgalore.engine.client_eval.evaluate_clients` →
  :meth:`fedgalore.tasks.base.Task.evaluate_groups`): one batched pass over the union of the
  sites' rows, split by site afterwards;
* ``pooled`` — one ``task.evaluate`` of the same rows as one set (what the pooled test
  evaluation of that many rows costs): the reference. Target: ``one_pass`` ≤ 1.5 × ``pooled``.

Cases (``--cases``):

* ``minilm`` — MiniLM-L6 × BBC News (``offline_text``, 128 tokens), 200 sites: every training
  row of BBC News (1,780) held out as a site's share, the sites drawn by an IID split (~9 rows
  each: BBC News is too small for the issue's 250 rows per site, so the sites are smaller and the
  per-site overhead larger than in the issue);
* ``tiny`` — ``tiny_text`` with 50,000 training rows over 200 sites, the engine's own split
  (:func:`fedgalore.job.clients.split_clients`: IID, ``client_test_fraction`` 0.2 → 10,000
  held-out rows, 50 per site): the issue's row counts on a model small enough to measure quickly.

Single-threaded (``torch.set_num_threads(1)``; run with ``OMP_NUM_THREADS=1``). Every timing
carries the load average (``uptime``'s three numbers) measured just before it, and is taken twice:
wall time and this process's CPU time (``time.process_time``), which a busy machine disturbs far
less (on a 2-core machine at load 8 the wall times of one variant varied by ±40 %); the best of
the repetitions counts. The metrics of
``per_site`` and ``one_pass`` are compared (max |difference| per metric). Writes
``benchmarks/results/client_eval_pass.json``; ``--quick``: ``tiny`` only with 5,000 rows, one repetition.
"""
# fedgalore-bench: not-in-all (about 5 min single-threaded; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SITES = 200
BATCH = 64  # federation.eval_batch_size's default


def _per_site(task, model, data, parts, batch_size):
    """The evaluation before issue 44: one ``evaluate`` call per site."""
    from fedgalore.tasks.base import subset_examples

    return [task.evaluate(model, subset_examples(data, idx), batch_size) for idx in parts]


def _one_pass(task, model, data, parts, batch_size):
    from fedgalore.job.clients import Clients
    from fedgalore.engine.client_eval import evaluate_clients

    clients = Clients([np.zeros(0, np.int64)] * len(parts), np.zeros(0, np.int64), np.zeros(0), test_parts=list(parts))
    return list(evaluate_clients(task, model, data, clients, batch_size).values())


def _pooled(task, model, data, parts, batch_size):
    from fedgalore.tasks.base import subset_examples

    return [task.evaluate(model, subset_examples(data, np.concatenate(parts)), batch_size)]


VARIANTS = {"per_site": _per_site, "one_pass": _one_pass, "pooled": _pooled}


def _case(name: str, quick: bool):
    """``(task, model, data, parts, description)`` of a case."""
    from fedgalore.job.clients import split_clients
    from fedgalore.job.config import FederatedConfig
    from fedgalore.federated.partition import make_partition
    from fedgalore.tasks import get_task

    if name == "minilm":
        task = get_task("offline_text", max_length=128)
        data = task.train_set()
        cfg = FederatedConfig.from_dict({"federation": {"num_clients": SITES, "partition": {"kind": "iid"}}})
        parts = make_partition(np.asarray(task.partition_labels()), SITES, cfg.federation.partition, 0)
        what = f"offline_text (MiniLM-L6 x BBC News, 128 tokens): {len(data)} training rows as the held-out shares of {SITES} IID sites"
    else:
        n = 5_000 if quick else 50_000
        task = get_task("tiny_text", n_train=n, n_test=8)
        cfg = FederatedConfig.from_dict({
            "task": {"name": "tiny_text", "options": {"n_train": n, "n_test": 8}},
            "federation": {"num_clients": SITES, "clients_per_round": 10, "partition": {"kind": "iid"},
                           "client_eval": True, "client_test_fraction": 0.2}})
        clients = split_clients(cfg, task)
        data, parts = task.train_set(), clients.test_parts
        what = f"tiny_text: {n} training rows over {SITES} IID sites, client_test_fraction 0.2 (the engine's split)"
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    return task, task.build_model().eval(), data, parts, what


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(name: str, reps: int, quick: bool) -> dict:
    task, model, data, parts, what = _case(name, quick)
    rows = int(sum(len(p) for p in parts))
    print(f"{name}: {what}; {rows} rows, sites of {min(map(len, parts))}-{max(map(len, parts))}", flush=True)
    times: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    results: dict[str, list[dict]] = {}
    with torch.no_grad():
        VARIANTS["pooled"](task, model, data, parts[:2], BATCH)  # warm-up (allocator, first-call costs)
        for rep in range(reps):
            for v, fn in VARIANTS.items():
                load = _load()
                t0, c0 = time.perf_counter(), time.process_time()
                results[v] = fn(task, model, data, parts, BATCH)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                times[v].append({"seconds": dt, "cpu_seconds": cpu, "loadavg": load})
                print(f"  {name} rep {rep + 1}: {v:9s} {dt:8.2f} s wall, {cpu:8.2f} s CPU  (load {' '.join(map(str, load))})",
                      flush=True)
    diffs = {k: max(abs(a[k] - b[k]) for a, b in zip(results["per_site"], results["one_pass"])) for k in results["per_site"][0]}
    best = {v: min(t["seconds"] for t in ts) for v, ts in times.items()}
    cpu = {v: min(t["cpu_seconds"] for t in ts) for v, ts in times.items()}
    out = {"case": name, "what": what, "sites": len(parts), "rows": rows, "batch_size": BATCH, "repetitions": reps,
           "times": times, "best_s": best, "best_cpu_s": cpu,
           "per_site_over_pooled": best["per_site"] / best["pooled"], "one_pass_over_pooled": best["one_pass"] / best["pooled"],
           "per_site_over_pooled_cpu": cpu["per_site"] / cpu["pooled"], "one_pass_over_pooled_cpu": cpu["one_pass"] / cpu["pooled"],
           "max_abs_metric_difference_per_site_vs_one_pass": diffs}
    print(f"  {name}: CPU time per-site {cpu['per_site']:.2f} s = {out['per_site_over_pooled_cpu']:.2f}x pooled; one pass "
          f"{cpu['one_pass']:.2f} s = {out['one_pass_over_pooled_cpu']:.2f}x pooled ({cpu['pooled']:.2f} s); wall "
          f"{out['per_site_over_pooled']:.2f}x / {out['one_pass_over_pooled']:.2f}x; max |metric difference| {diffs}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=("minilm", "tiny"), default=["minilm", "tiny"])
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each variant (interleaved); the best counts")
    ap.add_argument("--quick", action="store_true", help="tiny only, 5,000 rows, one repetition")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/client_eval_pass.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = ["tiny"] if args.quick else args.cases
    reps = 1 if args.quick else args.reps
    t0, load0 = time.perf_counter(), _load()
    cells = [measure(c, reps, args.quick) for c in cases]
    res = {"meta": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": _load(), "seconds": time.perf_counter() - t0},
           "cases": cells}
    out = args.out.replace("client_eval_pass.json", "client_eval_pass_quick.json") if args.quick else args.out
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print("\n| case | sites | rows | pooled CPU s (wall) | per site, before: CPU s | ratio CPU (wall) | one pass, now: CPU s | "
          "ratio CPU (wall) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in cells:
        b, w = c["best_cpu_s"], c["best_s"]
        print(f"| {c['case']} | {c['sites']} | {c['rows']} | {b['pooled']:.2f} ({w['pooled']:.2f}) | {b['per_site']:.2f} | "
              f"{c['per_site_over_pooled_cpu']:.2f}x ({c['per_site_over_pooled']:.2f}x) | {b['one_pass']:.2f} | "
              f"{c['one_pass_over_pooled_cpu']:.2f}x ({c['one_pass_over_pooled']:.2f}x) |")
    print(f"load average {load0} -> {_load()}; {time.perf_counter() - t0:.0f} s; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
