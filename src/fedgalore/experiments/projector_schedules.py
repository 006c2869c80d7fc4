"""Appendix E: projector schedules — local training loss versus wall-clock under a fixed step budget.

One client's local training on the offline text task (MiniLM-L6 x BBC News, 64 tokens): the
client holds the first shard of a Dirichlet(0.5) split of the training set into 5 shards. Every
variant runs the SAME mini-batches for the same number of steps from the same start with the same
hyper-parameters (rank r, refresh period τ, lr, scale, batch size); only the projector differs:

* ``rsvd_then_random`` (FedGaLore's schedule, §4): randomized SVD of the gradient at the first
  refresh, then seeded Haar-random orthonormal bases ``P = Q(R_s)`` (``adaptive_proj_steps = 1``);
* ``svd``: the exact top-r singular vectors of the gradient at every refresh (GaLore);
* ``rsvd``: the randomized range finder at every refresh;
* ``random``: a seeded random basis at every refresh, data-independent from the start.

At each refresh the moments are re-projected onto the new basis (the optimizer's
``moment_transfer`` rule, default ``squared``). Variants run interleaved step by step in one
process (variant order rotated every step), so machine load hits all of them alike; we record wall
time and the thread's CPU time (``time.thread_time``, insensitive to other processes; torch runs
single-threaded here). Reported per variant: training-loss curve against cumulative CPU and wall
time, time per step, time spent in projector refreshes, mean loss of the last 10 steps, and the
loss on 256 held-out test articles after the budget. Differences are time per step (refresh cost)
and optimisation per step — never extra steps.

Run ``python -m fedgalore.experiments.projector_schedules [--quick]`` or
``fedgalore repro projector_schedules``; writes ``benchmarks/results/projector_schedules.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fedgalore.experiments._common import batches, head, mean_loss, params_by_name, prepare_task
from fedgalore.federated.partition import PartitionConfig, make_partition
from fedgalore.optim import GaLoreAdamW

__all__ = ["Config", "run", "main"]

VARIANTS = ("rsvd_then_random", "svd", "rsvd", "random")


@dataclass
class Config:
    task: str = "offline_text"
    task_options: dict = field(default_factory=lambda: {"max_length": 64, "test_fraction": 0.2})
    steps: int = 60
    tau: int = 15  # update_proj_gap: refreshes at steps 0, 15, 30, 45
    rank: int = 8
    scale: float = 0.25
    lr: float = 1e-3
    batch_size: int = 16
    shards: int = 5
    alpha: float = 0.5
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_examples: int = 256
    variants: tuple[str, ...] = VARIANTS


def _optimizer(model: torch.nn.Module, prep, projector: str, cfg: Config, seed: int) -> GaLoreAdamW:
    groups = [
        {"params": params_by_name(model, [f"{t}.weight" for t in prep.targets]), "rank": cfg.rank, "update_proj_gap": cfg.tau, "scale": cfg.scale,
         "projector": projector, "adaptive_proj_steps": 1},
        {"params": params_by_name(model, prep.heads)},
    ]
    opt = GaLoreAdamW(groups, lr=cfg.lr, weight_decay=0.01)
    opt.set_projection_seed(seed)
    return opt


def run(cfg: Config) -> dict:
    """All variants × seeds; returns the JSON-able result (curves, times, final losses)."""
    # the models' initialisation and dropout draw from torch's global RNG, which each seed
    # reseeds; fork it so the caller's global RNG state is left as it was
    with torch.random.fork_rng(devices=[]):
        return _run(cfg)


def _run(cfg: Config) -> dict:
    torch.set_num_threads(1)
    prep = prepare_task(cfg.task, **cfg.task_options)
    task = prep.task
    parts = make_partition(task.partition_labels(), cfg.shards, PartitionConfig(kind="dirichlet", alpha=cfg.alpha, min_size=10), 0)
    client = parts[0]
    test = task.test_set()
    held_out = head(test, cfg.eval_examples)
    runs = []
    for seed in cfg.seeds:
        torch.manual_seed(seed)
        base = task.build_model()
        names = {f"{t}.weight" for t in prep.targets} | set(prep.heads)
        for n, p in base.named_parameters():
            p.requires_grad_(n in names)
        data = batches(task, client, cfg.batch_size, cfg.steps, seed=1000 + seed)
        state = {}
        for v in cfg.variants:
            model = copy.deepcopy(base)
            state[v] = {"model": model, "opt": _optimizer(model, prep, v, cfg, seed), "loss": [], "wall": [], "cpu": [],
                        "refresh_cpu": 0.0}
        for step in range(cfg.steps):
            order = list(cfg.variants[step % len(cfg.variants):]) + list(cfg.variants[:step % len(cfg.variants)])
            for v in order:
                s = state[v]
                w0, c0 = time.perf_counter(), time.thread_time()
                loss = task.loss(s["model"], data[step])
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in s["model"].parameters() if p.requires_grad], 1.0)
                s["opt"].step()
                s["opt"].zero_grad(set_to_none=True)
                w1, c1 = time.perf_counter(), time.thread_time()
                s["loss"].append(float(loss.detach()))
                s["wall"].append(w1 - w0)
                s["cpu"].append(c1 - c0)
                if step % cfg.tau == 0:
                    s["refresh_cpu"] += c1 - c0  # a refresh step (projector + re-projection + the step)
        for v in cfg.variants:
            s = state[v]
            plain = [c for i, c in enumerate(s["cpu"]) if i % cfg.tau != 0]
            runs.append({
                "variant": v,
                "seed": seed,
                "loss": s["loss"],
                "cum_wall": _cumsum(s["wall"]),
                "cum_cpu": _cumsum(s["cpu"]),
                "cpu_per_step": sum(s["cpu"]) / cfg.steps,
                "cpu_per_plain_step": statistics.median(plain) if plain else None,
                "cpu_refresh_steps": s["refresh_cpu"],
                "wall_total": sum(s["wall"]),
                "cpu_total": sum(s["cpu"]),
                "last10_loss": statistics.mean(s["loss"][-10:]),
                "heldout_loss": mean_loss(task, s["model"], held_out),
            })
            del s["model"], s["opt"]
    return {"config": asdict(cfg), "client_examples": int(len(client)), "runs": runs, "summary": summarize(runs, cfg)}


def _cumsum(xs: list[float]) -> list[float]:
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


def _ms(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict], cfg: Config) -> dict:
    out = {}
    for v in cfg.variants:
        rs = [r for r in runs if r["variant"] == v]
        out[v] = {k: _ms([r[k] for r in rs]) for k in ("cpu_total", "wall_total", "cpu_refresh_steps", "last10_loss", "heldout_loss")}
        out[v]["cpu_per_plain_step"] = _ms([r["cpu_per_plain_step"] for r in rs if r["cpu_per_plain_step"] is not None])
    ref = out.get("svd")
    if ref:
        for v in cfg.variants:
            out[v]["cpu_total_vs_svd"] = out[v]["cpu_total"][0] / ref["cpu_total"][0]
    return out


def markdown_table(result: dict) -> str:
    s = result["summary"]
    lines = ["| projector | CPU s total (×svd) | CPU s in refresh steps | CPU s per plain step | wall s total | "
             "last-10 train loss | held-out loss |", "|---|---|---|---|---|---|---|"]
    for v, d in s.items():
        lines.append(
            f"| {v} | {d['cpu_total'][0]:.1f} ± {d['cpu_total'][1]:.1f} ({d.get('cpu_total_vs_svd', float('nan')):.2f}×) | "
            f"{d['cpu_refresh_steps'][0]:.2f} | {d['cpu_per_plain_step'][0]:.3f} | {d['wall_total'][0]:.1f} | "
            f"{d['last10_loss'][0]:.4f} ± {d['last10_loss'][1]:.4f} | {d['heldout_loss'][0]:.4f} ± {d['heldout_loss'][1]:.4f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for v in result["config"]["variants"]:
        rs = [r for r in result["runs"] if r["variant"] == v]
        n = len(rs[0]["loss"])
        loss = [statistics.mean(r["loss"][i] for r in rs) for i in range(n)]
        k = 5  # moving average over 5 steps
        smooth = [statistics.mean(loss[max(0, i - k + 1):i + 1]) for i in range(n)]
        cpu = [statistics.mean(r["cum_cpu"][i] for r in rs) for i in range(n)]
        axes[0].plot(cpu, smooth, label=v)
        axes[1].plot(range(1, n + 1), smooth, label=v)
    axes[0].set_xlabel("cumulative CPU time of the client (s)")
    axes[1].set_xlabel("local step")
    for ax in axes:
        ax.set_ylabel("training loss (5-step mean, mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Projector schedules (App. E): same steps and batches, MiniLM-L6 x BBC News client")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 16 steps (tau 4), 64 held-out articles")
    ap.add_argument("--out", default="benchmarks/results", help="output directory")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    args = ap.parse_args(argv)
    cfg = Config(steps=16, tau=4, seeds=(0,), eval_examples=64) if args.quick else Config()
    if args.seeds:
        cfg.seeds = tuple(int(s) for s in args.seeds.split(","))
    t0 = time.perf_counter()
    result = run(cfg)
    result["meta"] = {"quick": args.quick, "seconds": time.perf_counter() - t0, "torch": torch.__version__,
                      "python": platform.python_version(), "platform": platform.platform()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "projector_schedules_quick" if args.quick else "projector_schedules"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(result)
    (out / f"{stem}.md").write_text(table + "\n")
    plot(result, out / f"{stem}.png")
    print(table)
    return result


if __name__ == "__main__":
    main()
