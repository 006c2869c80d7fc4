"""Figure 3(c): linear connectivity of two client models after one non-IID round.

From one common start (pretrained MiniLM-L6, the task's seeded head, seeded LoRA adapters), two
clients with disjoint label sets (client A: the first ⌈C/2⌉ BBC News topics, client B: the
rest; ``examples_per_client`` articles each) train locally for one round (``epochs`` epochs of
batch 16) with

* ``full``: AdamW on the adapted matrices W and the head (FedAvg-Full's client);
* ``galore``: GaLoreAdamW (rank r, rsvd then seeded random, scale 0.25, one projection seed shared
  by both clients, as FedGaLore broadcasts it) on the same W, AdamW on the head;
* ``lora``: PEFT LoRA (rank r, α = 2r) on the same modules, AdamW on A, B and the head (FedIT's
  client). ``lora`` interpolates the factors (A, B) — what factor averaging does;
  ``lora_merged`` interpolates the merged weights W0 + BA (what exact-aggregation variants do).

Then the held-out loss along the straight line ``θ(λ) = (1 − λ) θ_A + λ θ_B`` (all trained
tensors; λ on a uniform grid) on test articles of every topic, i.e. the global objective the
server's average must do well on. Barrier height (the paper's quantity):
``B = max_{0<λ<1} [L(θ(λ)) − ((1 − λ) L(θ_A) + λ L(θ_B))]``, reported signed (the usual clipped
barrier is ``max(0, B)``); ``B < 0`` means every point of the line, in particular the FedAvg
aggregate of two equally weighted clients, is better than the chord between the endpoints.
Learning rates: each method at every rate of ``lrs`` (one rate for all methods would favour one
family; the table shows all).

Run ``python -m fedgalore.experiments.linear_connectivity [--quick]`` or ``fedgalore repro
linear_connectivity``; writes ``benchmarks/results/linear_connectivity.{json,md,png}``.
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

import numpy as np
import torch

from fedgalore.experiments._common import batches, head, params_by_name, prepare_task
from fedgalore.optim import GaLoreAdamW

__all__ = ["Config", "run", "barrier", "main"]

METHODS = ("full", "galore", "lora")


@dataclass
class Config:
    task: str = "offline_text"
    task_options: dict = field(default_factory=lambda: {"max_length": 64, "test_fraction": 0.2})
    rank: int = 8
    examples_per_client: int = 128
    epochs: int = 2
    batch_size: int = 16
    lrs: tuple[float, ...] = (2e-4, 1e-3)
    seeds: tuple[int, ...] = (0,)
    points: int = 11
    eval_examples: int = 256
    methods: tuple[str, ...] = METHODS


def barrier(lams: list[float], losses: list[float]) -> float:
    """``max_{0<λ<1} [L(λ) − ((1 − λ) L(0) + λ L(1))]`` over the interior grid points, signed.

    Positive: a loss barrier between the two clients (averaging them is worse than either side's
    share); negative: the whole line lies below the chord (the average is better). The usual
    clipped barrier is ``max(0, barrier)``.
    """
    l0, l1 = losses[0], losses[-1]
    return max(l - ((1 - a) * l0 + a * l1) for a, l in list(zip(lams, losses))[1:-1])


def _client_indices(labels: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    classes = np.unique(labels)
    half = (len(classes) + 1) // 2
    rng = np.random.default_rng(seed)
    a = np.flatnonzero(np.isin(labels, classes[:half]))
    b = np.flatnonzero(np.isin(labels, classes[half:]))
    return rng.choice(a, size=min(n, len(a)), replace=False), rng.choice(b, size=min(n, len(b)), replace=False)


def _build(prep, method: str, rank: int, seed: int) -> torch.nn.Module:
    model = prep.task.build_model()
    if method == "lora":
        from fedgalore.methods import get_method

        m = get_method("fedit", rank=rank, adapter_seed=seed)
        return m.setup(model, prep.targets, prep.heads)
    names = {f"{t}.weight" for t in prep.targets} | set(prep.heads)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    return model


def _optimizer(model, prep, method: str, cfg: Config, lr: float, seed: int):
    if method == "galore":
        opt = GaLoreAdamW([
            {"params": params_by_name(model, [f"{t}.weight" for t in prep.targets]), "rank": cfg.rank, "update_proj_gap": 50,
             "scale": 0.25, "projector": "rsvd_then_random", "adaptive_proj_steps": 1},
            {"params": params_by_name(model, prep.heads)},
        ], lr=lr, weight_decay=0.01)
        opt.set_projection_seed(seed)  # the round seed both clients receive
        return opt
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)


def _train(task, model, opt, data) -> float:
    model.train()
    loss = torch.tensor(float("nan"))
    for batch in data:
        loss = task.loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _evaluate(task, model, examples, batch_size: int = 64) -> tuple[float, float]:
    """(mean loss, accuracy) in one pass (``task.evaluate`` reports both)."""
    metrics = task.evaluate(model, examples, batch_size)
    return float(metrics["loss"]), float(metrics["accuracy"])


def _trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def _set(model, values: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for n, v in values.items():
        params[n].copy_(v)


@torch.no_grad()
def _merged(model, prep) -> dict[str, torch.Tensor]:
    """LoRA model -> {raw weight name: W0 + scaling·B A} for every adapted module, + heads."""
    out = {}
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            w = mod.base_layer.weight
            delta = (mod.lora_B["default"].weight @ mod.lora_A["default"].weight) * mod.scaling["default"]
            out[mod_name] = w + delta
    return out


def _line(task, model, a: dict, b: dict, lams, held_out, merged_into=None):
    losses, accs = [], []
    for lam in lams:
        point = {n: (1 - lam) * a[n] + lam * b[n] for n in a}
        if merged_into is None:
            _set(model, point)
            loss, acc = _evaluate(task, model, held_out)
        else:
            loss, acc = merged_into(point)
        losses.append(loss)
        accs.append(acc)
    return losses, accs


def run(cfg: Config) -> dict:
    """Two clients per seed, one local round each from a common start, per method and lr; the
    held-out loss along θ(λ) = (1−λ)θ_A + λθ_B and its barrier (paper Fig. 3c)."""
    # the models' initialisation and dropout draw from torch's global RNG, which each seed
    # reseeds; fork it so the caller's global RNG state is left as it was
    with torch.random.fork_rng(devices=[]):
        return _run(cfg)


def _run(cfg: Config) -> dict:
    torch.set_num_threads(1)
    prep = prepare_task(cfg.task, **cfg.task_options)
    task = prep.task
    test = task.test_set()
    held_out = head(test, cfg.eval_examples)
    lams = [i / (cfg.points - 1) for i in range(cfg.points)]
    labels = np.asarray(task.partition_labels())
    results = []
    for seed in cfg.seeds:
        ia, ib = _client_indices(labels, cfg.examples_per_client, seed)
        steps = int(np.ceil(cfg.epochs * cfg.examples_per_client / cfg.batch_size))
        data_a = batches(task, ia, cfg.batch_size, steps, seed=10 * seed + 1)
        data_b = batches(task, ib, cfg.batch_size, steps, seed=10 * seed + 2)
        for method in cfg.methods:
            start = _build(prep, method, cfg.rank, seed)
            init = _trained(start)
            for lr in cfg.lrs:
                ends = []
                for data in (data_a, data_b):
                    model = copy.deepcopy(start)
                    _set(model, init)
                    torch.manual_seed(seed)
                    _train(task, model, _optimizer(model, prep, method, cfg, lr, seed), data)
                    ends.append((model, _trained(model)))
                (model_a, a), (_, b) = ends
                dist = float(torch.sqrt(sum(((a[n] - b[n]).double() ** 2).sum() for n in a)))
                kinds = [(method, None)]
                if method == "lora":
                    raw = task.build_model()
                    raw_params = dict(raw.named_parameters())

                    def merged_eval(point, _raw=raw, _params=raw_params):
                        with torch.no_grad():
                            for n, v in point.items():
                                _params[n].copy_(v)
                        return _evaluate(task, _raw, held_out)

                    _set(model_a, a)
                    ma = {f"{k}.weight": v for k, v in _merged(model_a, prep).items()}
                    _set(model_a, b)
                    mb = {f"{k}.weight": v for k, v in _merged(model_a, prep).items()}
                    for h in prep.heads:  # the head trains inside the PEFT wrapper: take its trained copies
                        key = next((n for n in a if n.endswith(h) and "original_module" not in n), None)
                        if key is not None:
                            ma[h], mb[h] = a[key], b[key]
                    ma = {_strip(k): v for k, v in ma.items()}
                    mb = {_strip(k): v for k, v in mb.items()}
                    kinds.append(("lora_merged", (ma, mb, merged_eval)))
                for kind, extra in kinds:
                    if extra is None:
                        losses, accs = _line(task, model_a, a, b, lams, held_out)
                    else:
                        ma, mb, fn = extra
                        losses, accs = _line(task, None, ma, mb, lams, held_out, merged_into=fn)
                    results.append({
                        "method": kind, "lr": lr, "seed": seed, "lambdas": lams, "loss": losses, "accuracy": accs,
                        "barrier": barrier(lams, losses), "midpoint_loss": losses[len(lams) // 2],
                        "endpoint_losses": [losses[0], losses[-1]], "distance": dist if kind == method else None,
                    })
                    r = results[-1]
                    print(f"{kind:12s} lr={lr:g} seed={seed}: barrier {r['barrier']:.4f}  L(A)={losses[0]:.4f} "
                          f"L(mid)={r['midpoint_loss']:.4f} L(B)={losses[-1]:.4f}  acc mid {accs[len(lams) // 2]:.3f}", flush=True)
    return {"config": asdict(cfg), "results": results}


def _strip(name: str) -> str:
    """PEFT module path -> raw model parameter name."""
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace(".base_layer", "").replace(".modules_to_save.default", "")


def markdown_table(result: dict) -> str:
    lines = ["| client update | lr | barrier height (mean ± std over seeds) | L(θ_A) | L(midpoint) | L(θ_B) | accuracy at midpoint | ‖θ_A − θ_B‖ |",
             "|---|---|---|---|---|---|---|---|"]
    rows: dict[tuple[str, float], list[dict]] = {}
    for r in result["results"]:
        rows.setdefault((r["method"], r["lr"]), []).append(r)
    for (m, lr), rs in rows.items():
        b = [r["barrier"] for r in rs]
        sd = statistics.stdev(b) if len(b) > 1 else 0.0
        mid = len(rs[0]["lambdas"]) // 2
        dist = [r["distance"] for r in rs if r["distance"] is not None]
        lines.append(f"| {m} | {lr:g} | {statistics.mean(b):.4f} ± {sd:.4f} | {statistics.mean(r['loss'][0] for r in rs):.4f} | "
                     f"{statistics.mean(r['midpoint_loss'] for r in rs):.4f} | {statistics.mean(r['loss'][-1] for r in rs):.4f} | "
                     f"{statistics.mean(r['accuracy'][mid] for r in rs):.3f} | {statistics.mean(dist) if dist else float('nan'):.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = result["config"]["lrs"]
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.8), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        kinds = dict.fromkeys(r["method"] for r in result["results"])
        for m in kinds:
            rs = [r for r in result["results"] if r["method"] == m and r["lr"] == lr]
            if not rs:
                continue
            lam = rs[0]["lambdas"]
            loss = [statistics.mean(r["loss"][i] for r in rs) for i in range(len(lam))]
            ax.plot(lam, loss, marker="o", ms=3, label=m)
        ax.set_title(f"lr {lr:g}")
        ax.set_xlabel("λ  (θ = (1−λ) θ_A + λ θ_B)")
        ax.set_ylabel("held-out loss (all topics)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Linear connectivity after one non-IID round (Fig. 3c), MiniLM-L6 x BBC News")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 articles per client, 1 epoch, 5 points, 64 held-out, lr 1e-3")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0)")
    ap.add_argument("--out", default="benchmarks/results", help="output directory")
    args = ap.parse_args(argv)
    cfg = (Config(examples_per_client=32, epochs=1, points=5, eval_examples=64, lrs=(1e-3,)) if args.quick else Config())
    if args.seeds:
        cfg.seeds = tuple(int(s) for s in args.seeds.split(","))
    t0 = time.perf_counter()
    result = run(cfg)
    result["meta"] = {"quick": args.quick, "seconds": time.perf_counter() - t0, "torch": torch.__version__,
                      "python": platform.python_version(), "platform": platform.platform()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "linear_connectivity_quick" if args.quick else "linear_connectivity"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(result)
    (out / f"{stem}.md").write_text(table + "\n")
    plot(result, out / f"{stem}.png")
    print(table)
    return result


if __name__ == "__main__":
    main()
