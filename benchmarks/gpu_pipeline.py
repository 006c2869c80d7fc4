"""The paper's Llama-2-7B pipeline (conf/pipeline/metamath_llama2.yaml) on one GPU: memory and time per phase.

Issue 18 ("where a GPU machine is available, run the paper pipelines' first rounds on it and
record memory and time"). No hub: the model is a **random-weight Llama-2-7B** (the
architecture of meta-llama/Llama-2-7b-hf: hidden 4096, MLP 11008, 32 layers, 32 heads; the
vocabulary of the tokenizer used, SmolLM2's 49,152 instead of 32,000, so +0.14 B parameters),
written once to a local folder in bf16 and loaded by the pipeline's own ``metamath`` task
(``task.options.model=<folder>``); the data are synthetic MetaMathQA/GSM8K/MATH-shaped records
whose responses fill the pipeline's 1,024-token window. Everything else is the pipeline file:
4 clients, full participation, micro-batch 2 × 32 accumulation, gradient checkpointing, r = 32,
bf16, ``device: cuda``. What is shortened (say so when quoting): ``--local-steps`` optimizer
steps per client per round (the paper: one epoch), ``--rounds`` rounds, ``--n-eval`` evaluation
problems.

Per phase (wrapped engine functions) it records wall time, the accelerator's peak allocated and
reserved memory (``torch.cuda.max_memory_allocated`` reset at each phase) and the host's peak
resident set (``/proc`` VmHWM, reset at each phase). ``--size tiny``: a 2-layer Llama of the same
code path for a quick check of every method on the GPU. Writes JSON to ``--out``.

    python benchmarks/gpu_pipeline.py --size 7b --methods fedgalore --out gpu.json
    python benchmarks/gpu_pipeline.py --size tiny --methods fedavg_full,fedit,fedgalore --n-train 64 --n-eval 4 \
        --max-new-tokens 16 --words 200 --out gpu_tiny.json      # also runs on CPU: the same code path

Disk: a 7B FedGaLore checkpoint is ~25 GiB (fp32 server copies of the adapted matrices and the
synchronised moments); the script keeps one (``output.keep_checkpoints=1``) next to the 13.5 GB
model folder. Recorded H100 runs: ``benchmarks/results/gpu_pipeline_{7b,tiny}.json``.
"""
# fedgalore-bench: not-in-all (needs a CUDA GPU with ~80 GB for --size 7b)
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
}
GIB = 1024**3
CUDA = torch.cuda.is_available()


def _reset() -> None:
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(kind: str) -> float:
    if not CUDA:
        return 0.0
    return (torch.cuda.max_memory_allocated() if kind == "allocated" else torch.cuda.max_memory_reserved()) / GIB


def make_model(size: str, tok_dir: Path, out: Path) -> Path:
    """A random-weight Llama of ``size`` in bf16 at ``out`` (config + safetensors), built on the GPU."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, rms_norm_eps=1e-5, torch_dtype="bfloat16",
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SIZES[size])
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    del model
    if CUDA:
        torch.cuda.empty_cache()
    return out


def make_data(folder: Path, n_train: int, n_eval: int, words: int) -> dict[str, str]:
    """MetaMathQA-shaped training records (query, response, type) and GSM8K/MATH-shaped test records."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    types = ["GSM_Rephrased", "MATH_AnsAug", "GSM_SV", "MATH_FOBAR", "GSM_AnsAug"]
    vocab = "the of a number is then we add times so total each more less half twice step answer".split()
    train = []
    for i in range(n_train):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        body = " ".join(rng.choice(vocab) for _ in range(words))
        train.append({"query": f"Problem {i}: what is {a} plus {b}?", "response": f"{body} The answer is: {a + b}", "type": types[i % 5]})
    gsm = [{"question": f"What is {i} plus {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(n_eval)]
    math_ = [{"problem": f"Compute ${i}+{i}$.", "solution": f"We get $\\boxed{{{2 * i}}}$."} for i in range(n_eval)]
    paths = {"data": folder / "metamath.jsonl", "gsm8k_data": folder / "gsm8k_test.jsonl", "math_data": folder / "math_test.jsonl"}
    for key, rows in (("data", train), ("gsm8k_data", gsm), ("math_data", math_)):
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {k: str(v) for k, v in paths.items()}


class Phases:
    """Per-phase wall time, accelerator peak (allocated/reserved) and host peak RSS of wrapped calls."""

    def __init__(self) -> None:
        from fedgalore.memory import peak_tracking_available

        self.host = peak_tracking_available()
        self.rows: list[dict] = []
        self.depth = 0

    def wrap(self, owner, attr: str, label: str) -> None:
        from fedgalore.memory import _hwm_bytes, _reset_hwm

        fn = getattr(owner, attr)

        def timed(*a, **k):
            top = self.depth == 0
            if top:
                _reset()
                if self.host:
                    _reset_hwm()
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                if top:
                    if CUDA:
                        torch.cuda.synchronize()
                    self.rows.append({"phase": label, "seconds": time.perf_counter() - t0,
                                      "gpu_peak_allocated_gib": _peak("allocated"),
                                      "gpu_peak_reserved_gib": _peak("reserved"),
                                      "host_peak_rss_gib": (_hwm_bytes() / GIB) if self.host else None})

        setattr(owner, attr, timed)

    def summary(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.rows:
            s = out.setdefault(r["phase"], {"calls": 0, "seconds": 0.0, "gpu_peak_allocated_gib": 0.0, "gpu_peak_reserved_gib": 0.0,
                                             "host_peak_rss_gib": 0.0})
            s["calls"] += 1
            s["seconds"] += r["seconds"]
            for k in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib", "host_peak_rss_gib"):
                s[k] = max(s[k], r[k] or 0.0)
        return out


def run_method(method: str, args, model_dir: Path, tok_dir: Path, data: dict[str, str], work: Path) -> dict:
    import importlib

    from fedgalore.cli import _load_config
    from fedgalore.engine import loop as loop_mod
    from fedgalore.engine.loop import Federation

    over = [f"method.name={method}", f"task.options.model={model_dir}", f"task.options.tokenizer={tok_dir}",
            f"task.options.data={data['data']}", f"task.options.gsm8k_data={data['gsm8k_data']}",
            f"task.options.math_data={data['math_data']}", f"task.options.n_eval={args.n_eval}",
            f"task.options.max_new_tokens={args.max_new_tokens}", f"federation.rounds={args.rounds}",
            f"federation.eval_every={args.rounds}", "train.local_epochs=null", f"train.local_steps={args.local_steps}",
            f"output.dir={work}", "output.progress=plain", "federation.partition.min_size=1",
            "output.keep_checkpoints=1"]  # a 7B FedGaLore checkpoint is ~25 GiB: two of them and the model fill a 64 GB disk
    if not CUDA:
        over.append("device=cpu")
    if args.size == "tiny":
        over += ["train.grad_accum_steps=2", "federation.eval_batch_size=4"]
    cfg, _ = _load_config(str(ROOT / "conf/pipeline/metamath_llama2.yaml"), over)
    ph = Phases()
    runtime = importlib.import_module("fedgalore.engine.runtime")
    from fedgalore.federated.checkpoint import CheckpointWriter

    ph.wrap(loop_mod.Runtime, "__init__", "setup: model + data")
    ph.wrap(runtime, "transfer", "transfer (broadcast / upload copy)")
    ph.wrap(CheckpointWriter, "save", "checkpoint")
    _reset()
    t0 = time.perf_counter()
    result: dict = {"method": method}
    try:
        fed = Federation(cfg)
        m = fed.method
        ph.wrap(m, "client_update", "client update (train + export)")
        ph.wrap(m, "aggregate", "aggregate A")
        ph.wrap(m, "synchronize", "sync S")
        ph.wrap(fed.task, "evaluate", "evaluation")
        res = fed.run()
        result.update({"final": res.final, "history": res.history, "summary": {k: v for k, v in res.summary.items() if k != "final"}})
    except Exception as exc:  # OOM is a result here
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result["traceback"] = traceback.format_exc(limit=6)
    result["seconds"] = time.perf_counter() - t0
    result["gpu_peak_allocated_gib_run"] = _peak("allocated")
    result["phases"] = ph.summary()
    import gc

    fed = None  # noqa: F841
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--methods", default="fedgalore")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=400)
    ap.add_argument("--n-eval", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--words", type=int, default=700, help="words per synthetic response (fills the 1,024-token window)")
    ap.add_argument("--tokenizer", default=None,
                    help="folder with the tokenizer (default: the offline SmolLM2 asset, scripts/setup.sh; on a machine "
                         "without the assets copy its tokenizer*.json and chat_template.jinja to a folder and pass it)")
    ap.add_argument("--work", default=tempfile.gettempdir() + "/fedgalore-gpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not CUDA and args.size != "tiny":
        print("--size 7b needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tokenizer is None:
        from fedgalore.tasks.assets import cache_dir

        args.tokenizer = str(cache_dir() / "smollm2-135m-instruct")
    work = Path(args.work)
    t0 = time.perf_counter()
    model_dir = make_model(args.size, Path(args.tokenizer), work / f"llama-{args.size}")  # reused when present
    t_model = time.perf_counter() - t0
    work = Path(tempfile.mkdtemp(prefix=f"{args.size}-", dir=str(work)))  # this invocation's data and runs
    data = make_data(work / "data", args.n_train, args.n_eval, args.words)
    out = {"meta": {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__, "size": args.size,
                    "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB if CUDA else 0, "model_write_s": t_model,
                    "args": vars(args), "host_cpus": os.cpu_count()}, "runs": []}
    for method in args.methods.split(","):
        r = run_method(method, args, model_dir, Path(args.tokenizer), data, work / f"runs-{method}")
        out["runs"].append(r)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        print(f"== {method}: {r.get('error', 'ok')} in {r['seconds']:.0f} s; GPU peak {r['gpu_peak_allocated_gib_run']:.1f} GiB", flush=True)
        for name, s in r["phases"].items():
            print(f"   {name:36s} {s['calls']:3d} calls {s['seconds']:8.1f} s  GPU alloc {s['gpu_peak_allocated_gib']:6.1f} "
                  f"reserved {s['gpu_peak_reserved_gib']:6.1f} GiB  host {s['host_peak_rss_gib'] or 0:6.1f} GiB", flush=True)
        if "error" in r:
            print(r["traceback"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
