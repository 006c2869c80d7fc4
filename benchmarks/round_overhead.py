"""Round overhead: a federated round's wall time over a bare training loop doing the same steps.

Issue 18, "round overhead".
For each scale — ``tiny_text`` (random BERT, milliseconds per step), ``offline_text`` (MiniLM-L6
× BBC News, 64 tokens, batch 16) and ``offline_math`` (SmolLM2-135M, batch 4) — and each method
(``fedgalore``, ``fedavg_full``), one process runs, interleaved round by round:

* a real round of :class:`fedgalore.engine.loop.Federation` (sequential backend, all
  ``K = 2`` clients, ``T`` local steps each, diagnostics off, checkpoint every round) — timed
  without its evaluation, which is not overhead;
* a bare loop: the same model, the same clients' batches, the same optimizer class and options
  (``GaLoreAdamW`` without the update record / ``AdamW``), the shared ``local_train``, nothing
  else;
* a plain ``transformers`` loop (issue 43: tokens/s per client against a plain single-process
  loop of the same model; goal ≤ 1.05): the same batches and optimizer, ``model(**batch).loss``,
  ``backward``, ``step``, ``zero_grad`` — none of fedgalore's training code (MiniLM and SmolLM2;
  ``tiny_text``'s model computes no loss of its own).

The sequential backend hands payloads over in process (copies, sizes computed exactly); the
checkpoint is the loop's own (:class:`~fedgalore.federated.checkpoint.CheckpointWriter` with
``defer_tensors``: the metadata snapshot in the round's thread — counted — the tensors streamed,
fsync, hash and rename beside the next round's clients, which the other core absorbs; the wait
before the next aggregation, if any, is counted too). Round 1 is a warm-up for both and not counted. The ratio is round time / bare time (goal ≤ 1.03
at MiniLM and SmolLM2). The round is broken down by wrapping the engine's functions (times are
inclusive; ``client: train`` is ``local_train``): server broadcast (build + encode), client
decode, load params, train, rest of the client update (optimizer setup, export of the update,
deltas), upload encode (or in-process copy), server decode + validation, ledger sizes,
aggregate, sync, checkpoint, and the rest (logs, sampling). Single-threaded; the load average is recorded next to every timing. Writes
``benchmarks/results/round_overhead.json``. ``--quick``: tiny and MiniLM only, 2 counted rounds.
"""
# fedgalore-bench: not-in-all (about 10 min single-threaded; run it by name)
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SCALES = {
    "tiny": {"task": {"name": "tiny_text", "options": {"n_train": 256, "n_test": 16}}, "train": {"batch_size": 16, "local_steps": 4}},
    "minilm": {"task": {"name": "offline_text", "options": {"max_length": 64}}, "train": {"batch_size": 16, "local_steps": 4}},
    "smollm2": {"task": {"name": "offline_math", "options": {"n_train": 64, "n_test": 2, "eval_max_new_tokens": 4, "eval_loss": False}},
                "train": {"batch_size": 4, "local_steps": 3}},
}
METHODS = ("fedgalore", "fedavg_full")
#: scales whose task is a Hugging Face model that computes its own loss (``model(**batch).loss``):
#: the plain ``transformers`` loop runs there
PLAIN_SCALES = ("minilm", "smollm2")
CLIENTS = 2


class Clock:
    """Inclusive wall time per wrapped function."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)


def _config(scale: str, method: str, out: str):
    from fedgalore.job.config import FederatedConfig

    s = SCALES[scale]
    opts = {"update_proj_gap": 200, "projector": "rsvd_then_random"} if method == "fedgalore" else {}
    return FederatedConfig.from_dict({
        "name": f"overhead-{scale}", "seed": 0, "task": s["task"],
        "method": {"name": method, "rank": 8, "options": opts},
        "federation": {"num_clients": CLIENTS, "clients_per_round": None, "rounds": 10, "eval_every": 100,
                       "partition": {"kind": "iid"}},
        "train": {"lr": 1e-4, "local_epochs": None, "warmup_ratio": 0.0, **s["train"]},
        "output": {"dir": out, "checkpoint_every": 1, "keep_checkpoints": 1, "progress": "quiet"},
        "device": "cpu", "diagnostics": False,
    })


def _bare_optimizer(method, model, names, tc):
    """The optimizer the method's client builds, without the federated update record."""
    from fedgalore.methods.base import named_params

    params = named_params(model, names)
    if method.name == "fedgalore":
        from fedgalore.optim import GaLoreAdamW

        group = method._galore_group([(n, params[n]) for n in method.targets])
        group["track_cold"] = False  # the shadow cold moment exists for the federated diagnostics only
        groups = [group] + ([{"params": [(n, params[n]) for n in method.heads], "lr": tc.head_lr or tc.lr}] if method.heads else [])
        return GaLoreAdamW(groups, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay), params
    groups = [{"params": [params[n] for n in method.targets], "lr": tc.lr}]
    if method.heads:
        groups.append({"params": [params[n] for n in method.heads], "lr": tc.head_lr or tc.lr})
    return torch.optim.AdamW(groups, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay), params


def bare_round(fed, k: int) -> float:
    """The same clients' steps of round ``k`` with a plain optimizer and ``local_train``."""
    from fedgalore.federated.client import local_train
    from fedgalore.federated.seeding import client_seed
    from fedgalore.protocol.state import ClientContext

    rt, method, tc = fed.runtime, fed.method, fed.cfg.train
    t0 = time.perf_counter()
    for c in range(CLIENTS):
        gen, steps = rt.batches(c, k)
        ctx = ClientContext(round=k, total_rounds=fed.cfg.federation.rounds, client=c, round_seed=0, num_examples=len(rt.parts[c]),
                            train=tc, target_modules=rt.target_modules, head_params=rt.head_params, loss_fn=rt.task.loss,
                            batches=gen, steps=steps, steps_per_round=rt.steps_per_round, device=rt.device)
        opt, params = _bare_optimizer(method, rt.model, method.targets + method.heads, tc)
        if method.name == "fedgalore":
            opt.set_projection_seed(int(client_seed(fed.cfg.seed, k, c, 9).generate_state(1)[0]))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(k * 100 + c)
            local_train(rt.model, opt, ctx, params.values())
    return time.perf_counter() - t0


def plain_round(fed, k: int) -> tuple[float, int]:
    """The same clients' batches of round ``k`` in a plain single-process ``transformers`` loop
    (issue 43's reference for tokens/s): ``model(**batch).loss``, ``backward``, the same optimizer
    class and options as :func:`bare_round`, ``step``, ``zero_grad`` — no fedgalore training code.
    Returns the seconds and the tokens (attention-mask ones; rows for a task without a mask)."""
    rt, method, tc = fed.runtime, fed.method, fed.cfg.train
    model = rt.model
    tokens = 0
    t0 = time.perf_counter()
    for c in range(CLIENTS):
        gen, _ = rt.batches(c, k)
        opt, _ = _bare_optimizer(method, model, method.targets + method.heads, tc)
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(k * 100 + c)
            for batch in gen():
                mask = batch.get("attention_mask")
                tokens += int(mask.sum()) if mask is not None else int(next(iter(batch.values())).shape[0])
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, tokens


def measure(scale: str, method: str, rounds: int) -> dict:
    from fedgalore.engine import loop as server_mod
    from fedgalore.engine.loop import Federation
    from fedgalore.federated.checkpoint import CheckpointWriter
    from fedgalore.protocol.payload import Ledger

    base = importlib.import_module("fedgalore.engine.runtime")
    meth_mod = importlib.import_module(f"fedgalore.methods.{'fedgalore' if method == 'fedgalore' else 'fedavg_full'}")
    clock = Clock()
    out = tempfile.mkdtemp(prefix="overhead-")
    cfg = _config(scale, method, out)
    fed = Federation(cfg)
    m = fed.method
    clock.wrap(m, "broadcast", "server: broadcast build")
    clock.wrap(server_mod, "encode", "server: broadcast encode")
    clock.wrap(server_mod, "encoded_size", "server: broadcast size (in process)")
    clock.wrap(Ledger, "record", "server: ledger records (upload sizes)")
    clock.wrap(base, "decode", "client: decode broadcast")
    clock.wrap(base, "transfer", "client: copy broadcast/upload (in process)")
    clock.wrap(meth_mod, "load_params", "client: load params")
    clock.wrap(meth_mod, "local_train", "client: train (local_train)")
    clock.wrap(m, "client_update", "client: client_update (all)")
    clock.wrap(base, "encode", "client: encode upload")
    clock.wrap(server_mod, "decode", "server: decode uploads")
    clock.wrap(server_mod, "validate_upload", "server: validate uploads")
    clock.wrap(m, "aggregate", "server: aggregate")
    clock.wrap(m, "synchronize", "server: sync")
    clock.wrap(fed.task, "evaluate", "evaluation (excluded)")
    rows = []
    # the loop's writer: the state's tensors are streamed beside the next round's clients, and the
    # round waits for them before its aggregation (Federation._checkpoint_wait, timed below)
    fed._writer = CheckpointWriter(fed.run_dir, keep=1)
    clock.wrap(fed, "_checkpoint_wait", "server: checkpoint wait (this thread)")
    for k in range(rounds + 1):
        clock.t.clear()
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        fed._round(k)
        tc0 = time.perf_counter()
        fed._checkpoint(k, t0)
        t_ckpt = time.perf_counter() - tc0
        t_round = time.perf_counter() - t0 - clock.t.get("evaluation (excluded)", 0.0)
        t_bare = bare_round(fed, k)
        t_plain, tokens = plain_round(fed, k) if scale in PLAIN_SCALES else (None, None)
        parts = dict(clock.t)
        parts["server: checkpoint (this thread)"] = t_ckpt
        parts["client: rest of client_update (optimizer setup, export)"] = (
            parts.get("client: client_update (all)", 0.0) - parts.get("client: load params", 0.0) - parts.get("client: train (local_train)", 0.0))
        parts.pop("client: client_update (all)", None)
        parts.pop("evaluation (excluded)", None)
        named = sum(v for kk, v in parts.items() if kk != "client: train (local_train)")
        parts["rest (ledger, logs, sampling)"] = t_round - parts.get("client: train (local_train)", 0.0) - named
        rows.append({"round": k + 1, "warmup": k == 0, "round_s": t_round, "bare_s": t_bare, "ratio": t_round / t_bare,
                     "plain_transformers_s": t_plain, "tokens": tokens, "ratio_vs_plain": t_plain and t_round / t_plain,
                     "breakdown_s": parts, "loadavg_1min": load})
        vs_plain = f", vs plain transformers {t_plain:7.3f} s = {t_round / t_plain:5.3f}x" if t_plain else ""
        print(f"  {scale:8s} {method:11s} round {k + 1}: {t_round:7.3f} s vs bare {t_bare:7.3f} s = {t_round / t_bare:5.3f}x"
              f"{vs_plain} (load {load:.1f})", flush=True)
    fed._writer.wait()
    fed.backend.close()
    counted = [r for r in rows if not r["warmup"]]
    mean = lambda key: sum(r[key] for r in counted) / len(counted)  # noqa: E731
    breakdown = {kk: sum(r["breakdown_s"].get(kk, 0.0) for r in counted) / len(counted) for kk in counted[0]["breakdown_s"]}
    params = sum(p.numel() for p in fed.runtime.model.parameters())
    return {"scale": scale, "method": method, "params": params, "steps_per_client": fed.cfg.train.local_steps,
            "batch": fed.cfg.train.batch_size, "rounds": rows, "round_s": mean("round_s"), "bare_s": mean("bare_s"),
            "ratio": mean("round_s") / mean("bare_s"), "breakdown_s": breakdown,
            **({"plain_transformers_s": mean("plain_transformers_s"), "ratio_vs_plain": mean("round_s") / mean("plain_transformers_s"),
                "tokens_per_round": mean("tokens"), "tokens_per_s_round": mean("tokens") / mean("round_s"),
                "tokens_per_s_plain": mean("tokens") / mean("plain_transformers_s")} if scale in PLAIN_SCALES else {}),
            "overhead_s": mean("round_s") - breakdown.get("client: train (local_train)", 0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny and MiniLM, 2 counted rounds")
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds per cell (after one warm-up)")
    ap.add_argument("--scales", nargs="+", choices=tuple(SCALES), help="only these scales (default: all; --quick: tiny, minilm)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="only these methods")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/round_overhead.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    scales = tuple(args.scales) if args.scales else ("tiny", "minilm") if args.quick else tuple(SCALES)
    rounds = 2 if args.quick else args.rounds
    t0, load0 = time.perf_counter(), os.getloadavg()
    cells = [measure(s, m, rounds) for s in scales for m in args.methods]
    res = {"meta": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "clients": CLIENTS,
                    "loadavg_start": load0, "loadavg_end": os.getloadavg(), "seconds": time.perf_counter() - t0},
           "cells": cells}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.quick and args.out.endswith("round_overhead.json"):
        args.out = args.out.replace("round_overhead.json", "round_overhead_quick.json")
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("\n| scale | method | params | round (s) | bare loop (s) | ratio | overhead (s) | plain transformers (s) | ratio | tokens/s round / plain |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in cells:
        plain = (f"{c['plain_transformers_s']:.3f} | {c['ratio_vs_plain']:.3f} | {c['tokens_per_s_round']:.0f} / {c['tokens_per_s_plain']:.0f}"
                 if "ratio_vs_plain" in c else "– | – | –")
        print(f"| {c['scale']} | {c['method']} | {c['params'] / 1e6:.1f} M | {c['round_s']:.3f} | {c['bare_s']:.3f} | {c['ratio']:.3f} | "
              f"{c['overhead_s']:.3f} | {plain} |")
    print("\nbreakdown (s per round, mean over counted rounds):")
    for c in cells:
        print(f"{c['scale']} {c['method']}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(c["breakdown_s"].items(), key=lambda kv: -kv[1])))
    print(f"load average {load0} -> {os.getloadavg()}; {time.perf_counter() - t0:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
