"""The bucketed moment step against the per-matrix step it replaced (issue 43), on a CPU; and the
bucket's stacked GEMMs and the compiled moment step, the GPU's forms, measured here on the CPU.

Workload: the GaLore target matrices of a small encoder that the torch algebra steps (the AVX2
kernel path takes matrices of 2^18 entries and more, per matrix, in both versions): MiniLM-L6's
attention, 6 layers × {query, key, value, output} 384×384 (24 matrices, one shape), rank 8, fp32,
random fixed gradients; plus a mixed stack of small shapes (24 matrices of 6 shapes, both sides).

Variants, each with its own parameters (copies of one set) and the same gradients, stepped
interleaved round-robin in one process, one thread, medians of ``--reps`` normal steps (after a
warm-up step with the first refresh):

* ``bucketed``: this version, all matrices in one group (buckets of the matrices of one shape);
* ``singletons``: this version, each matrix in its own group (buckets of one: the per-matrix cost
  of the new code);
* ``before``: the optimizer as it was before the buckets (``--before FILE``, default: the
  version at git revision ``--rev``, imported as a separate module);
* ``stacked_gemm``: as ``bucketed`` with ``bucket_gemm: stacked`` (one ``bmm`` projects a bucket,
  one back-projects it; the CUDA default), ``compiled``: ``compile_moments="inductor"`` (the
  moment algebra as one generated kernel per bucket), ``stacked_compiled``: both. Their first
  steps (compilation) are outside the timed steps. ``--no-gpu-forms`` leaves these out.

The record (``mark()``) is on, as in every federated round. Before every timed step a 64 MiB buffer
is written, so no variant inherits a cache filled (or emptied) by the one before it. Writes
``benchmarks/results/bucket_step.json``; the 1-minute load average is stored.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedgalore.optim import client_protocol
import torch
from optimizer_step import _load_baseline  # (benchmarks/ is this script's folder)

ROOT = Path(__file__).resolve().parents[1]
#: written before every timed step: each variant's step starts with caches holding other data (as in
#: training, where forward and backward run between steps), not with what the variant before it left
FLUSH_BYTES = 64 << 20
WORKLOADS = {
    "minilm_attention": [(384, 384)] * 24,
    "mixed_small": [(256, 256), (256, 768), (768, 256), (128, 512), (512, 128), (192, 192)] * 4,
}


def _load_before(rev: str, path: str | None):
    """``GaLoreAdamW`` of the older galore_adamw.py (``path``, else the file at git ``rev``), a
    separate module beside the package's (optimizer_step.py's loader)."""
    if path is None:
        src = subprocess.run(["git", "show", f"{rev}:src/fedgalore/optim/galore_adamw.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        fd, path = tempfile.mkstemp(suffix="_galore_adamw_before.py")
        os.write(fd, src.encode())
        os.close(fd)
    return _load_baseline(path)


def _opt(cls, params, together: bool, group: dict | None = None, **kw):
    base = {"rank": 8, "projector": "rsvd_then_random", "update_proj_gap": 10**6, "scale": 0.25, **(group or {})}
    named = [(f"w{i}", p) for i, p in enumerate(params)]
    groups = [{"params": named, **base}] if together else [{"params": [x], **base} for x in named]
    opt = cls(groups, lr=1e-3, weight_decay=0.01, projection_seed=3, **kw)
    client_protocol.mark(opt)
    return opt


def measure(shapes, reps: int, before_cls, gpu_forms: bool = True) -> dict:
    from fedgalore.optim import GaLoreAdamW

    g = torch.Generator().manual_seed(0)
    init = [0.02 * torch.randn(*s, generator=g) for s in shapes]
    grads = [torch.randn(*s, generator=g) for s in shapes]
    variants = {}
    cases = [("bucketed", GaLoreAdamW, True, {}), ("singletons", GaLoreAdamW, False, {}),
             ("before", before_cls, True, {})]
    if gpu_forms:
        stacked = {"group": {"bucket_gemm": "stacked"}}
        cases += [("stacked_gemm", GaLoreAdamW, True, stacked),
                  ("compiled", GaLoreAdamW, True, {"compile_moments": "inductor"}),
                  ("stacked_compiled", GaLoreAdamW, True, {**stacked, "compile_moments": "inductor"})]
    for name, cls, together, kw in cases:
        params = [torch.nn.Parameter(w.clone()) for w in init]
        for p, gr in zip(params, grads):
            p.grad = gr
        opt = _opt(cls, params, together, **kw)
        opt.step()  # the first refresh
        opt.step()  # (and, compiled, the compilation of a step without refresh)
        variants[name] = (opt, params)
    times = {k: [] for k in variants}
    loads = []
    flush = torch.empty(FLUSH_BYTES // 4)
    for _ in range(reps):
        for name, (opt, _params) in variants.items():
            flush.fill_(1.0)  # every variant starts from caches another workload has filled (as after a backward pass)
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    ref = variants["before"][1]

    def diff(name):
        return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(variants[name][1], ref))

    return {"matrices": len(shapes), "shapes": sorted({f"{m}x{n}" for m, n in shapes}), "median_ms": med,
            "bucketed_over_before": med["bucketed"] / med["before"], "singletons_over_before": med["singletons"] / med["before"],
            "over_bucketed": {k: med[k] / med["bucketed"] for k in med},
            "max_abs_weight_difference_vs_before": diff("bucketed"),
            "max_abs_weight_difference_vs_before_by_variant": {k: diff(k) for k in variants},
            "loadavg_1min": loads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--rev", default="a1413e5", help="git revision of the version before the buckets")
    ap.add_argument("--before", default=None, help="the older galore_adamw.py itself (instead of --rev)")
    ap.add_argument("--no-gpu-forms", action="store_true", help="leave out the stacked-GEMM and compiled variants")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bucket_step.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    before = _load_before(args.rev, args.before)
    out = {"benchmark": "bucket_step", "device": "cpu", "threads": 1, "torch": torch.__version__,
           "python": sys.version.split()[0], "before": args.before or f"git {args.rev}", "reps": args.reps, "workloads": {}}
    for name, shapes in WORKLOADS.items():
        r = measure(shapes, args.reps, before, gpu_forms=not args.no_gpu_forms)
        out["workloads"][name] = r
        m = r["median_ms"]
        print(f"{name:18s} bucketed {m['bucketed']:7.2f} ms  singletons {m['singletons']:7.2f} ms  before {m['before']:7.2f} ms  "
              f"bucketed/before {r['bucketed_over_before']:.3f}  (max |dW| vs before {r['max_abs_weight_difference_vs_before']:.1e}, "
              f"load {sum(r['loadavg_1min']) / len(r['loadavg_1min']):.1f})", flush=True)
        others = {k: v for k, v in r["over_bucketed"].items() if k not in ("bucketed", "singletons", "before")}
        if others:
            print("    over bucketed: " + "  ".join(f"{k} {v:.3f}" for k, v in others.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
