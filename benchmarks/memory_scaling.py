"""Memory per component of a federated round at three model sizes, the fit, and the Llama-2-7B plan.

Issue 18 ("Cost at the limit"), Llama-2-7B plan. Every measured run is a real ``fedgalore.run``
federation (sequential backend, CPU — here the "accelerator" and the host are one pool) in a
fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers leave the resident set, so
resident = live), single-threaded, one heavy process at a time. Per phase — model build, server
state, broadcast encode/decode, client training, upload encode/decode, aggregation, sync,
diagnostics, checkpoint, evaluation — :class:`fedgalore.memory.PeakTracker` records the peak
resident set above the process baseline (task data and libraries loaded). Exact component sizes
are counted from the live objects (:func:`fedgalore.memory.tensor_bytes`): model, trained
parameters (= gradients), optimizer state at its largest step, server state, broadcast and
upload blobs.

Sizes (the SmolLM2 tokenizer, vocabulary 49,152, tied embeddings, 2 clients, 2 rounds, 2 local
optimizer steps of 2 sequences, r = 32, τ = 1, eval on 2 problems):

* ``smollm2-135m`` — the offline asset, fp32 (the ``offline_math`` task);
* ``llama-0.36b`` — random-weight Llama (hidden 1024, MLP 2816, 24 layers), bf16;
* ``llama-0.61b`` — random-weight Llama (hidden 2048, MLP 5504, 10 layers), bf16: the largest
  whose full FedGaLore round (fp32 server copies, broadcast blob + decoded copy, dense
  diagnostics) stays under the 10 GiB this machine allows;
* ``llama-1.0b`` — (hidden 2048, MLP 5504, 18 layers), bf16: activations, gradients and the
  optimizer state only (a full round would need ~14 GiB here).

Activations: one forward with autograd graph at 2 × {64, 128} tokens, with and without gradient
checkpointing, per size; ``fedgalore.plan.ACT_COEF`` is fitted on them (least squares per layer
and token, logits counted analytically). The plan's exact components (``fedgalore.plan``, from
the shape miniature) are checked against the measured ones at every size.

Writes ``benchmarks/results/memory_scaling.json`` and ``benchmarks/results/memory_plan.md``
(measured table, fit, and ``fedgalore plan`` for ``conf/pipeline/metamath_llama2.yaml``).
Run: ``python benchmarks/memory_scaling.py`` (about 15–20 min on one core) or ``--quick``
(SmolLM2 and 0.36B only).
"""
# fedgalore-bench: not-in-all (about 20 min of single-threaded runs; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

LLAMA = {
    "llama-0.36b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16),
    "llama-0.61b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=16),
    "llama-1.0b": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=16),
}
ROUND_SIZES = ("smollm2-135m", "llama-0.36b", "llama-0.61b")
RANK, CLIENTS, ROUNDS, STEPS, BATCH = 32, 2, 2, 2, 2
GIB = 1024**3


# ============================================================================ child: one measured run
def _threads() -> None:
    import torch

    torch.set_num_threads(1)


def _llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048, **LLAMA[name])


def _task(name: str):
    """offline_math (SmolLM2 tokenizer and data), with a random-weight Llama for the larger sizes."""
    import torch

    from fedgalore.tasks.paper_math.gsm_symbolic import OfflineGsmSymbolicTask

    class RandomLlamaMath(OfflineGsmSymbolicTask):
        def build_model(self):
            from transformers import LlamaForCausalLM

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = LlamaForCausalLM(_llama_config(name)).to(torch.bfloat16)
            model.eval()
            return model

    opts = dict(n_train=16, n_test=2, max_length=160, eval_max_new_tokens=4, eval_loss=False)
    return OfflineGsmSymbolicTask(**opts) if name == "smollm2-135m" else RandomLlamaMath(**opts)


def _config(name: str, method: str, out_dir: str):
    from fedgalore.job.config import FederatedConfig

    options = {"update_proj_gap": 1, "adaptive_proj_steps": 1} if method.startswith("fedgalore") else {}
    return FederatedConfig.from_dict({
        "name": f"mem-{name}", "seed": 0,
        "task": {"name": "offline_math", "options": {}},
        "method": {"name": method, "rank": RANK, "options": options},
        "federation": {"num_clients": CLIENTS, "clients_per_round": None, "rounds": ROUNDS, "eval_every": ROUNDS,
                       "eval_batch_size": 2, "partition": {"kind": "iid"}},
        "train": {"lr": 1e-4, "batch_size": BATCH, "local_steps": STEPS, "local_epochs": None, "warmup_ratio": 0.0},
        "output": {"dir": out_dir, "checkpoint_every": 1, "keep_checkpoints": 1, "progress": "quiet"},
        "device": "cpu", "diagnostics": name == "smollm2-135m",  # dense diagnostics: (K + 1) S more, measured where it fits
    })


def child_round(name: str, method: str, out: Path) -> None:
    """One measured federation: per-phase peaks and exact component sizes."""
    _threads()
    import importlib

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from fedgalore.engine import loop as server_mod
    from fedgalore.engine.loop import Federation
    from fedgalore.memory import PeakTracker, rss_bytes, tensor_bytes

    backends_base = importlib.import_module("fedgalore.engine.runtime")
    tracker = PeakTracker()
    task = _task(name)
    tmp = tempfile.mkdtemp(prefix="memscale-")
    cfg = _config(name, method, tmp)
    opt_peak = [0]
    handle = register_optimizer_step_post_hook(lambda opt, *a: opt_peak.__setitem__(0, max(opt_peak[0], tensor_bytes(dict(opt.state)))))
    tracker.wrap(task, "build_model", "model_build")
    tracker.wrap(task, "evaluate", "evaluation")
    tracker.wrap(server_mod.CheckpointWriter, "save", "checkpoint")
    tracker.wrap(server_mod, "drift_diagnostics", "diagnostics")
    copy = backends_base.transfer  # in process: the client's copy of the broadcast, then the server's of the upload

    def transfer(payload):
        with tracker.phase("upload" if "num_examples" in payload.meta else "broadcast"):  # every upload names its example count
            return copy(payload)

    backends_base.transfer = transfer
    tracker.wrap(backends_base.Runtime, "execute", "client")
    baseline = rss_bytes()
    t0 = time.perf_counter()
    with tracker.phase("setup"):
        fed = Federation(cfg, task=task)
    method_obj = fed.method
    tracker.wrap(method_obj, "client_update", "client_update")
    tracker.wrap(method_obj, "aggregate", "aggregation")
    tracker.wrap(method_obj, "synchronize", "sync")
    tracker.wrap(method_obj, "client_deltas", "client_deltas")
    with tracker.phase("run"):
        fed.run()
    seconds = time.perf_counter() - t0
    handle.remove()
    model = fed.runtime.model
    recs = fed.ledger.records
    last = max(r["round"] for r in recs)
    comp = {
        "model": tensor_bytes(list(model.parameters())),
        "trained": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "optimizer_state": opt_peak[0],
        "server_state": tensor_bytes([fed.state.params, fed.state.extras, getattr(fed.state, "moments", {})]),
        "broadcast_blob": max(r["bytes"] for r in recs if r["direction"] == "down" and r["round"] == last),
        "broadcast_blob_round1": max(r["bytes"] for r in recs if r["direction"] == "down" and r["round"] == 1),
        "upload_blob": max(r["bytes"] for r in recs if r["direction"] == "up"),
    }
    res = {"size": name, "method": method, "baseline_rss": baseline, "seconds": seconds, "loadavg": os.getloadavg(),
           "params": sum(p.numel() for p in model.parameters()), "dtype": str(next(model.parameters()).dtype),
           "components": comp, "peaks": tracker.peaks(baseline), "records": tracker.records}
    out.write_text(json.dumps(res, indent=1, default=str))


def child_activations(name: str, out: Path) -> None:
    """Forward-with-graph memory at 2 × {64, 128} tokens, with and without checkpointing; gradients
    and optimizer state of one GaLore step (targets only, as the methods train)."""
    _threads()
    import torch

    from fedgalore.memory import PeakTracker, rss_bytes, tensor_bytes
    from fedgalore.tasks.base import resolve_target_modules
    from fedgalore.tasks.paper_math.base import LLAMA_TARGET_MODULES

    tracker = PeakTracker()
    if name == "smollm2-135m":
        model = _task(name).build_model()
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(_llama_config(name)).to(torch.bfloat16)
    cfg = model.config
    targets = [m + ".weight" for m in resolve_target_modules(model, LLAMA_TARGET_MODULES)]
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    for t in targets:
        params[t].requires_grad_(True)
    model.config.use_cache = False
    model.train()
    rows = []
    g = torch.Generator().manual_seed(0)
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        warm = torch.randint(5, cfg.vocab_size, (BATCH, 32), generator=g)
        model(input_ids=warm, labels=warm).loss.backward()  # one-time allocations (RoPE tables, workspaces)
        model.zero_grad(set_to_none=True)
        for tokens in (64, 128):
            ids = torch.randint(5, cfg.vocab_size, (BATCH, tokens), generator=g)
            before = rss_bytes()
            hidden = model.model(input_ids=ids).last_hidden_state  # the decoder body's graph, no logits
            body = rss_bytes() - before
            del hidden
            before = rss_bytes()
            with tracker.phase("forward"):
                loss = model(input_ids=ids, labels=ids).loss
            after_fwd = rss_bytes()
            with tracker.phase("backward"):
                loss.backward()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
            bwd_peak = tracker.records[-1]["peak"]
            del loss
            model.zero_grad(set_to_none=True)
            rows.append({"checkpointing": ckpt, "tokens": tokens, "batch": BATCH, "forward_graph_body": body,
                         "forward_graph": after_fwd - before, "forward_peak": tracker.records[-2]["peak"] - before,
                         "backward_peak": bwd_peak - before, "grads": grads})
    # one optimizer step of GaLore (the FedGaLore client's optimizer) on the targets
    from fedgalore.optim import GaLoreAdamW, client_protocol

    opt = GaLoreAdamW([{"params": [(t, params[t]) for t in targets], "rank": RANK, "update_proj_gap": 1, "scale": 0.25,
                        "proj_type": "std", "projector": "rsvd_then_random"}], lr=1e-4)
    opt.set_projection_seed(1)
    client_protocol.mark(opt)
    for _ in range(STEPS):
        for t in targets:
            params[t].grad = torch.randn(params[t].shape, generator=g).to(params[t].dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
    res = {"size": name, "params": sum(p.numel() for p in model.parameters()), "dtype": str(next(model.parameters()).dtype),
           "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
           "model": tensor_bytes(list(model.parameters())), "trained": sum(params[t].numel() * params[t].element_size() for t in targets),
           "galore_state_after_2_refreshes": tensor_bytes(dict(opt.state)), "rows": rows, "loadavg": os.getloadavg()}
    out.write_text(json.dumps(res, indent=1))


# ============================================================================ parent
def _run_child(args: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="memscale-out-")) / "r.json"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, *args, "--out", str(out)], check=True, env=env, cwd=ROOT)
    res = json.loads(out.read_text())
    print(f"  {' '.join(args)}: {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    return res


def fit_activations(acts: list[dict]) -> dict:
    """The coefficients of :func:`fedgalore.plan.activation_bytes` from the forward graphs.

    Decoder body without checkpointing, per token and layer, in model-dtype values: ``a (h + i)``
    — ``h`` and ``i`` are nearly proportional in every model here, so one coefficient per dtype
    (the median over sizes and token counts; the spread is reported). With checkpointing, per
    token: ``(c L + d) h`` by least squares over sizes. Logits: full forward − body, per token and
    vocabulary entry, per dtype (median)."""
    import numpy as np

    def values(a, r):
        size = 2 if "bfloat16" in a["dtype"] else 4
        return r["forward_graph_body"] / (r["batch"] * r["tokens"]) / size

    pts = [(a, r) for a in acts for r in a["rows"]]
    fit: dict = {}
    spread: dict = {}
    for dt in sorted({a["dtype"].replace("torch.", "") for a in acts}):
        per = [values(a, r) / (a["layers"] * (a["hidden"] + a["intermediate"])) for a, r in pts
               if not r["checkpointing"] and a["dtype"].endswith(dt)]
        fit[f"layer_values_{dt}"] = float(np.median(per))
        spread[f"layer_values_{dt}"] = [float(min(per)), float(max(per))]
        lg = [(r["forward_graph"] - r["forward_graph_body"]) / (r["batch"] * r["tokens"]) / a["vocab"] for a, r in pts if a["dtype"].endswith(dt)]
        fit[f"logits_bytes_per_vocab_{dt}"] = float(np.median(lg))
        spread[f"logits_bytes_per_vocab_{dt}"] = [float(min(lg)), float(max(lg))]
    x = [[a["layers"] * a["hidden"], a["hidden"]] for a, r in pts if r["checkpointing"]]
    y = [values(a, r) for a, r in pts if r["checkpointing"]]
    (c, d), *_ = np.linalg.lstsq(np.array(x, float), np.array(y, float), rcond=None)
    fit.update({"checkpointed_per_layer_hidden": float(c), "checkpointed_extra_hidden": float(d)})
    fit["spread"] = spread
    return fit


PHASES = {"broadcast": "broadcast", "client_training": "client_update", "upload": "upload",
          "aggregation": "aggregation", "diagnostics": "diagnostics", "evaluation": "evaluation", "checkpoint": "checkpoint"}


def composition(run: dict, act: dict | None) -> dict:
    """The plan's per-phase formula (:func:`fedgalore.plan.phase_peaks`, CPU: one pool) applied
    to the *measured* exact components, next to the measured phase peaks."""
    from fedgalore.methods.base import method_class
    from fedgalore.plan import ADAMW_STEP_TRANSIENT, activation_bytes, phase_peaks

    import torch

    c = run["components"]
    A = 0
    if act is not None:
        arch = {"causal_lm": True, "layers": act["layers"], "hidden": act["hidden"], "intermediate": act["intermediate"], "vocab": act["vocab"]}
        A = activation_bytes(arch, BATCH, 160, torch.bfloat16 if "bfloat16" in act["dtype"] else torch.float32, checkpointing=False)
    comp = {"model": c["model"], "gradients": c["trained"], "optimizer_state": c["optimizer_state"], "activations": A,
            "server_state": c["server_state"], "broadcast_blob": c["broadcast_blob"], "upload_blob": c["upload_blob"], "eval_kv_cache": 0,
            "optimizer_step_transient": int(ADAMW_STEP_TRANSIENT["cpu"] * c["trained"]) if run["method"] == "fedavg_full" else 0}
    pred = phase_peaks(comp, CLIENTS, True, run["size"] == "smollm2-135m", method_class(run["method"]).traits.uploads_dense_deltas)
    out = {}
    for phase, v in pred.items():
        meas = run["peaks"].get(PHASES[phase])
        out[phase] = {"predicted": v["host"], "measured": meas, "ratio": (meas / v["host"]) if meas and v["host"] else None}
    return out


def _gib(x) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def write_markdown(out: dict, path: Path) -> None:
    lines = ["# Memory plan: measured components at three sizes and the Llama-2-7B plan (issue 18)", "",
             f"Machine: {out['meta']['machine']}, {out['meta']['cpus']} cores, torch {out['meta']['torch']}, one thread, "
             f"`MALLOC_MMAP_THRESHOLD_=65536`, one measured process at a time; load average during the runs "
             f"{min(r['loadavg'][0] for r in out['runs'] + out['activations']):.1f}–{max(r['loadavg'][0] for r in out['runs'] + out['activations']):.1f} "
             f"(other jobs on the machine). `python benchmarks/memory_scaling.py`"
             + (f" ({out['meta']['seconds'] / 60:.0f} min)." if out["meta"]["seconds"] else "."), "",
             "## Measured runs (FedGaLore unless noted; GiB above the process baseline)", "",
             "| size | method | params | dtype | model W | grads G | optimizer O | server S | broadcast B | upload U | "
             "peak: client training | aggregation | diagnostics | checkpoint | evaluation |",
             "|---|---|---:|---|" + "---:|" * 11]
    for r in out["runs"]:
        c, p = r["components"], r["peaks"]
        lines.append(f"| {r['size']} | {r['method']} | {r['params'] / 1e9:.2f} B | {r['dtype'].replace('torch.', '')} | {_gib(c['model'])} | "
                     f"{_gib(c['trained'])} | {_gib(c['optimizer_state'])} | {_gib(c['server_state'])} | {_gib(c['broadcast_blob'])} | "
                     f"{_gib(c['upload_blob'])} | {_gib(p.get('client_update'))} | {_gib(p.get('aggregation'))} | "
                     f"{_gib(p.get('diagnostics'))} | {_gib(p.get('checkpoint'))} | {_gib(p.get('evaluation'))} |")
    phases = list(PHASES)
    lines += ["", "Composition check: the plan's per-phase formula (`fedgalore.plan.phase_peaks`) on the exact components vs the "
              "measured peak, GiB measured / predicted (ratio):", "",
              "| size | method | " + " | ".join(p.replace("_", " ") for p in phases) + " |", "|---|---|" + "---:|" * len(phases)]
    for r in out["runs"]:
        comp = r["composition"]
        cells = [f"{_gib(comp[k]['measured'])} / {_gib(comp[k]['predicted'])} ({comp[k]['ratio']:.2f})" if k in comp and comp[k]["ratio"] else "–"
                 for k in phases]
        lines.append(f"| {r['size']} | {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "Plan vs measured exact components (bytes; the plan maps the shape miniature back):", "",
              "| size | method | component | measured | plan |", "|---|---|---|---:|---:|"]
    for r in out["runs"]:
        for k, (meas, plan) in r.get("plan_check", {}).items():
            lines.append(f"| {r['size']} | {r['method']} | {k} | {meas:,} | {plan:,} |")
    lines += ["", "## Activations (forward graph, 2 sequences)", "",
              "| size | layers | hidden | MLP | tokens | checkpointing | forward graph (MiB) | backward peak (MiB) | grads (MiB) |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for a in out["activations"]:
        for r in a["rows"]:
            lines.append(f"| {a['size']} | {a['layers']} | {a['hidden']} | {a['intermediate']} | {r['tokens']} | {r['checkpointing']} | "
                         f"{r['forward_graph'] / 2**20:.0f} | {r['backward_peak'] / 2**20:.0f} | {r['grads'] / 2**20:.0f} |")
    f = out["activation_fit"]
    lines += ["", "Fit (`fedgalore.plan.ACT_COEF`; per token, model-dtype values): without checkpointing "
              + ", ".join(f"{k.split('_')[-1]} {v:.2f}·L(h+i) (sizes {f['spread'][k][0]:.2f}–{f['spread'][k][1]:.2f})"
                          for k, v in f.items() if k.startswith("layer_values_"))
              + f"; with checkpointing ({f['checkpointed_per_layer_hidden']:.2f}·L + {f['checkpointed_extra_hidden']:.1f})·h plus one "
              "recomputed layer; logits " + ", ".join(f"{k.split('_')[-1]} {v:.2f} B" for k, v in f.items() if k.startswith("logits_bytes"))
              + " per vocabulary entry.", "",
              "## Llama-2-7B: `fedgalore plan --config conf/pipeline/metamath_llama2.yaml`", "", out["plan_markdown"],
              "### The same with `diagnostics=true` (dense per-client deltas on the host)", "",
              out["plan_markdown_with_diagnostics"].split("## Memory", 1)[1].split("\n", 1)[1]]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 and 0.36B only")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--assemble", nargs="+", metavar="JSON", help="skip the measurements: post-process these child results")
    ap.add_argument("--measured-minutes", type=float, help="with --assemble: how long the measurements took (for the record)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        (child_round if kind == "round" else child_activations)(*rest, Path(args.out))
        return 0
    import torch

    t0, load0 = time.perf_counter(), os.getloadavg()
    sizes = ROUND_SIZES[:2] if args.quick else ROUND_SIZES
    acts_sizes = sizes if args.quick else (*ROUND_SIZES, "llama-1.0b")
    runs, acts = [], []
    if args.assemble:
        for f in args.assemble:
            res = json.loads(Path(f).read_text())
            (runs if "components" in res else acts).append(res)
    else:
        for name in acts_sizes:
            acts.append(_run_child(["--child", "activations", name]))
        for name in sizes:
            methods = ["fedgalore"] + (["fedavg_full"] if name != "llama-0.61b" else [])
            for method in methods:
                runs.append(_run_child(["--child", "round", name, method]))
    coef = fit_activations(acts)
    from fedgalore.plan import ACT_COEF

    ACT_COEF.update({k: v for k, v in coef.items() if k != "spread"})
    by_size = {a["size"]: a for a in acts}
    for r in runs:
        r.pop("records", None)
        r["composition"] = composition(r, by_size.get(r["size"]))
        r["plan_check"] = plan_check(r)
    from fedgalore.cli import _load_config
    from fedgalore.plan import format_plan, make_plan

    cfg, section = _load_config(str(ROOT / "conf/pipeline/metamath_llama2.yaml"), [])
    plan = make_plan(cfg, section.get("methods"), section.get("method_options"))
    cfg_diag, _ = _load_config(str(ROOT / "conf/pipeline/metamath_llama2.yaml"), ["diagnostics=true"])
    plan_diag = make_plan(cfg_diag, section.get("methods"), section.get("method_options"))
    out = {"meta": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "machine": platform.processor() or platform.machine(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                    "seconds": (60 * args.measured_minutes if args.measured_minutes else None) if args.assemble else time.perf_counter() - t0,
                    "assembled_from_child_results": bool(args.assemble), "malloc_mmap_threshold": 65536, "threads": 1,
                    "setting": {"rank": RANK, "clients": CLIENTS, "rounds": ROUNDS, "local_steps": STEPS, "batch": BATCH}},
           "activations": acts, "activation_fit": coef, "runs": runs, "llama2_7b_plan": plan, "plan_markdown": format_plan(plan),
           "llama2_7b_plan_with_diagnostics": plan_diag, "plan_markdown_with_diagnostics": format_plan(plan_diag)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "memory_scaling_quick" if args.quick else "memory_scaling"
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    write_markdown(out, RESULTS / ("memory_plan_quick.md" if args.quick else "memory_plan.md"))
    print(format_plan(plan))
    print(f"activation fit {coef}")
    return 0


def plan_check(run: dict) -> dict:
    """The plan's exact components for the measured configuration (from the shape miniature of the
    same model) next to the measured ones."""
    from fedgalore.job.config import FederatedConfig
    from fedgalore.plan import ModelSpec, probe_method

    import torch
    from transformers import LlamaConfig

    from fedgalore.tasks.base import resolve_target_modules
    from fedgalore.tasks.assets import smollm2_path
    from fedgalore.tasks.paper_math.base import LLAMA_TARGET_MODULES

    if run["size"] == "smollm2-135m":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(smollm2_path())
        dtype = torch.float32
    else:
        config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048, **LLAMA[run["size"]])
        dtype = torch.bfloat16
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec([(n, tuple(p.shape)) for n, p in model.named_parameters()], resolve_target_modules(model, LLAMA_TARGET_MODULES),
                     [], dtype, {"causal_lm": True})
    cfg = _config(run["size"], run["method"], tempfile.mkdtemp())
    cfg = FederatedConfig.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"]}})
    probe = probe_method(cfg, spec, run["method"], dict(cfg.method.options), [STEPS] * CLIENTS)
    c = run["components"]
    return {"model": (c["model"], probe.model), "trained (gradients)": (c["trained"], probe.trained),
            "optimizer state": (c["optimizer_state"], probe.optimizer_state), "server state": (c["server_state"], probe.server_state),
            "broadcast blob (round 2)": (c["broadcast_blob"], probe.down), "broadcast blob (round 1)": (c["broadcast_blob_round1"], probe.down_first),
            "upload blob": (c["upload_blob"], probe.up)}


if __name__ == "__main__":
    sys.exit(main())
