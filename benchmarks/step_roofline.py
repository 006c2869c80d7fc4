"""The GaLore step against this core's roofline: what "≤ 1.0× fused AdamW" takes on one CPU core.

Issue 18 set the goal from bytes alone: a normal GaLore step streams ``G`` once and ``W`` twice
(3 passes) against fused AdamW's 7, so ≈ 0.45×. But the step also runs two rank-``r`` GEMMs —
the projection ``R = G Pᵀ`` / ``Pᵀ G`` and the back-projection ``W ← d W + c U P`` / ``d W + c P U``
— of ``2 r`` flops per weight each, ``4 r = 32`` flops per weight at ``r = 8``. This benchmark
measures, on one core and cache-cold matrices (a pool larger than the last-level cache):

* the streaming floors: one read pass (``G.sum()``) and one read + write pass (``W.mul_``);
* the core's fp32 FMA peak, as a square 1024³ sgemm (MKL) reaches it;
* fused AdamW (``torch.optim.adamw.adamw(fused=True)``) on the same matrix;
* each GEMM of the step at the three shapes of the RoBERTa-base-like stack of
  ``benchmarks/optimizer_step.py`` (768 × 768 right, 3072 × 768 right, 768 × 3072 left):
  MKL (``torch.matmul`` / ``addmm_``), oneDNN (``torch.ops.mkldnn._linear_pointwise``, the
  optimizer's projection), the optimizer's own row-blocked decay + back-projection, and
  the AVX2/FMA kernels made for these skinny shapes (:mod:`fedgalore.optim.cpu_kernels`, which the
  optimizer uses since this benchmark; skipped, with the reason, where they are not available).
  The torch rows run with the kernels switched off (``cpu_kernels.disabled()``).

From these it reports, per shape and for the stack (weighted by parameter count): the GEMMs'
GF/s and fraction of peak, the best GaLore core (best projection + best back-projection) over
fused AdamW, the roofline floor ``(max(read, 2r/peak) + max(read+write, 2r/peak)) / fused AdamW``,
and the fraction of peak both GEMMs would need for the step's two big passes to match fused
AdamW (the moments, the non-finite check and the update record are ``m × r`` and come on top).

Interleaved round-robin, medians, one thread; the 1-minute load average is recorded. Writes
``benchmarks/results/step_roofline.json``. ``--quick``: fewer repetitions, smaller pool.
Usage: ``python benchmarks/step_roofline.py [--quick] [--reps N] [--rank R]``.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch is imported
    os.environ.setdefault(_var, "1")

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fedgalore.optim import cpu_kernels
from fedgalore.optim import kernels as _ga
from fedgalore.optim import plain_adamw as _plain

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [((768, 768), "right", 3), ((3072, 768), "right", 1), ((768, 3072), "left", 1)]  # per layer


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return float("nan")


def _peak_gflops(reps: int) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * 1024**3 / min(ts) / 1e9  # the best run: a peak


def _shape_cases(m: int, n: int, side: str, r: int, pool_bytes: int, gen: torch.Generator):
    """Callables for every measured piece on a pool of cache-cold ``m × n`` matrices, and the
    kernels' errors against torch (float64 reference)."""
    cnt = max(2, pool_bytes // (m * n * 4 * 2))
    gs = [torch.randn(m, n, generator=gen) for _ in range(cnt)]
    ws = [torch.randn(m, n, generator=gen) * 0.02 for _ in range(cnt)]
    ms = [torch.zeros(m, n) for _ in range(cnt)]
    vs = [torch.rand(m, n, generator=gen) * 1e-6 for _ in range(cnt)]
    i = [0]

    def nxt() -> int:
        i[0] = (i[0] + 1) % cnt
        return i[0]

    if side == "right":
        basis = torch.linalg.qr(torch.randn(n, r, generator=gen))[0].T.contiguous()  # r × n
        u = torch.randn(m, r, generator=gen)  # projected update m × r
        a, b = u, basis  # W += c a b
    else:
        basis = torch.linalg.qr(torch.randn(m, r, generator=gen))[0].contiguous()  # m × r
        u = torch.randn(r, n, generator=gen)
        a, b = basis, u
    bt = basis.T.contiguous()
    onednn = _ga.onednn_linear()
    steps = [torch.tensor(0.0) for _ in range(cnt)]
    decay = 1.0 - 1e-12
    cases = {
        "read G (G.sum)": lambda: gs[nxt()].sum(),
        "read+write W (W.mul_)": lambda: ws[nxt()].mul_(1.0),
        "fused AdamW step": lambda: (lambda k: _plain.torch_adamw(
            [ws[k]], [gs[k]], [ms[k]], [vs[k]], [], [steps[k]], fused=True, amsgrad=False, beta1=0.9, beta2=0.999,
            lr=1e-9, weight_decay=0.0, eps=1e-8, maximize=False))(nxt()),
        "project: MKL matmul": (lambda: gs[nxt()] @ bt) if side == "right" else (lambda: bt @ gs[nxt()]),
        "back-project: MKL mul_ + addmm_": lambda: ws[nxt()].mul_(decay).addmm_(a, b, alpha=1e-9),
        "back-project: torch row-blocked decay + addmm_ (optimizer before)": cpu_kernels.disabled()(
            lambda: _ga.decay_back_project(ws[nxt()], u, basis, side, decay, 1e-9)),
    }
    if onednn is not None:
        cases["project: oneDNN (optimizer before)"] = lambda: _ga.onednn_project(onednn, gs[nxt()], basis, side)
    errors: dict[str, float] = {}
    if cpu_kernels.usable(gs[0], basis):
        cases["project: AVX2 kernel (optimizer)"] = lambda: cpu_kernels.project(gs[nxt()], basis, side, bt)
        cases["back-project: AVX2 kernel (optimizer)"] = lambda: cpu_kernels.decay_back_project(ws[nxt()], u, basis, side, decay, 1e-9)
        g = gs[0]
        ref = (g.double() @ basis.double().T) if side == "right" else (basis.double().T @ g.double())
        errors["project"] = float((cpu_kernels.project(g, basis, side).double() - ref).norm() / ref.norm())
        w = ws[0].clone()
        ref_w = 0.99 * w.double() + 0.01 * (a.double() @ b.double())
        cpu_kernels.decay_back_project(w, u, basis, side, 0.99, 0.01)
        errors["decay_back_project"] = float((w.double() - ref_w).norm() / ref_w.norm())
    return cases, errors


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_roofline.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    reps = args.reps or (7 if args.quick else 31)
    pool = (48 if args.quick else 96) << 20  # bytes per shape: beyond a 32 MiB last-level cache
    r = args.rank
    t_start = time.perf_counter()
    kernels = cpu_kernels.available()
    how = "fedgalore.optim.cpu_kernels (AVX2/FMA)" if kernels else cpu_kernels.reason()
    peak = _peak_gflops(max(reps, 10))
    gen = torch.Generator().manual_seed(0)
    loads = [_load()]
    per_shape = {}
    for (m, n), side, count in SHAPES:
        cases, errors = _shape_cases(m, n, side, r, pool, gen)
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for fn in cases.values():  # warm-up
            fn(), fn()
        names = list(cases)
        for rep in range(reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                cases[name]()
                samples[name].append(time.perf_counter() - t0)
            loads.append(_load())
        med = {k: statistics.median(v) for k, v in samples.items()}
        flops = 2 * m * n * r
        fused = med["fused AdamW step"]
        proj = {k: v for k, v in med.items() if k.startswith("project:")}
        back = {k: v for k, v in med.items() if k.startswith("back-project:")}
        best_p, best_b = min(proj, key=proj.get), min(back, key=back.get)
        lib_p = min((k for k in proj if "AVX2" not in k), key=proj.get)
        lib_b = min((k for k in back if "AVX2" not in k), key=back.get)
        t_comp = flops / (peak * 1e9)  # one GEMM at the core's peak
        floor = max(med["read G (G.sum)"], t_comp) + max(med["read+write W (W.mul_)"], t_comp)
        per_shape[f"{m}x{n} {side}"] = {
            "count_per_layer": count, "params": m * n, "flops_per_gemm": flops,
            "median_s": med,
            "gflops": {k: flops / v / 1e9 for k, v in {**proj, **back}.items()},
            "fraction_of_peak": {k: flops / v / 1e9 / peak for k, v in {**proj, **back}.items()},
            "x_fused": {k: v / fused for k, v in med.items()},
            "best_projection": best_p, "best_back_projection": best_b,
            "library_core_x_fused": (proj[lib_p] + back[lib_b]) / fused,
            "best_core_x_fused": (proj[best_p] + back[best_b]) / fused,
            "roofline_floor_x_fused": floor / fused,
            "peak_fraction_needed_for_1x": 2 * t_comp / max(fused - 0.0, 1e-12),
            "kernel_errors": errors,
        }
    # the stack, weighted as the optimizer_step workload (per layer: 3 + 1 + 1 matrices)
    def stack(key: str) -> float:
        num = sum(d["count_per_layer"] * d[key] * d["median_s"]["fused AdamW step"] for d in per_shape.values())
        return num / sum(d["count_per_layer"] * d["median_s"]["fused AdamW step"] for d in per_shape.values())

    result = {
        "benchmark": "step_roofline", "quick": args.quick, "rank": r, "repetitions": reps,
        "method": ("one thread; per shape a pool of cache-cold matrices (~%d MiB); pieces interleaved round-robin "
                   "(order reversed every other repetition), medians; peak = best 1024^3 sgemm; floors: G.sum() "
                   "(one read), W.mul_ (one read + write)" % (pool >> 20)),
        "kernels": {"avx2": how if kernels else None, "skipped_because": None if kernels else how,
                    "source": str(cpu_kernels.SOURCE.relative_to(ROOT))},
        "peak_gflops_sgemm_1024": peak,
        "shapes": per_shape,
        "stack": {
            "library_core_x_fused": stack("library_core_x_fused"),
            "best_core_x_fused": stack("best_core_x_fused"),
            "roofline_floor_x_fused": stack("roofline_floor_x_fused"),
            "peak_fraction_needed_for_1x": stack("peak_fraction_needed_for_1x"),
            "note": "time-weighted over one layer (3 x 768x768, 3072x768, 768x3072); 'core' = projection + "
                    "back-projection only (the m x r moments, non-finite check and record come on top)",
        },
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}},
        "total_runtime_s": time.perf_counter() - t_start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"peak sgemm {peak:.1f} GF/s; AVX2 kernels: {how}")
    for key, d in per_shape.items():
        print(f"{key}: fused AdamW {d['median_s']['fused AdamW step'] * 1e3:.2f} ms")
        for k in d["gflops"]:
            print(f"   {k:55s} {d['median_s'][k] * 1e3:7.3f} ms {d['gflops'][k]:6.1f} GF/s "
                  f"({100 * d['fraction_of_peak'][k]:4.1f} % of peak) {d['x_fused'][k]:5.2f}x fused")
        print(f"   core (library) {d['library_core_x_fused']:.2f}x, core (best) {d['best_core_x_fused']:.2f}x, "
              f"roofline floor {d['roofline_floor_x_fused']:.2f}x, peak needed for 1x {100 * d['peak_fraction_needed_for_1x']:.0f} %")
    s = result["stack"]
    print(f"stack: core library {s['library_core_x_fused']:.2f}x, best {s['best_core_x_fused']:.2f}x, floor "
          f"{s['roofline_floor_x_fused']:.2f}x fused AdamW; both GEMMs need {100 * s['peak_fraction_needed_for_1x']:.0f} % of peak for 1x")
    print(f"load {result['machine']['load_1min']}; wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
