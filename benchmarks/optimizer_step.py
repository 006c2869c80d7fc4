"""Optimizer step cost: fedgalore GaLoreAdamW vs torch AdamW (foreach, fused) vs official GaLore.

Workload: a RoBERTa-base-like stack of GaLore target matrices, 12 layers x {768x768 x3,
3072x768, 768x3072} (77.9M parameters, fp32, CPU), rank 8, scale 0.25, random fixed gradients.

Method (DESIGN §6: ratios measured side by side in one process, interleaved):

* every optimizer has its own state but they all share one set of parameters and gradients;
* a "normal" step is timed on an instance with ``update_proj_gap`` larger than the run, after a
  warm-up step that performed the first refresh;
* a "refresh" step is timed on a second instance with ``update_proj_gap = 1`` (every step
  refreshes); for ``rsvd_then_random`` (``adaptive_proj_steps = 1``) the timed refreshes are the
  steady-state seeded-random ones, and the RSVD refresh is the ``rsvd`` projector's;
* steps of all optimizers are interleaved round-robin; medians are reported;
* amortised per step over a window of ``tau`` steps with one refresh:
  ``(refresh + (tau - 1) * normal) / tau`` — computed from the measured medians instead of
  running full tau-step loops (stated in the JSON);
* optimizer-state bytes: all tensors reachable from ``optimizer.state`` (the official package's
  projector objects included).

* ``fedgalore_rsvd_then_random_record``: the same with the exact update record on (``mark()``,
  as in every federated round); ``..._cold``: record on and ``track_cold=True`` (the shadow cold
  second moment FedGaLore keeps in synchronised runs);
* the machine is shared: the 1-minute load average is sampled after every repetition and stored;
* ``breakdown`` (issue 18): the pieces of a GaLore normal step timed alone over the same stack,
  interleaved with the fused AdamW step: the streaming floors (one read of G: ``G.sum()``; one
  read + write of W: ``W.mul_``), the rank-r projection with oneDNN and with ``torch.matmul``
  (MKL), the back-projection with and without the decay, ``addmm_``'s ``beta``, the row-blocked
  torch decay + back-projection, and the AVX2 kernels the optimizer uses where they apply
  (:mod:`fedgalore.optim.cpu_kernels`; ``benchmarks/step_roofline.py`` puts them against the
  core's peak).

* ``--baseline OLD.py`` adds an older version of the optimizer (its file, imported as a separate
  module) as row ``fedgalore_rsvd_then_random_baseline``: before/after ratios from one process.

Usage: ``python benchmarks/optimizer_step.py [--quick] [--reps N] [--baseline OLD.py]``; writes
``benchmarks/results/optimizer_step.json`` and prints a table. One intra-op thread
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) unless ``--threads`` says otherwise.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch is imported; --threads may raise it
    os.environ.setdefault(_var, "1")

import argparse
import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW, cpu_kernels
from fedgalore.optim import kernels as _ga
from fedgalore.optim.projector import project

RANK, SCALE, TAUS = 8, 0.25, (200, 50)
LR, WD = 1e-5, 0.01  # tiny lr: 1000s of steps on shared params stay well-conditioned
BIG_GAP = 10**9


def _shapes(layers: int) -> list[tuple[int, int]]:
    return [s for _ in range(layers) for s in [(768, 768)] * 3 + [(3072, 768), (768, 3072)]]


def _import_official():
    """galore_torch 1.0 imports bitsandbytes in __init__ for its 8-bit variant; stub if absent."""
    try:
        return importlib.import_module("galore_torch.adamw").AdamW
    except ModuleNotFoundError:
        pass
    for mod in ("bitsandbytes", "bitsandbytes.optim", "bitsandbytes.optim.optimizer"):
        sys.modules.setdefault(mod, types.ModuleType(mod))
    sys.modules["bitsandbytes.optim.optimizer"].Optimizer2State = object  # type: ignore[attr-defined]
    try:
        return importlib.import_module("galore_torch.adamw").AdamW
    except Exception as exc:  # pragma: no cover
        print(f"official galore_torch unavailable: {exc}")
        return None


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, type):  # official projector objects
            return sum(walk(v) for v in vars(x).values())
        return 0

    return sum(walk(s) for s in opt.state.values())


def _load_baseline(path: str):
    """``GaLoreAdamW`` from another version of galore_adamw.py, imported as its own module."""
    spec = importlib.util.spec_from_file_location("fedgalore_baseline_galore_adamw", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses need the module registered
    spec.loader.exec_module(mod)
    return mod.GaLoreAdamW


def _breakdown(params: list[torch.Tensor], opt: GaLoreAdamW, fused: torch.optim.Optimizer, reps: int,
               log) -> dict[str, dict[str, float]]:
    """Pieces of a GaLore normal step over the whole stack, interleaved with the fused AdamW step
    (medians, seconds; ``x_fused`` = ratio to the fused step's median in the same loop)."""
    decay = 1.0 - LR * WD
    coef = -1e-9  # the pieces really update the shared parameters: keep the change negligible
    items = []
    gen = torch.Generator().manual_seed(1)
    for p in params:
        st = opt.state[p]
        side, basis = st.side, st.basis
        u = torch.randn(st.exp_avg.shape, generator=gen)
        a, b = (u, basis) if side == "right" else (basis, u)
        items.append((p, p.grad, side, basis, u, a, b))
    onednn = _ga.onednn_linear()

    def each(fn):
        return lambda: [fn(*it) for it in items]

    pieces = {
        "fused_adamw_step": fused.step,
        "read_G (G.sum)": each(lambda p, g, side, basis, u, a, b: g.sum()),
        "read_write_W (W.mul_)": each(lambda p, g, side, basis, u, a, b: p.data.mul_(decay)),
        "project matmul (MKL)": each(lambda p, g, side, basis, u, a, b: project(g, basis, side)),
        "back_project addmm_ (no decay)": each(lambda p, g, side, basis, u, a, b: p.data.addmm_(a, b, alpha=coef)),
        "decay mul_ + addmm_": each(lambda p, g, side, basis, u, a, b: p.data.mul_(decay).addmm_(a, b, alpha=coef)),
        "decay as addmm_ beta": each(lambda p, g, side, basis, u, a, b: p.data.addmm_(a, b, beta=decay, alpha=coef)),
        "decay + back_project, torch row blocks": cpu_kernels.disabled()(each(
            lambda p, g, side, basis, u, a, b: _ga.decay_back_project(p.data, u, basis, side, decay, coef))),
    }
    if onednn is not None:
        pieces["project oneDNN"] = each(lambda p, g, side, basis, u, a, b: _ga.onednn_project(onednn, g, basis, side))
    if all(cpu_kernels.usable(it[1], it[3]) for it in items):  # what the optimizer runs where they apply
        pieces["project AVX2 kernel (used)"] = each(lambda p, g, side, basis, u, a, b: cpu_kernels.project(g, basis, side))
        pieces["decay + back_project AVX2 kernel (used)"] = each(
            lambda p, g, side, basis, u, a, b: cpu_kernels.decay_back_project(p.data, u, basis, side, decay, coef))
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for i in range(reps):
        order = list(pieces) if i % 2 == 0 else list(reversed(list(pieces)))
        for k in order:
            t0 = time.perf_counter()
            pieces[k]()
            times[k].append(time.perf_counter() - t0)
    log(f"breakdown: {reps} repetitions done")
    ref = statistics.median(times["fused_adamw_step"])
    return {k: {"median_s": statistics.median(v), "x_fused": statistics.median(v) / ref} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="normal-step repetitions (default 21; --quick 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads for every optimizer (default 1: on the oversubscribed shared 2-core box "
                         "2 OpenMP threads stall at barriers; see JSON note)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-piece timings")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="an older galore_adamw.py (e.g. `git show REV:src/fedgalore/optim/galore_adamw.py > old.py`): "
                         "its GaLoreAdamW joins as row fedgalore_rsvd_then_random_baseline, interleaved like the others")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer_step.json"))
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    layers = 4 if args.quick else 12
    reps_normal = args.reps or (5 if args.quick else 21)
    reps_refresh = 2 if args.quick else 3
    reps_refresh_svd = 2  # full SVD refreshes take ~40 s each here: first step + one more
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    loads = [list(os.getloadavg())]

    gen = torch.Generator()
    gen.manual_seed(0)
    params = []
    for m, n in _shapes(layers):
        p = torch.nn.Parameter(0.02 * torch.randn(m, n, generator=gen))
        p.grad = torch.randn(m, n, generator=gen)
        params.append(p)
    n_params = sum(p.numel() for p in params)

    def galore_group(projector: str, gap: int, **extra) -> dict:
        return {"params": params, "rank": RANK, "update_proj_gap": gap, "scale": SCALE, "proj_type": "std",
                "projector": projector, "adaptive_proj_steps": 1, **extra}

    opts: dict[str, torch.optim.Optimizer] = {
        "torch_adamw_foreach": torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True),
        "torch_adamw_fused": torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True),
    }
    official = _import_official()
    if official is not None:
        opts["official_galore"] = official(
            [{"params": params, "rank": RANK, "scale": SCALE, "proj_type": "std", "update_proj_gap": BIG_GAP}],
            lr=LR, weight_decay=WD, no_deprecation_warning=True,
        )
    for proj in ("svd", "rsvd", "rsvd_then_random"):
        opts[f"fedgalore_{proj}"] = GaLoreAdamW([galore_group(proj, BIG_GAP)], lr=LR, weight_decay=WD)
    if args.baseline:
        opts["fedgalore_rsvd_then_random_baseline"] = _load_baseline(args.baseline)(
            [galore_group("rsvd_then_random", BIG_GAP)], lr=LR, weight_decay=WD)
    opts["fedgalore_rsvd_then_random_record"] = GaLoreAdamW([galore_group("rsvd_then_random", BIG_GAP)], lr=LR, weight_decay=WD)
    opts["fedgalore_rsvd_then_random_cold"] = GaLoreAdamW(
        [galore_group("rsvd_then_random", BIG_GAP, track_cold=True)], lr=LR, weight_decay=WD)
    for k in ("fedgalore_rsvd_then_random_record", "fedgalore_rsvd_then_random_cold"):
        client_protocol.mark(opts[k])  # update record on from the start, as in a federated round
    galore_kinds = [k for k in opts if "galore" in k]
    seeded_refresh = [k for k in galore_kinds if k.startswith("fedgalore_rsvd_then_random")]

    def set_gap(k: str, gap: int) -> None:
        """Force (gap=1) or suppress (gap=BIG) a refresh on the next step of optimizer ``k``."""
        if k == "official_galore":
            for st in opts[k].state.values():
                st["projector"].update_proj_gap = gap
        else:
            opts[k].param_groups[0]["update_proj_gap"] = gap

    def timed(opt) -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    normal: dict[str, list[float]] = {k: [] for k in opts}
    refresh: dict[str, list[float]] = {k: [] for k in galore_kinds}
    first_refresh: dict[str, float] = {}
    # first step: state creation + first (data-driven) refresh. For svd/rsvd/official it is also a
    # refresh sample; for rsvd_then_random the steady-state (seeded random) refreshes are timed later.
    for k, o in opts.items():
        dt = timed(o)
        log(f"first step {k}: {dt:.3f}s")
        if k in refresh:
            first_refresh[k] = dt
            if k not in seeded_refresh:
                refresh[k].append(dt)
    for i in range(reps_normal):
        order = list(opts) if i % 2 == 0 else list(reversed(list(opts)))
        for k in order:
            normal[k].append(timed(opts[k]))
        if i < reps_refresh:
            for k in galore_kinds:
                cap = reps_refresh_svd if k in ("official_galore", "fedgalore_svd") else reps_refresh
                if len(refresh[k]) >= cap:
                    continue
                set_gap(k, 1)
                refresh[k].append(timed(opts[k]))
                set_gap(k, BIG_GAP)
        loads.append(list(os.getloadavg()))
        log(f"repetition {i + 1}/{reps_normal} done (load {loads[-1][0]:.2f})")

    breakdown = None
    if not args.no_breakdown:
        breakdown = _breakdown(params, opts["fedgalore_rsvd_then_random"], opts["torch_adamw_fused"], reps_normal, log)
        loads.append(list(os.getloadavg()))

    med = {k: statistics.median(v) for k, v in normal.items()}
    med_ref = {k: statistics.median(v) for k, v in refresh.items()}
    rows = {}
    for k in opts:
        row = {"median_step_s": med[k], "min_step_s": min(normal[k]), "state_bytes": _state_bytes(opts[k])}
        if k in med_ref:
            row["refresh_step_s"] = med_ref[k]
            row["first_refresh_step_s"] = first_refresh[k]
            for tau in TAUS:
                row[f"amortised_step_s_tau{tau}"] = (med_ref[k] + (tau - 1) * med[k]) / tau
        else:
            for tau in TAUS:
                row[f"amortised_step_s_tau{tau}"] = med[k]
        rows[k] = row
    fused = rows["torch_adamw_fused"]
    for k, row in rows.items():
        row["normal_ratio_vs_fused"] = row["median_step_s"] / fused["median_step_s"]
        for tau in TAUS:
            row[f"ratio_vs_fused_tau{tau}"] = row[f"amortised_step_s_tau{tau}"] / fused[f"amortised_step_s_tau{tau}"]
            if "official_galore" in rows:
                row[f"speedup_vs_official_tau{tau}"] = (
                    rows["official_galore"][f"amortised_step_s_tau{tau}"] / row[f"amortised_step_s_tau{tau}"]
                )
        row["state_bytes_frac_of_adamw"] = row["state_bytes"] / fused["state_bytes"]

    target = rows["fedgalore_rsvd_then_random"]
    targets = {}
    for tau in TAUS:
        targets[f"tau{tau}"] = {
            "amortised_le_1x_fused": {"value": target[f"ratio_vs_fused_tau{tau}"], "met": target[f"ratio_vs_fused_tau{tau}"] <= 1.0},
            "ge_5x_faster_than_official": (
                {"value": target[f"speedup_vs_official_tau{tau}"], "met": target[f"speedup_vs_official_tau{tau}"] >= 5.0}
                if "official_galore" in rows else {"value": None, "met": None}
            ),
        }
    targets["state_bytes_le_2pct_of_adamw"] = {
        "value": target["state_bytes_frac_of_adamw"], "met": target["state_bytes_frac_of_adamw"] <= 0.02
    }
    base = rows["fedgalore_rsvd_then_random"]["median_step_s"]
    extra_cost = {
        "update_record": rows["fedgalore_rsvd_then_random_record"]["median_step_s"] / base - 1.0,
        "update_record_and_track_cold": rows["fedgalore_rsvd_then_random_cold"]["median_step_s"] / base - 1.0,
        "track_cold_over_record": (rows["fedgalore_rsvd_then_random_cold"]["median_step_s"]
                                   / rows["fedgalore_rsvd_then_random_record"]["median_step_s"] - 1.0),
    }
    one_min = [x[0] for x in loads]
    result = {
        "benchmark": "optimizer_step",
        "quick": args.quick,
        "workload": {"layers": layers, "shapes_per_layer": [[768, 768]] * 3 + [[3072, 768], [768, 3072]],
                     "params": n_params, "rank": RANK, "scale": SCALE, "taus": list(TAUS), "dtype": "float32"},
        "method": ("one instance per optimizer, interleaved round-robin (order reversed every other repetition), "
                   "medians; update_proj_gap=1e9 for normal "
                   "steps, switched to 1 for the timed refresh steps (official package: its projector objects' gap); "
                   "svd/rsvd/official refresh samples include the first step (state creation + first SVD); "
                   "rsvd_then_random (adaptive_proj_steps=1) refresh samples are the steady-state seeded-random "
                   "refreshes, its first (RSVD) refresh is first_refresh_step_s; amortised = (refresh + (tau-1)*normal)"
                   "/tau from the medians, not full tau-step loops; weight decay 0.01 for all; _record/_cold rows: "
                   "mark() before the first step (update record on), _cold with track_cold=True"),
        "passes_per_normal_step": {
            "note": "full m x n passes per GaLore matrix, fp32, weight decay on (counted from the code)",
            "torch_adamw_fused": "7 (read p, g, m, v; write p, m, v)",
            "fedgalore_now": "3 (projection reads G; row-blocked decay + back-projection reads and writes W once, "
                             "the rank-r GEMM re-reads each block from cache); non-finite check, moments, record and "
                             "shadow cold moment are m x r",
            "fedgalore_before_issue18": "5 (projection reads G; W.mul_ reads + writes W; W.addmm_ reads + writes W)",
        },
        "repetitions": {"normal": reps_normal, "refresh": reps_refresh, "refresh_full_svd": reps_refresh_svd},
        "rows": rows,
        "extra_cost_vs_rsvd_then_random": extra_cost,
        "baseline": args.baseline,
        "breakdown": breakdown,
        "targets_rsvd_then_random": targets,
        "kernels": {"avx2": cpu_kernels.available(), "avx2_unavailable_because": cpu_kernels.reason(),
                    "projection": "AVX2 kernel (fedgalore.optim.cpu_kernels) where usable, else "
                    + ("oneDNN (torch.ops.mkldnn._linear_pointwise)" if _ga.onednn_linear() is not None else "torch.matmul"),
                    "block_bytes": _ga.BLOCK_BYTES, "onednn_min_numel": _ga.ONEDNN_MIN_NUMEL},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "load_average_at_end": list(os.getloadavg()),
                    "load_1min": {"start": one_min[0], "min": min(one_min), "median": statistics.median(one_min),
                                  "max": max(one_min), "samples": one_min},
                    "note": "shared 2-core CPU with other jobs running while measured; timings noisy, compare ratios"},
        "total_runtime_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    hdr = f"{'optimizer':38s} {'median':>9s} {'refresh':>9s} {'amort200':>9s} {'amort50':>9s} {'x fused200':>10s} {'x fused50':>9s} {'state MB':>9s} {'state %':>8s}"
    print(f"{layers} layers, {n_params / 1e6:.1f}M params, rank {RANK}; seconds per step")
    print(hdr)
    for k, r in rows.items():
        ref = f"{r['refresh_step_s']:9.3f}" if "refresh_step_s" in r else f"{'-':>9s}"
        print(f"{k:38s} {r['median_step_s']:9.3f} {ref} {r['amortised_step_s_tau200']:9.3f} {r['amortised_step_s_tau50']:9.3f} "
              f"{r['ratio_vs_fused_tau200']:10.2f} {r['ratio_vs_fused_tau50']:9.2f} {r['state_bytes'] / 2**20:9.1f} "
              f"{100 * r['state_bytes_frac_of_adamw']:7.2f}%")
    if breakdown:
        print("breakdown (whole stack, interleaved with the fused step):")
        for k, v in breakdown.items():
            print(f"  {k:42s} {v['median_s'] * 1e3:8.1f} ms  {v['x_fused']:5.2f} x fused")
    print("extra cost vs rsvd_then_random:", json.dumps({k: round(v, 4) for k, v in extra_cost.items()}))
    print("targets (rsvd_then_random):", json.dumps(targets))
    print(f"load 1-min: start {one_min[0]:.2f}, median {statistics.median(one_min):.2f}, max {max(one_min):.2f}")
    print(f"total {result['total_runtime_s']:.0f} s -> {out}")


if __name__ == "__main__":
    main()
