"""AJIVE scaling benchmark (paper Appendix F, Table 7 grid) — dense path, mvlearn, factored path.

Cells (all float32 for ours, float64 for mvlearn, which casts; one process, side by side):

(a) ``ours_dense``   — :func:`fedgalore.sync.ajive` on dense ``n × n`` views, the settings the
    server uses: init signal ranks ``R0``, joint rank ``K0`` fixed, no individual estimates
    (``svd="auto"`` → truncated SVD by subspace iteration).
(a') ``ours_dense_same`` — ours with mvlearn's settings below (individual ranks ``IR`` fixed too).
(b) ``mvlearn``      — ``mvlearn.decomposition.AJIVE(init_signal_ranks=R0, joint_rank=K0,
    individual_ranks=IR)``: every rank fixed, so no Wedin/random-direction resampling and no full
    SVD of the residual (svds at rank ``IR`` instead). Called only here, never from ``src``.
(c) ``ours_factored`` — rank-``r`` views ``V_i = v_i P`` (shared seeded basis, ``v_i`` = common +
    own part) for ``r`` = 8, 16, 32, given as factors; same matrices materialised for mvlearn and
    our dense path at views 10, n = 1024, with init ranks ``r`` and joint rank ``r``; reports the
    speed-up over mvlearn and the relative difference of the joint matrices.
(d) Llama-7B block ``4096 × 11008`` (left side: basis ``4096 × 32``, moments ``32 × 11008``),
    r = 32, views 4 and 50, factored only: :func:`synchronize_moments` mode ``ajive`` (the full
    server operation, diagnostics included) and ``mean``.
(e) ``--llama-only`` (issue 18): the same block, side by side and interleaved in one process —
    :func:`fedgalore.sync.ajive` now vs the baseline ``ajive.py`` of git revision
    ``BASELINE_REV`` (loaded from git, not kept in the package), the full server sync with each,
    and the sync without diagnostics (their difference is the cost of the diagnostics, now in
    closed form for views on one basis). Writes ``benchmarks/results/ajive_llama_sync.json``.

Dense data for (a)/(b): ``V_i = (C + 0.3 O_i) P + 0.01 Ξ_i`` with ``C``, ``O_i`` ``n × R0``
uniform, ``P`` a random orthonormal ``R0 × n`` basis, ``Ξ_i`` standard normal — rank-``R0`` signal
plus a full-rank floor, like a second-moment buffer lifted to full space.
Writes ``benchmarks/results/ajive_scaling.json`` and prints a table. ``--quick``: fewer repeats,
n ≤ 768 for the grid, output ``ajive_scaling_quick.json``. ``--threads N`` sets torch and BLAS
threads (the committed run used ``--threads 1``: on a shared, oversubscribed 2-core machine
2-thread OpenMP regions stall; wall and process-CPU seconds are both recorded).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

if "--threads" in sys.argv:  # BLAS threads for numpy/mvlearn must be set before numpy loads
    _n = sys.argv[sys.argv.index("--threads") + 1]
    for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_v] = _n

import numpy as np
import torch

from fedgalore.protocol.payload import Factored, MomentView
from fedgalore.sync import ajive, synchronize_moments

PAPER_CPU = {  # Table 7, CPU rows (seconds)
    (1, 512): 0.006554, (1, 768): 0.009816, (1, 1024): 0.018628,
    (2, 512): 0.012233, (2, 768): 0.025425, (2, 1024): 0.040607,
    (5, 512): 0.031390, (5, 768): 0.045956, (5, 1024): 0.092544,
    (10, 512): 0.060522, (10, 768): 0.098389, (10, 1024): 0.184439,
}
R0, K0, IR = 16, 8, 4


CPU_TIMES: list[float] = []  # process CPU seconds of the last _timeit's fastest repeat


def _timeit(fn, repeats: int) -> tuple[float, float, object]:
    """(min wall s, median wall s, result); the min repeat's process CPU time goes to CPU_TIMES."""
    ts, cs = [], []
    if repeats == 0:  # single timed run that is also the result (slow reference code)
        c, t = time.process_time(), time.perf_counter()
        out = fn()
        CPU_TIMES.append(time.process_time() - c)
        dt = time.perf_counter() - t
        return dt, dt, out
    out = fn()  # warm-up (also the result we check)
    for _ in range(repeats):
        c = time.process_time()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    CPU_TIMES.append(cs[ts.index(min(ts))])
    return min(ts), statistics.median(ts), out


def _basis(g: torch.Generator, n: int, r: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, r, generator=g))[0].T.contiguous()  # r × n


def _moments(g, k, rows, r):
    common = torch.rand(rows, r, generator=g)
    return [common + 0.3 * torch.rand(rows, r, generator=g) for _ in range(k)]


def dense_views(k: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = _basis(g, n, R0)
    return [v @ p + 0.01 * torch.randn(n, n, generator=g) for v in _moments(g, k, n, R0)]


def _rel(a, b) -> float:
    a = a.left @ a.core @ a.right.T if isinstance(a, Factored) else a
    b = b.left @ b.core @ b.right.T if isinstance(b, Factored) else b
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _mvlearn():
    try:
        from mvlearn.decomposition import AJIVE

        return AJIVE
    except Exception:  # pragma: no cover - optional
        return None


def _run_mvlearn(AJIVE, xs, init, joint, ind):
    state = np.random.get_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mv = AJIVE(init_signal_ranks=list(init), joint_rank=joint, individual_ranks=list(ind)).fit(xs)
    np.random.set_state(state)
    return mv


def grid(quick: bool) -> list[dict]:
    AJIVE = _mvlearn()
    rows = []
    sizes = (512, 768) if quick else (512, 768, 1024)
    for k in (1, 2, 5, 10):
        for n in sizes:
            xs = dense_views(k, n)
            rep = 3 if quick else 5
            t_min, t_med, ours = _timeit(lambda: ajive(xs, init_signal_ranks=R0, joint_rank=K0, compute_individual=False), rep)
            s_min, s_med, same = _timeit(lambda: ajive(xs, init_signal_ranks=R0, joint_rank=K0, individual_ranks=[IR] * k), rep)
            row = {"views": k, "n": n, "paper_cpu_s": PAPER_CPU[(k, n)], "ours_dense_min_s": t_min, "ours_dense_median_s": t_med,
                   "ours_dense_cpu_s": CPU_TIMES[-2],
                   "ours_dense_same_min_s": s_min, "ours_dense_same_median_s": s_med, "joint_rank": ours.joint_rank}
            if AJIVE is not None:
                xn = [x.double().numpy() for x in xs]
                m_min, m_med, mv = _timeit(lambda: _run_mvlearn(AJIVE, xn, [R0] * k, K0, [IR] * k), 0 if n == 1024 else 1)
                row.update({"mvlearn_min_s": m_min, "mvlearn_median_s": m_med, "mvlearn_cpu_s": CPU_TIMES[-1], "mvlearn_joint_rank": int(mv.joint_rank_)})
                if mv.joint_rank_ > 0:
                    jm = mv.transform(xn)
                    row["joint_rel_diff_vs_mvlearn"] = max(_rel(same.joint[i], torch.tensor(jm[i])) for i in range(k))
                row["speedup_vs_mvlearn"] = m_min / s_min
            rows.append(row)
            print(f"grid views={k:2d} n={n:4d}: ours {t_min*1e3:7.1f} ms (paper {PAPER_CPU[(k, n)]*1e3:6.1f}), same-as-mvlearn {s_min*1e3:7.1f} ms"
                  + (f", mvlearn {row['mvlearn_min_s']*1e3:8.1f} ms" if "mvlearn_min_s" in row else ""), flush=True)
    return rows


def factored(quick: bool) -> list[dict]:
    AJIVE = _mvlearn()
    rows = []
    k, n = 10, 1024
    for r in (8, 16, 32):  # mvlearn (slow) only at r = 16
        g = torch.Generator().manual_seed(r)
        p = _basis(g, n, r)
        vs = _moments(g, k, n, r)
        eye = torch.eye(r)
        fviews = [Factored(v, eye, p.T) for v in vs]
        dense = [v @ p for v in vs]
        f_min, f_med, fres = _timeit(lambda: ajive(fviews, init_signal_ranks=r, joint_rank=r, compute_individual=False), 5)
        d_min, d_med, dres = _timeit(lambda: ajive(dense, init_signal_ranks=r, joint_rank=r, compute_individual=False), 3)
        row = {"views": k, "n": n, "r": r, "ours_factored_min_s": f_min, "ours_factored_median_s": f_med, "ours_factored_cpu_s": CPU_TIMES[-2],
               "ours_dense_min_s": d_min, "ours_dense_median_s": d_med, "joint_rank": fres.joint_rank,
               "joint_rel_diff_dense_vs_factored": max(_rel(fres.joint[i], dres.joint[i]) for i in range(k))}
        if AJIVE is not None and r == 16:
            xn = [x.double().numpy() for x in dense]
            m_min, _, mv = _timeit(lambda: _run_mvlearn(AJIVE, xn, [r] * k, r, [1] * k), 0)
            row.update({"mvlearn_s": m_min, "mvlearn_cpu_s": CPU_TIMES[-1], "mvlearn_joint_rank": int(mv.joint_rank_),
                        "speedup_factored_vs_mvlearn": m_min / f_min, "speedup_cpu_time": CPU_TIMES[-1] / row["ours_factored_cpu_s"]})
            if mv.joint_rank_ == fres.joint_rank and mv.joint_rank_ > 0:
                jm = mv.transform(xn)
                row["joint_rel_diff_vs_mvlearn"] = max(_rel(fres.joint[i], torch.tensor(jm[i])) for i in range(k))
        rows.append(row)
        print(f"factored r={r:2d} views=10 n=1024: factored {f_min*1e3:6.2f} ms, dense {d_min*1e3:7.1f} ms"
              + (f", mvlearn {row['mvlearn_s']*1e3:8.1f} ms, speed-up {row['speedup_factored_vs_mvlearn']:.0f}x, "
                 f"joint rank {row['joint_rank']}/{row['mvlearn_joint_rank']}, rel diff {row.get('joint_rel_diff_vs_mvlearn', float('nan')):.1e}"
                 if "mvlearn_s" in row else ""), flush=True)
    return rows


def llama(quick: bool) -> list[dict]:
    rows = []
    m, n, r = 4096, 11008, 32
    g = torch.Generator().manual_seed(7)
    p = torch.linalg.qr(torch.randn(m, r, generator=g))[0].contiguous()  # shared seeded basis, m × r
    for k in (4, 50):
        common = torch.rand(r, n, generator=g)
        views = [MomentView(common + 0.3 * torch.rand(r, n, generator=g), "left", (m, n), basis=p) for _ in range(k)]
        w = [1.0 + i for i in range(k)]
        a_min, a_med, res = _timeit(lambda: synchronize_moments(views, w, "ajive"), 2 if quick else 3)
        b_min, b_med, _ = _timeit(lambda: synchronize_moments(views, w, "ajive", diagnostics=False), 2 if quick else 3)
        c_min, c_med, _ = _timeit(lambda: synchronize_moments(views, w, "mean"), 2 if quick else 3)
        rows.append({"shape": [m, n], "r": r, "views": k, "ajive_sync_min_s": a_min, "ajive_sync_median_s": a_med, "ajive_sync_cpu_s": CPU_TIMES[-3],
                     "ajive_sync_no_diag_min_s": b_min, "ajive_sync_no_diag_median_s": b_med,
                     "mean_sync_min_s": c_min, "joint_rank": res.diagnostics["joint_rank"],
                     "mismatch_before": res.diagnostics["mismatch_before"], "mismatch_after": res.diagnostics["mismatch_after"]})
        print(f"llama 4096x11008 r=32 views={k:2d}: ajive sync {a_min:.3f} s (cpu {CPU_TIMES[-3]:.3f}, median {a_med:.3f}; without diagnostics {b_min:.3f}), "
              f"mean {c_min:.3f} s, joint rank {res.diagnostics['joint_rank']:.0f}", flush=True)
    return rows


BASELINE_REV = "c4baba6"  # the last ajive.py before the issue-18 speed-ups


def _baseline_ajive():
    """``ajive`` from ``BASELINE_REV``'s ``src/fedgalore/sync/ajive.py`` (None without git)."""
    import importlib.util
    import subprocess
    import tempfile

    try:
        code = subprocess.run(["git", "show", f"{BASELINE_REV}:src/fedgalore/sync/ajive.py"], check=True,
                              capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "ajive_baseline.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("fedgalore_ajive_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.ajive


def llama_sync(repeats: int) -> dict:
    """(e): one Llama-2-7B block, the server's AJIVE sync before/after, interleaved."""
    import importlib

    moments = importlib.import_module("fedgalore.sync.moments")
    new_ajive = moments.ajive
    old_ajive = _baseline_ajive()
    m, n, r = 4096, 11008, 32
    rows = []
    for k in (4, 50):
        g = torch.Generator().manual_seed(7)
        p = torch.linalg.qr(torch.randn(m, r, generator=g))[0].contiguous()
        common = torch.rand(r, n, generator=g)
        moms = [common + 0.3 * torch.rand(r, n, generator=g) for _ in range(k)]
        views = [MomentView(v, "left", (m, n), basis=p) for v in moms]
        w = [1.0 + i for i in range(k)]
        eye = torch.eye(r)
        fviews = [Factored(v.T, eye, p) for v in moms]  # what synchronize hands AJIVE
        kw = dict(init_signal_ranks=[r] * k, joint_rank=r, compute_individual=False, check_finite=False, seed=11)
        pairs = [(v.T, p) for v in moms]

        def sync_with(fn, diagnostics=True):
            moments.ajive = fn
            try:
                return moments.synchronize_moments(views, w, "ajive", seed=11, diagnostics=diagnostics)
            finally:
                moments.ajive = new_ajive

        variants = {"ajive_new": lambda: new_ajive(fviews, **kw),
                    "sync_new": lambda: sync_with(new_ajive),
                    "sync_new_no_diagnostics": lambda: sync_with(new_ajive, diagnostics=False)}
        if old_ajive is not None:
            variants["ajive_baseline"] = lambda: old_ajive(fviews, **kw)
            variants["sync_baseline"] = lambda: sync_with(old_ajive)
        out = {name: fn() for name, fn in variants.items()}  # warm-up, and the results compared
        wall = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        load = [os.getloadavg()[0]]
        for _ in range(repeats):  # interleaved: every variant once per repeat
            for name, fn in variants.items():
                c, t = time.process_time(), time.perf_counter()
                fn()
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
            load.append(os.getloadavg()[0])
        row = {"shape": [m, n], "r": r, "views": k, "repeats": repeats, "loadavg_1min": load,
               "min_s": {kk: min(v) for kk, v in wall.items()}, "median_s": {kk: statistics.median(v) for kk, v in wall.items()},
               "cpu_s_of_min": {kk: cpu[kk][wall[kk].index(min(wall[kk]))] for kk in wall}}
        med = row["median_s"]
        row["diagnostics_current_s"] = med["sync_new"] - med["sync_new_no_diagnostics"]
        if old_ajive is not None:
            row["speedup_ajive"] = med["ajive_baseline"] / med["ajive_new"]
            row["speedup_sync"] = med["sync_baseline"] / med["sync_new"]
            a, b = out["ajive_baseline"], out["ajive_new"]
            row["joint_rank"] = [a.joint_rank, b.joint_rank]
            row["joint_rel_diff_new_vs_baseline"] = max(_rel(x, y) for x, y in zip(b.joint, a.joint))
            sa, sb = out["sync_baseline"].state, out["sync_new"].state
            row["synced_state_rel_diff"] = float((sb.moment.double() - sa.moment.double()).norm() / sa.moment.double().norm())
        rows.append(row)
        print(f"llama 4096x11008 r=32 views={k:2d} (median of {repeats}, load {load[0]:.1f}-{max(load):.1f}): "
              + ", ".join(f"{kk} {v:.3f}s" for kk, v in med.items()), flush=True)
        if old_ajive is not None:
            print(f"   ajive {row['speedup_ajive']:.2f}x faster, sync {row['speedup_sync']:.2f}x; joint rel diff "
                  f"{row['joint_rel_diff_new_vs_baseline']:.1e}, synced state rel diff {row['synced_state_rel_diff']:.1e}", flush=True)
    return {"baseline_rev": BASELINE_REV if old_ajive is not None else None, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="AJIVE scaling benchmark")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--llama-only", action="store_true", help="only (e): the Llama block before/after, ajive_llama_sync.json")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats for --llama-only")
    ap.add_argument("--out", default=None, help="default benchmarks/results/ajive_scaling.json (…_quick.json with --quick)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = ("benchmarks/results/ajive_llama_sync.json" if args.llama_only else
                    "benchmarks/results/ajive_scaling_quick.json" if args.quick else "benchmarks/results/ajive_scaling.json")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    if args.llama_only:
        out = {"meta": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(), "loadavg_start": load0}}
        out["llama_sync"] = llama_sync(args.repeats)
        out["meta"]["loadavg_end"] = os.getloadavg()
        out["meta"]["seconds"] = time.perf_counter() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        return out
    out = {"meta": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                    "loadavg_start": load0, "quick": args.quick,
                    "settings": {"init_signal_ranks": R0, "joint_rank": K0, "individual_ranks_for_mvlearn_comparison": IR}}}
    try:
        import mvlearn

        out["meta"]["mvlearn"] = mvlearn.__version__
    except Exception:
        out["meta"]["mvlearn"] = None
    out["grid"] = grid(args.quick)
    out["factored"] = factored(args.quick)
    out["llama"] = llama(args.quick)
    out["meta"]["loadavg_end"] = os.getloadavg()
    out["meta"]["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\n| views | n | ours dense (s) | paper CPU (s) | ours, mvlearn settings (s) | mvlearn (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in out["grid"]:
        print(f"| {r['views']} | {r['n']} | {r['ours_dense_min_s']:.4f} | {r['paper_cpu_s']:.4f} | {r['ours_dense_same_min_s']:.4f} | {r.get('mvlearn_min_s', float('nan')):.4f} |")
    print("\n| r | ours factored (s) | ours dense (s) | mvlearn (s) | speed-up vs mvlearn | joint rel diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in out["factored"]:
        print(f"| {r['r']} | {r['ours_factored_min_s']:.5f} | {r['ours_dense_min_s']:.4f} | {r.get('mvlearn_s', float('nan')):.3f} | "
              f"{r.get('speedup_factored_vs_mvlearn', float('nan')):.0f}x | {r.get('joint_rel_diff_vs_mvlearn', float('nan')):.1e} |")
    print(f"\nload average start {load0}, end {out['meta']['loadavg_end']}; total {out['meta']['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
