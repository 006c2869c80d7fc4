"""Causal-LM predict on a CPU: seconds per row of 32 new tokens, SmolLM2-135M, a FedIT (LoRA) run.

One process trains a one-round FedIT run of SmolLM2-135M-Instruct on a small Alpaca file it writes
(2 sites, one local step: the adapters exist and are non-zero), then generates 32 new tokens
(greedy, batched, ``transformers``' ``generate`` with its key/value cache) for ``--rows`` rows,
``--reps`` times, interleaving:

* ``unmerged``: the PEFT model as ``load_for_inference`` returns it (the adapters' extra matmuls
  at every token) — what ``fedgalore predict`` did before;
* ``merged``: after ``merge_and_unload`` — what ``fedgalore predict`` does now.

Both on ``--threads`` torch threads (default 2: the issue's "2 CPU cores"); the first generation of
each variant is a warm-up and not counted; the texts of the two variants are compared. Reports
seconds per row (goal ≤ 10 s per row of 32 new tokens) and the ratio; the load average is
recorded next to every timing. Writes ``benchmarks/results/predict_causal.json``.
"""
# fedgalore-bench: not-in-all (about 3 min; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "predict_causal.json"
CONFIG = """\
name: garden
seed: 0
task: {{name: causal_lm, options: {{data: {data}, format: alpaca, max_length: 96}}}}
method: {{name: fedit, rank: 8}}
federation: {{num_clients: 2, clients_per_round: null, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_epochs: null, local_steps: 1}}
output: {{dir: {out}, progress: quiet}}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    import torch

    import fedgalore
    from fedgalore.job.config import load_config
    from fedgalore.trained.evaluate import load_for_inference

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [{"instruction": f"Give one tip for growing plant number {i} in a cold greenhouse.", "input": "",
                 "output": "Keep it above five degrees and water it in the morning."} for i in range(24)]
        (Path(tmp) / "garden.json").write_text(json.dumps(rows))
        (Path(tmp) / "garden.yaml").write_text(CONFIG.format(data=Path(tmp) / "garden.json", out=Path(tmp) / "runs"))
        run = fedgalore.run(load_config(Path(tmp) / "garden.yaml"))
        loaded = load_for_inference(run.run_dir)
        task, model = loaded.task, loaded.model
        model.eval()
        asks = [f"When should I water my tomatoes, week {i}?" for i in range(args.rows)]
        prompts = [task._wrap(a) for a in asks]
        merged = None
        times: dict[str, list[float]] = {"unmerged": [], "merged": []}
        texts: dict[str, list[str]] = {}
        for rep in range(args.reps + 1):
            for name in ("unmerged", "merged"):
                if name == "merged" and merged is None:
                    import copy

                    merged = copy.deepcopy(model).merge_and_unload()
                    merged.eval()
                m = model if name == "unmerged" else merged
                t0 = time.perf_counter()
                out = task.generate(m, prompts, args.new_tokens)
                dt = time.perf_counter() - t0
                texts[name] = out
                if rep:  # the first of each: warm-up
                    times[name].append(dt / len(prompts))
                print(f"{name:9s} rep {rep}: {dt / len(prompts):.2f} s/row (load {os.getloadavg()[0]:.2f})", flush=True)
    per_row = {k: statistics.median(v) for k, v in times.items()}
    summary = {"seconds_per_row": per_row, "ratio_unmerged_over_merged": per_row["unmerged"] / per_row["merged"],
               "same_text": texts["unmerged"] == texts["merged"], "goal_s_per_row": 10.0,
               "meets_goal": per_row["merged"] <= 10.0}
    print(json.dumps(summary, indent=1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "threads": args.threads, "rows": args.rows, "new_tokens": args.new_tokens,
                               "reps": args.reps, "times": times, "load_avg_end": os.getloadavg()[0],
                               "summary": summary}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
