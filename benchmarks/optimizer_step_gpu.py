"""GaLoreAdamW's step against torch AdamW(fused=True) on a CUDA GPU (issue 18, "the GaLore step").

The CPU benchmark (``benchmarks/optimizer_step.py``) measures the issue's workload on one core;
this one runs the same comparison where the paper trains: on the GPU, timed with CUDA events,
medians over ``--reps`` steps, the two optimizers interleaved step by step on their own copies of
the parameters with the same gradients. Workloads: the issue's RoBERTa-base-like stack (12
layers × {768², 768², 768², 3072×768, 768×3072}, r = 8, scale 0.25) and two Llama-2-7B layers
({4096² ×4, 11008×4096 ×2, 4096×11008}, r = 32). GaLore: ``projector=rsvd_then_random`` —
a "normal" step with no refresh, a "refresh" step (the seeded-random basis every step after the
first RSVD), amortised over τ = 200: ``(refresh + 199 · normal) / 200``. fp32 parameters and
gradients, weight decay 0.01. Writes JSON to ``--out``.

    python benchmarks/optimizer_step_gpu.py --out optimizer_step_gpu.json
"""
# fedgalore-bench: not-in-all (needs a CUDA GPU)
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

WORKLOADS = {
    "roberta_base_like_r8": ([(768, 768)] * 3 + [(3072, 768), (768, 3072)]) * 12,
    "llama7b_2_layers_r32": ([(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]) * 2,
}
RANKS = {"roberta_base_like_r8": 8, "llama7b_2_layers_r32": 32}
TAU = 200


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def run(name: str, reps: int) -> dict:
    from fedgalore.optim import GaLoreAdamW

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = WORKLOADS[name]
    base = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=g) * 1e-3 for s in shapes]

    def params():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, gr in zip(ps, grads):
            p.grad = gr
        return ps

    pa, pn, pr = params(), params(), params()
    adamw = torch.optim.AdamW(pa, lr=1e-5, weight_decay=0.01, fused=True)

    def galore(ps, gap):
        group = {"params": [(f"p{i}", p) for i, p in enumerate(ps)], "rank": RANKS[name], "update_proj_gap": gap,
                 "scale": 0.25, "proj_type": "std", "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
        return GaLoreAdamW([group], lr=1e-5, weight_decay=0.01)

    normal, refresh = galore(pn, 10**9), galore(pr, 1)
    normal.step()
    refresh.step()  # the first (RSVD) refresh; later ones are seeded-random
    t_adamw = _time(adamw.step, reps)
    t_normal = _time(normal.step, reps)
    t_refresh = _time(refresh.step, max(reps // 2, 5))
    t_adamw2 = _time(adamw.step, reps)
    amort = (t_refresh + (TAU - 1) * t_normal) / TAU
    fused = min(t_adamw, t_adamw2)
    n = sum(a * b for a, b in shapes)
    return {"workload": name, "params": n, "rank": RANKS[name], "adamw_fused_ms": [t_adamw, t_adamw2], "galore_normal_ms": t_normal,
            "galore_refresh_ms": t_refresh, "galore_amortised_tau200_ms": amort, "ratio_amortised_vs_fused": amort / fused,
            "adamw_fused_GBps": 7 * 4 * n / fused / 1e6, "galore_normal_GBps_at_3_passes": 3 * 4 * n / t_normal / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [run(w, args.reps) for w in WORKLOADS]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    for r in rows:
        print(f"{r['workload']}: fused AdamW {min(r['adamw_fused_ms']):.3f} ms ({r['adamw_fused_GBps']:.0f} GB/s at 7 passes), "
              f"GaLore normal {r['galore_normal_ms']:.3f} ms, refresh {r['galore_refresh_ms']:.3f} ms, "
              f"amortised {r['galore_amortised_tau200_ms']:.3f} ms = {r['ratio_amortised_vs_fused']:.2f}x fused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
