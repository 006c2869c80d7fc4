"""Appendix G ("Validation of Spectral Synchronization via AJIVE"): recover ``V* = (G*)^{∘2}``.

Data (constants in :class:`Config`): a rank-5 global gradient ``G* = A Bᵀ`` (``N × M``; ``A``, ``B``
i.i.d. ``N(0, 1/√5)`` so ``G*`` has unit-variance entries); client ``k`` observes
``G_k = G* + L_k + Ξ_k`` with rank-2 drift ``L_k = drift · C_k D_kᵀ/√2`` (``C_k``, ``D_k`` i.i.d.
``N(0,1)``, so drift entries have standard deviation ``drift``) and noise ``Ξ_k ~ N(0, σ²)``; its second moment is
``V_k = G_k^{∘2}``; the target is ``V* = (G*)^{∘2}``. Clients are weighted equally.

Estimators (all through :func:`fedgalore.sync.moments.synchronize`, i.e. exactly the server's
sync operator, applied to the dense views ``V_k``, given to it as factors ``V_k · I``):

* naive averaging: ``V̄ = (1/K) Σ V_k`` (mode ``mean``);
* averaging + SVD at rank ``r'``: best rank-``r'`` approximation of ``V̄`` (mode ``mean_svd``);
* AJIVE at rank ``k`` (``ajive_k``): ``Σ_k p_k (1 μ_kᵀ + J_k)`` (mode ``ajive``; column centring
  on, initial signal ranks ``k`` for every view — the server's default, where views have rank
  ``r = k`` — joint rank ``k``, identifiability check on);
* ``ajive_k_rR``: the same with initial signal ranks ``R`` (> ``k``): the threshold
  ``τ = (D[R] + D[R+1])/2`` then sits lower, so fewer joint components fail the identifiability
  check. The paper does not state its initial ranks; we report both.

Reported: ``‖V_est − V*‖_F`` and ``‖V_est − V*‖_F / ‖V*‖_F`` vs the number of clients, mean and
standard deviation over seeds. Run ``python -m fedgalore.experiments.ajive_validation [--quick]``;
writes ``benchmarks/results/ajive_validation.{json,png}`` (``ajive_validation_quick.*`` with
``--quick``) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fedgalore.sync.moments import synchronize

__all__ = ["Config", "make_views", "estimate", "run", "main"]

METHODS = ("naive_mean", "mean_svd_5", "mean_svd_15", "ajive_5", "ajive_15", "ajive_5_r10", "ajive_15_r30")


@dataclass
class Config:
    n_rows: int = 200  # N
    n_cols: int = 100  # M
    true_rank: int = 5
    drift_rank: int = 2
    drift: float = 0.5  # entry std of L_k
    sigma: float = 0.1  # entry std of Ξ_k
    clients: tuple[int, ...] = (2, 5, 10, 20, 50)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    methods: tuple[str, ...] = field(default=METHODS)


def make_views(cfg: Config, n_clients: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``V* = (A Bᵀ)^{∘2}`` and the client moments ``V_k = (G* + L_k + Ξ_k)^{∘2}`` (float64, CPU)."""
    g = torch.Generator().manual_seed(int(seed))
    n, m, r = cfg.n_rows, cfg.n_cols, cfg.true_rank
    scale = r ** -0.25
    gstar = (torch.randn(n, r, generator=g, dtype=torch.float64) * scale) @ (torch.randn(m, r, generator=g, dtype=torch.float64) * scale).T
    views = []
    for _ in range(n_clients):
        c = torch.randn(n, cfg.drift_rank, generator=g, dtype=torch.float64)
        d = torch.randn(m, cfg.drift_rank, generator=g, dtype=torch.float64)
        drift = cfg.drift * (c @ d.T) / math.sqrt(cfg.drift_rank)
        noise = cfg.sigma * torch.randn(n, m, generator=g, dtype=torch.float64)
        views.append((gstar + drift + noise) ** 2)
    return gstar**2, views


def estimate(method: str, views: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """``V_est`` for one of :data:`METHODS` (uniform weights), dense ``N × M``."""
    eye = torch.eye(views[0].shape[1], dtype=views[0].dtype)
    pairs = [(v, eye) for v in views]
    w = [1.0] * len(views)
    if method == "naive_mean":
        res = synchronize(pairs, w, "mean", diagnostics=False)
    elif method.startswith("mean_svd_"):
        res = synchronize(pairs, w, "mean_svd", joint_rank=int(method.rsplit("_", 1)[1]), diagnostics=False)
    elif method.startswith("ajive_"):
        parts = method.split("_")
        k = int(parts[1])
        init = int(parts[2][1:]) if len(parts) > 2 else k
        res = synchronize(pairs, w, "ajive", joint_rank=k, seed=seed, diagnostics=False, init_signal_ranks=init)
    else:
        raise ValueError(f"unknown method {method!r}")
    s = res.state
    return s.left @ s.core @ s.right.T


def run(cfg: Config) -> dict:
    """All (clients, seed, method) errors plus per-(clients, method) mean and std."""
    rows = []
    for k in cfg.clients:
        for seed in cfg.seeds:
            vstar, views = make_views(cfg, k, seed)
            ref = float(vstar.norm())
            for method in cfg.methods:
                err = float((estimate(method, views, seed) - vstar).norm())
                rows.append({"clients": k, "seed": seed, "method": method, "error": err, "rel_error": err / ref})
    summary = []
    for k in cfg.clients:
        for method in cfg.methods:
            e = torch.tensor([r["error"] for r in rows if r["clients"] == k and r["method"] == method], dtype=torch.float64)
            rel = torch.tensor([r["rel_error"] for r in rows if r["clients"] == k and r["method"] == method], dtype=torch.float64)
            summary.append({
                "clients": k, "method": method,
                "error_mean": float(e.mean()), "error_std": float(e.std()) if e.numel() > 1 else 0.0,
                "rel_error_mean": float(rel.mean()), "rel_error_std": float(rel.std()) if rel.numel() > 1 else 0.0,
            })
    return {"config": asdict(cfg), "runs": rows, "summary": summary}


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    lines = ["| clients | " + " | ".join(cfg["methods"]) + " |", "|---:|" + "---:|" * len(cfg["methods"])]
    for k in cfg["clients"]:
        cells = []
        for method in cfg["methods"]:
            s = next(x for x in result["summary"] if x["clients"] == k and x["method"] == method)
            cells.append(f"{s['error_mean']:.2f} ± {s['error_std']:.2f} ({s['rel_error_mean']:.3f})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    style = {
        "naive_mean": dict(color="tab:red", ls="--", marker=None, label="Naive averaging"),
        "mean_svd_5": dict(color="tab:blue", ls="-", marker=None, label="Avg + SVD (rank 5)"),
        "mean_svd_15": dict(color="tab:green", ls="-", marker=None, label="Avg + SVD (rank 15)"),
        "ajive_5": dict(color="tab:blue", ls="none", marker="s", label="AJIVE (rank 5)"),
        "ajive_15": dict(color="tab:green", ls="none", marker="o", label="AJIVE (rank 15)"),
        "ajive_5_r10": dict(color="tab:blue", ls=":", marker="^", label="AJIVE (rank 5, init rank 10)"),
        "ajive_15_r30": dict(color="tab:green", ls=":", marker="^", label="AJIVE (rank 15, init rank 30)"),
    }
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for method in cfg["methods"]:
        pts = [x for x in result["summary"] if x["method"] == method]
        ax.errorbar([p["clients"] for p in pts], [p["error_mean"] for p in pts], yerr=[p["error_std"] for p in pts], capsize=3, **style.get(method, {"label": method}))
    ax.set_xscale("log")
    ax.set_xticks(list(cfg["clients"]))
    ax.set_xticklabels([str(k) for k in cfg["clients"]])
    ax.minorticks_off()
    ax.set_xlabel("number of clients")
    ax.set_ylabel(r"$\|V_{est} - V^\star\|_F$")
    ax.set_title(f"N={cfg['n_rows']}, M={cfg['n_cols']}, drift={cfg['drift']}, σ={cfg['sigma']}, {len(cfg['seeds'])} seeds", fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, clients 2/10/50")
    ap.add_argument("--out", default="benchmarks/results", help="output directory")
    args = ap.parse_args(argv)
    cfg = Config(clients=(2, 10, 50), seeds=(0, 1)) if args.quick else Config()
    t0 = time.perf_counter()
    result = run(cfg)
    result["meta"] = {"quick": args.quick, "seconds": time.perf_counter() - t0, "torch": torch.__version__, "python": platform.python_version()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "ajive_validation_quick" if args.quick else "ajive_validation"  # --quick never overwrites the full run
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    print("‖V_est − V*‖_F, mean ± std over seeds (relative error in parentheses)\n")
    print(markdown_table(result))
    return result


if __name__ == "__main__":
    main()
