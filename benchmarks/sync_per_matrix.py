"""The second-moment sync S per round at SmolLM2-135M's shapes: its fixed cost per matrix.

Issue 18, "round overhead": FedGaLore's server runs S once per adapted matrix per round
(:func:`fedgalore.sync.synchronize_moments`; 210 matrices at SmolLM2: 30 layers × q, k, v, o,
gate, up, down), each on ``K`` clients' rank-8 views — small LAPACK calls and Python, so its cost
is per matrix, not per byte. This benchmark times one whole round's worth of syncs, ``ajive``
mode, on synthetic views of those shapes, in four variants interleaved in one process:

* views on the round's shared seeded basis (Algorithm 1 line 13: uploads carry the seed) or on
  each client's own basis (the aligned mode's ``consensus`` views: the server builds the
  consensus basis and moves every view onto it);
* with and without the mismatch diagnostics (``diagnostics``: the run's switch reaches S through
  :class:`fedgalore.protocol.state.RoundContext`);
* one matrix at a time (:func:`~fedgalore.sync.synchronize_moments`, the reference) or the round's
  matrices together (:func:`~fedgalore.sync.synchronize_moments_many`: same-shape matrices batched,
  FedGaLore's default ``sync_batched: true``).

The views' moments are non-negative and of rank 3–8 per client (drawn), as a real round's are
after the move onto the consensus basis (most views of a SmolLM2 round have numerical rank
below r = 8, so AJIVE lowers ranks and drops joint components matrix by matrix).

Medians over repetitions, one thread, the load average recorded. Writes
``benchmarks/results/sync_per_matrix.json``. ``--clients K`` (default 2, as
``round_overhead.py``), ``--reps N``.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from fedgalore.protocol.payload import MomentView
from fedgalore.sync import synchronize_moments, synchronize_moments_many

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M: hidden 576, 9 query / 3 key-value heads of 64, intermediate 1536, 30 layers
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
RANK = 8


def _views(shared: bool, clients: int, gen: torch.Generator) -> list[list[MomentView]]:
    out = []
    for j, (m, n) in enumerate(LAYER * 30):
        side = "right" if m >= n else "left"
        per = []
        for _ in range(clients):
            k = int(torch.randint(3, RANK + 1, (1,), generator=gen))
            rows, cols = (m, RANK) if side == "right" else (RANK, n)
            mom = torch.rand(rows, k, generator=gen) @ torch.rand(k, cols, generator=gen)
            weight = torch.rand(RANK, generator=gen) + 0.5
            if shared:
                per.append(MomentView(mom, side, (m, n), None, 1000 + j, weight))
            else:
                q = torch.linalg.qr(torch.randn((n, RANK) if side == "right" else (m, RANK), generator=gen))[0]
                per.append(MomentView(mom, side, (m, n), q.T.contiguous() if side == "right" else q.contiguous(), None, weight))
        out.append(per)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sync_per_matrix.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weights = [1.0 / args.clients] * args.clients
    views = {"seeded": _views(True, args.clients, gen), "own bases": _views(False, args.clients, gen)}
    cases = {f"{basis}, diagnostics {'on' if diag else 'off'}, {path}": (basis, diag, path)
             for basis in views for diag in (True, False) for path in ("per matrix", "batched")}

    def one_round(basis: str, diag: bool, path: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # rank-r views: AJIVE lowers ranks, expected
            if path == "batched":
                synchronize_moments_many(views[basis], weights, "ajive", joint_rank=RANK, seeds=range(len(views[basis])),
                                         diagnostics=diag)
                return
            for j, per in enumerate(views[basis]):
                synchronize_moments(per, weights, "ajive", joint_rank=RANK, seed=j, diagnostics=diag)

    for case in cases.values():  # warm-up (also fills the seeded-basis cache, as a run does)
        one_round(*case)
    samples: dict[str, list[float]] = {k: [] for k in cases}
    loads = []
    names = list(cases)
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            one_round(*cases[name])
            samples[name].append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    matrices = len(LAYER) * 30
    result = {
        "benchmark": "sync_per_matrix", "clients": args.clients, "rank": RANK, "matrices": matrices,
        "shapes_per_layer": LAYER, "repetitions": args.reps, "mode": "ajive, joint rank = r",
        "median_s_per_round": {k: statistics.median(v) for k, v in samples.items()},
        "ms_per_matrix": {k: 1e3 * statistics.median(v) / matrices for k, v in samples.items()},
        "batched_speedup": {k.replace(", batched", ""): statistics.median(samples[k.replace("batched", "per matrix")]) / statistics.median(v)
                            for k, v in samples.items() if k.endswith("batched")},
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k in names:
        print(f"{k:46s} {result['median_s_per_round'][k]:.3f} s per round  {result['ms_per_matrix'][k]:.2f} ms per matrix")
    for k, v in result["batched_speedup"].items():
        print(f"batched vs per matrix, {k}: {v:.2f}x")
    print(f"load {result['machine']['load_1min']}; wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
