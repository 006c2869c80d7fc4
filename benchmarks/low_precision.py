"""bf16 GaLore clients: how the update reaches the weights (issue 40, defect 4).

GaLoreAdamW's update record (what a FedGaLore client uploads) is the intended fp32 update. With
bf16 weights the rounding of every step loses part of it unless the optimizer keeps that part:

* ``off``          the rounding is lost (the behaviour before issue 40);
* ``compensated``  what rounding lost is kept in a bf16 residual and added back (2 bytes / entry);
* ``master``       an fp32 master copy is updated and rounded into the weights (4 bytes / entry).

For the adapted-matrix shapes of the SmolLM2-135M and Llama-2-7B plans, one client's local
training is replayed on synthetic gradients (a fixed low-rank signal plus noise, the same draws for
every variant) with the paper pipelines' GaLore settings (RSVD basis, scale 0.25, rank 8 / 32, lr
1e-4, weight decay 0.01, |W| ~ 0.02), and an fp32 run of the same gradients is the reference:

* ``upload_gap``   ‖(W_T − W_0) − record‖ / ‖record‖: the client's own change against its upload;
* ``unchanged``    share of entries of W that never changed;
* ``vs_fp32``      ‖W_T − W_T^fp32‖ / ‖W_T^fp32 − W_0‖: how far the bf16 client's weights are from
  the fp32 client's after the same steps (bf16's own rounding of W_T is the floor);
* ``extra_bytes``  optimizer state the variant adds per adapted entry;
* ``step_ms``      median step time, the variants interleaved in one process, one thread.

    python benchmarks/low_precision.py [--steps 30] [--quick]

Writes benchmarks/results/low_precision.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fedgalore.optim import client_protocol
from fedgalore.optim.galore_adamw import GaLoreAdamW

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "smollm2_135m": {"rank": 8, "shapes": [(576, 576), (192, 576), (1536, 576), (576, 1536)]},
    "llama2_7b": {"rank": 32, "shapes": [(4096, 4096), (11008, 4096), (4096, 11008)]},
}
VARIANTS = ("off", "compensated", "master")
EXTRA_BYTES = {"off": 0, "compensated": 2, "master": 4}


def _gradients(m: int, n: int, steps: int, seed: int):
    """The same gradient sequence for every variant: a fixed rank-4 signal plus noise."""
    g = torch.Generator().manual_seed(seed)
    sig = (torch.randn(m, 4, generator=g) @ torch.randn(4, n, generator=g)) * 0.01
    for _ in range(steps):
        yield sig + 0.01 * torch.randn(m, n, generator=g)


def run_shape(m: int, n: int, rank: int, steps: int, seed: int = 0) -> dict:
    w_init = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1)) * 0.02
    runs = {}
    for name in ("fp32",) + VARIANTS:
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        w = torch.nn.Parameter(w_init.clone().to(dtype))
        runs[name] = {"w": w, "w0": w.detach().clone(), "times": [],
                      "opt": GaLoreAdamW([{"params": [("w", w)], "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                                           "projector": "rsvd", "low_precision": "off" if name == "fp32" else name}],
                                         lr=1e-4, weight_decay=0.01)}
        client_protocol.mark(runs[name]["opt"])
    # interleaved: every variant takes step t before any takes step t + 1
    for grad in _gradients(m, n, steps, seed + 2):
        for name, r in runs.items():
            r["w"].grad = grad.to(r["w"].dtype)
            t0 = time.perf_counter()
            r["opt"].step()
            r["times"].append(time.perf_counter() - t0)
    ref = runs["fp32"]
    ref_delta = ref["w"].detach() - ref["w0"]
    out = {"shape": [m, n], "rank": rank, "steps": steps, "variants": {}}
    for name in VARIANTS:
        r = runs[name]
        record = client_protocol.export_update(r["opt"])["w"].materialize(r["w0"].float())
        own = r["w"].detach().float() - r["w0"].float()
        out["variants"][name] = {
            "upload_gap": float((own - record).norm() / record.norm()),
            "unchanged": float((r["w"].detach() == r["w0"]).float().mean()),
            "vs_fp32": float((r["w"].detach().float() - ref["w"].detach()).norm() / ref_delta.norm()),
            "extra_bytes": EXTRA_BYTES[name],
            "step_ms": 1e3 * statistics.median(r["times"][1:]),  # step 0 holds the RSVD refresh
        }
    # the floor: rounding the fp32 client's final weights to bf16
    out["bf16_rounding_floor"] = float((ref["w"].detach().to(torch.bfloat16).float() - ref["w"].detach()).norm() / ref_delta.norm())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes only, 10 steps (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "low_precision.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = {"smollm2_135m": SHAPES["smollm2_135m"]} if a.quick else SHAPES
    steps = 10 if a.quick else a.steps
    result = {"machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "load_before": os.getloadavg()}, "models": {}}
    for model, spec in models.items():
        rows = [run_shape(m, n, spec["rank"], steps) for m, n in spec["shapes"]]
        result["models"][model] = rows
        for row in rows:
            cells = "  ".join(f"{v}: gap {d['upload_gap']:.3f} unchanged {d['unchanged']:.2f} vs_fp32 {d['vs_fp32']:.3f} "
                              f"{d['step_ms']:.1f} ms" for v, d in row["variants"].items())
            print(f"{model} {tuple(row['shape'])} r{row['rank']}: {cells} (bf16 floor {row['bf16_rounding_floor']:.3f})", flush=True)
    result["machine"]["load_after"] = os.getloadavg()
    if not a.quick:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
