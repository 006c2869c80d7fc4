"""Ray backend vs sequential: round wall time, worker memory, bytes crossing process boundaries.

Workload: the offline text task (MiniLM-L6 on BBC News, ``offline_text``), FedGaLore r = 8,
K = 4 clients per round, 2 Ray workers (1 CPU each), a small local budget (``local_steps``)
so the whole benchmark takes a few minutes on a 2-core machine. If the offline assets are not
installed, falls back to ``tiny_text`` with larger sizes and says so in the JSON.

Measured in one process, the two backends interleaved round by round (order alternating) on
the same runtime, broadcast and jobs, so machine-load drift hits both alike (DESIGN §6):

* client-phase wall time of a round (``Backend.run_clients``: broadcast bytes in → uploads
  out, K = 4 clients); speed-up = sequential / Ray, median over rounds. Server-side work
  (A, S, diagnostics, evaluation) is identical for both backends and not timed here;
* resident memory of each Ray worker (RSS) and of the driver;
* bytes crossing process boundaries per round with Ray (broadcast put once in the object store
  + every upload) vs the ledger's count for the same round (broadcast once per client +
  uploads): the ledger counts the federated protocol, the backend counts transport;
* determinism: how many uploads are byte-identical between the backends.

The sequential baseline uses torch's default intra-op threads (all cores), i.e. what a user
gets without Ray; Ray workers use 1 thread each. Usage:
``python benchmarks/ray_backend.py [--rounds 3] [--steps 4]``; writes
``benchmarks/results/ray_backend.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fedgalore.engine.backends.ray import RayBackend, _rss_bytes
from fedgalore.engine.backends.sequential import SequentialBackend
from fedgalore.job.config import FederatedConfig
from fedgalore.engine.runtime import ClientJob, Runtime
from fedgalore.federated.seeding import round_seed, sample_clients
from fedgalore.protocol.payload import encode
from fedgalore.protocol.state import RoundContext

OUT = Path(__file__).parent / "results" / "ray_backend.json"


def make_cfg(task: dict, rounds: int, steps: int, out: str, backend: dict) -> FederatedConfig:
    return FederatedConfig.from_dict({
        "name": "bench_ray",
        "seed": 0,
        "task": task,
        "method": {"name": "fedgalore", "rank": 8,
                   "options": {"update_proj_gap": 200, "scale": 0.25, "projector": "rsvd_then_random",
                               "adaptive_proj_steps": 1, "sync": "ajive"}},
        "federation": {"num_clients": 8, "clients_per_round": 4, "rounds": rounds,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 10}},
        "train": {"lr": 5e-5, "batch_size": 16, "local_steps": steps},
        "backend": backend,
        "output": {"dir": out, "progress": "quiet"},
        "diagnostics": True,
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="local steps per client per round")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--task", default="offline_text", choices=["offline_text", "tiny_text"])
    args = ap.parse_args()

    task = {"name": "offline_text", "options": {"max_length": 64, "limit": 480}}
    note = ""
    if args.task == "offline_text":
        try:
            from fedgalore.tasks.assets import bbc_news_dir, minilm_path

            bbc_news_dir(), minilm_path()
        except Exception as exc:  # assets missing
            note = f"offline_text unavailable ({exc}); used tiny_text with larger sizes"
            args.task = "tiny_text"
    if args.task == "tiny_text":
        task = {"name": "tiny_text", "options": {"n_train": 2000, "n_test": 400}}

    cfg = make_cfg(task, args.rounds, args.steps, "unused", {"name": "sequential", "options": {}})
    rt = Runtime(cfg)
    seq = SequentialBackend()
    seq.start(rt)
    t0 = time.perf_counter()
    ray_b = RayBackend(num_workers=args.workers, num_cpus=1)
    ray_b.start(rt)
    ray_setup = time.perf_counter() - t0
    state = rt.method.init_server_state(rt.model)
    fed = cfg.federation
    rows = []
    try:
        for k in range(args.rounds):
            clients = sample_clients(cfg.seed, k, fed.num_clients, fed.clients_per_round)
            sizes = [len(rt.parts[c]) for c in clients]
            seed_k = round_seed(cfg.seed, k)
            rctx = RoundContext(k, fed.rounds, seed_k, clients, [n / sum(sizes) for n in sizes])
            blob = encode(rt.method.broadcast(state, rctx))
            jobs = [ClientJob(k, fed.rounds, c, seed_k) for c in clients]
            order = [("seq", seq), ("ray", ray_b)] if k % 2 == 0 else [("ray", ray_b), ("seq", seq)]
            times, out = {}, {}
            for name, b in order:
                t = time.perf_counter()
                out[name] = b.run_clients(blob, jobs)
                times[name] = time.perf_counter() - t
            assert all(r.error is None for rs in out.values() for r in rs), [r.error for rs in out.values() for r in rs]
            up = sum(len(r.upload) for r in out["seq"])
            rb = dict(ray_b.last_round_bytes)
            rows.append({
                "round": k + 1, "order": [n for n, _ in order],
                "seq_time_clients": times["seq"], "ray_time_clients": times["ray"],
                "ray_boundary_bytes": rb["total"], "ray_broadcast_bytes_put": rb["broadcast"], "ray_upload_bytes": rb["uploads"],
                "ledger_bytes": len(blob) * len(jobs) + up, "ledger_bytes_down": len(blob) * len(jobs), "ledger_bytes_up": up,
                "identical_uploads": sum(a.upload == b.upload for a, b in zip(out["seq"], out["ray"])),
                "worker_rss_mb": [x / 2**20 for x in ray_b.worker_rss()],
                "driver_rss_mb": _rss_bytes() / 2**20,
                "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            })
            print(f"round {k + 1}: seq {times['seq']:.1f}s, ray {times['ray']:.1f}s", flush=True)
    finally:
        ray_b.close()

    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    result = {
        "benchmark": "ray_backend",
        "task": args.task, "task_options": task["options"], "note": note,
        "workload": {"method": "fedgalore", "rank": 8, "clients_per_round": fed.clients_per_round,
                     "num_clients": fed.num_clients, "rounds": args.rounds, "local_steps": args.steps,
                     "batch_size": cfg.train.batch_size, "ray_workers": args.workers, "ray_num_cpus_per_worker": 1},
        "speedup_time_clients": med("seq_time_clients") / med("ray_time_clients"),
        "median_time_clients_s": {"sequential": med("seq_time_clients"), "ray": med("ray_time_clients")},
        "ray_setup_s": ray_setup,
        "worker_rss_mb_max": max(max(r["worker_rss_mb"]) for r in rows),
        "driver_rss_mb": rows[-1]["driver_rss_mb"],
        "boundary_vs_ledger_bytes": med("ray_boundary_bytes") / med("ledger_bytes"),
        "identical_uploads": f"{sum(r['identical_uploads'] for r in rows)}/{sum(fed.clients_per_round for _ in rows)}",
        "rounds": rows,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads_sequential": torch.get_num_threads(),
                    "ray": __import__("ray").__version__},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"task={args.task} {note}")
    print(f"{'round':>5} {'seq s':>8} {'ray s':>8} {'ray bytes':>11} {'ledger bytes':>13} {'identical':>9} {'worker RSS MB':>16}")
    for r in rows:
        print(f"{r['round']:>5} {r['seq_time_clients']:>8.1f} {r['ray_time_clients']:>8.1f} {r['ray_boundary_bytes']:>11} "
              f"{r['ledger_bytes']:>13} {r['identical_uploads']:>9} {', '.join(f'{x:.0f}' for x in r['worker_rss_mb']):>16}")
    print(f"client-phase speed-up (median) {result['speedup_time_clients']:.2f}x; boundary/ledger bytes "
          f"{result['boundary_vs_ledger_bytes']:.2f}; identical uploads {result['identical_uploads']}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
