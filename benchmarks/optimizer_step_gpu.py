"""GaLoreAdamW's step against torch AdamW(fused=True) and the official galore-torch on a CUDA GPU
(issue 18, "the GaLore step"; issue 43, the step by bucket).

The CPU benchmark (``benchmarks/optimizer_step.py``) measures the workload on one core; this one
runs the comparison where the paper trains: on the GPU, timed with CUDA events, medians over
``--reps`` steps, every variant on its own copy of the parameters with the same gradients, stepped
**interleaved** (one step of each variant per repetition). Workloads: the RoBERTa-base-like stack
(12 layers × {768², 768², 768², 3072×768, 768×3072}, r = 8, scale 0.25) and two Llama-2-7B layers
({4096² ×4, 11008×4096 ×2, 4096×11008}, r = 32). fp32 parameters and gradients, weight decay 0.01.

Variants (a "normal" step: no refresh):

* ``adamw_fused`` — ``torch.optim.AdamW(fused=True)``, the goal (issue 43: GaLore ≤ 1.0×);
* ``galore_per_matrix`` — ``bucket_gemm: per_matrix`` (the GEMMs one matrix at a time; the moments
  by bucket);
* ``galore_stacked`` — ``bucket_gemm: stacked`` (one ``bmm`` per bucket for each GEMM);
* ``galore_auto`` — ``bucket_gemm: auto`` (the default: stacked below 2^22 entries per matrix);
* ``galore_stacked_compiled`` — stacked with ``compile_moments=True`` (inductor; compiled before
  the timed steps);
* ``galore_torch`` — the official ``galore_torch.GaLoreAdamW`` when installed.

Plus a refresh step (``projector=rsvd_then_random``, a seeded-random basis every step after the
first RSVD) timed for the default variant and amortised over τ = 200:
``(refresh + 199 · normal) / 200``. Writes JSON to ``--out``.

    python benchmarks/optimizer_step_gpu.py --out benchmarks/results/optimizer_step_gpu_bucket.json

``--device cpu --tiny`` runs the same code at a small size on the CPU (wall-clock medians): the
check that the benchmark itself works before a GPU is lent.
"""
# fedgalore-bench: not-in-all (needs a CUDA GPU)
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from optimizer_step import _import_official  # galore_torch's AdamW, bitsandbytes stubbed (benchmarks/ is this script's folder)

WORKLOADS = {
    "roberta_base_like_r8": ([(768, 768)] * 3 + [(3072, 768), (768, 3072)]) * 12,
    "llama7b_2_layers_r32": ([(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]) * 2,
}
TINY = {
    "roberta_base_like_r8": ([(96, 96)] * 3 + [(384, 96), (96, 384)]) * 2,
    "llama7b_2_layers_r32": ([(256, 256)] * 4 + [(688, 256)] * 2 + [(256, 688)]) * 1,
}
RANKS = {"roberta_base_like_r8": 8, "llama7b_2_layers_r32": 32}
TAU = 200


class _Timer:
    """Milliseconds of one call: CUDA events on a GPU, wall clock on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def run(name: str, reps: int, device: str, tiny: bool) -> dict:
    from fedgalore.optim import GaLoreAdamW

    g = torch.Generator(device=device).manual_seed(0)
    shapes = (TINY if tiny else WORKLOADS)[name]
    rank = RANKS[name]
    base = [torch.randn(s, device=device, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) * 1e-3 for s in shapes]

    def params():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr
        return ps

    def galore(ps, gap, gemm, compiled=False):
        group = {"params": [(f"p{i}", p) for i, p in enumerate(ps)], "rank": rank, "update_proj_gap": gap,
                 "scale": 0.25, "proj_type": "std", "projector": "rsvd_then_random", "adaptive_proj_steps": 1,
                 "bucket_gemm": gemm}
        return GaLoreAdamW([group], lr=1e-5, weight_decay=0.01, compile_moments=compiled)

    opts = {"adamw_fused": torch.optim.AdamW(params(), lr=1e-5, weight_decay=0.01, fused=True)}
    for label, gemm, compiled in (("galore_per_matrix", "per_matrix", False), ("galore_stacked", "stacked", False),
                                  ("galore_auto", "auto", False), ("galore_stacked_compiled", "stacked", True)):
        opts[label] = galore(params(), 10**9, gemm, compiled)
    official = _import_official()
    if official is not None:
        ps = params()
        opts["galore_torch"] = official([{"params": ps, "rank": rank, "update_proj_gap": 10**9, "scale": 0.25,
                                          "proj_type": "std"}], lr=1e-5, weight_decay=0.01)
    refresh = galore(params(), 1, "auto")
    for opt in list(opts.values()) + [refresh]:
        opt.step()  # the first (RSVD) refresh; later refreshes are seeded-random
        opt.step()  # compiled: the compilation of a normal step
    timer = _Timer(device)
    times: dict[str, list[float]] = {k: [] for k in opts}
    t_refresh: list[float] = []
    for i in range(reps):
        for label, opt in opts.items():
            times[label].append(timer(opt.step))
        if i % 2 == 0:
            t_refresh.append(timer(refresh.step))
    med = {k: statistics.median(v) for k, v in times.items()}
    fused = med["adamw_fused"]
    amort = (statistics.median(t_refresh) + (TAU - 1) * med["galore_auto"]) / TAU
    n = sum(a * b for a, b in shapes)
    return {"workload": name, "params": n, "matrices": len(shapes), "rank": rank, "median_ms": med,
            "over_fused": {k: v / fused for k, v in med.items()}, "galore_refresh_ms": statistics.median(t_refresh),
            "galore_auto_amortised_tau200_ms": amort, "ratio_amortised_vs_fused": amort / fused,
            "adamw_fused_GBps": 7 * 4 * n / fused / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small shapes (the benchmark's own check; no claim)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu --tiny to check the benchmark itself)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = [run(w, args.reps, args.device, args.tiny) for w in WORKLOADS]
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "tiny": args.tiny,
           "torch": torch.__version__, "reps": args.reps, "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    for r in rows:
        print(f"{r['workload']}: " + ", ".join(f"{k} {v:.3f} ms ({r['over_fused'][k]:.2f}x)" for k, v in r["median_ms"].items())
              + f"; refresh {r['galore_refresh_ms']:.3f} ms, default amortised {r['ratio_amortised_vs_fused']:.2f}x fused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
