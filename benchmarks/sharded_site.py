"""A site with two devices on the CPU: one process, data parallel and sharded (issue 43).

Issue 43, "a site with several GPUs"; ``train.devices_per_client``, ``train.shard_params``.

For each variant — one process (``devices_per_client: 1``), data parallel (``2``) and sharded
(``2`` + ``shard_params: true``) — one process runs a short FedGaLore federation on
``offline_text`` (MiniLM-L6 × BBC News, 64 tokens, batch 16, 2 clients per round, a fixed number
of local steps), the variants interleaved repetition by repetition, every process single-threaded.
Reported per variant:

* **client time per round** (the engine's ``time_clients``: the two clients' local training,
  update export included), rounds after the first (the first starts the helpers); the ratio to one
  process. On the CPU two ranks use two cores where one process uses one, so the ratio is a
  parallel speed-up on this machine, not a GPU figure;
* **what rank 0 holds while it trains** (sharded only; exact tensor bytes read just before the
  round's gather): its parameter blocks and its optimizer state (GaLore's moments and record
  blocks, the bases whole), against the whole model and the whole optimizer state one process (or
  each data-parallel rank) holds.

The load average is recorded next to the times. Writes ``benchmarks/results/sharded_site.json``.
``--quick``: 1 repetition of 2 rounds.
"""
# fedgalore-bench: not-in-all (a few minutes; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "one_process": ["train.devices_per_client=1"],
    "data_parallel_2": ["train.devices_per_client=2"],
    "sharded_2": ["train.devices_per_client=2", "train.shard_params=true"],
}
BASE = ["task.options.max_length=64", "federation.num_clients=4", "federation.clients_per_round=2",
        "train.batch_size=16", "train.local_steps=4", "diagnostics=false", "federation.eval_every=1000",
        "method.name=fedgalore"]


def _bytes(tensors) -> int:
    from fedgalore.memory import tensor_bytes

    return int(tensor_bytes(tensors))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sharded_site.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.rounds = 1, 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import fedgalore
    import fedgalore.federated.sharded_site as sharded_site
    from fedgalore.job.config import load_config

    held: list[dict[str, int]] = []
    real = sharded_site.gather_back

    def spy(copy, model=None, optimizer=None):
        if model is not None:
            local = {"params": sum(p.to_local().numel() * p.element_size() for p in copy.model.parameters()),
                     "optimizer_state": _bytes(copy.optimizer.state)}
        out = real(copy, model, optimizer)
        if model is not None:
            local["params_whole"] = sum(p.numel() * p.element_size() for p in model.parameters())
            local["optimizer_state_whole"] = _bytes(optimizer.state)
            held.append(local)
        return out

    sharded_site.gather_back = spy
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, extra in VARIANTS.items():
                cfg = load_config(ROOT / "conf" / "pipeline" / "offline_text.yaml",
                                  [*BASE, *extra, f"federation.rounds={args.rounds}", f"output.dir={tmp}/{name}-{rep}",
                                   "output.progress=quiet"])
                loads.append(os.getloadavg()[0])
                res = fedgalore.run(cfg)
                times[name] += [float(h["time_clients"]) for h in res.history[1:]]
                print(f"rep {rep} {name}: client s/round {[round(h['time_clients'], 2) for h in res.history]}", flush=True)
    base = sum(times["one_process"]) / len(times["one_process"])
    out = {
        "what": __doc__.splitlines()[0],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads_per_process": 1, "load_1min": [round(x, 2) for x in loads]},
        "setting": {"pipeline": "conf/pipeline/offline_text.yaml", "overrides": BASE, "rounds": args.rounds, "reps": args.reps,
                    "counted": "rounds 2.. of every repetition"},
        "client_seconds_per_round": {k: round(sum(v) / len(v), 3) for k, v in times.items()},
        "ratio_to_one_process": {k: round(sum(v) / len(v) / base, 3) for k, v in times.items()},
        "rank0_bytes_while_training_sharded": held[-1] if held else None,
        "rank0_share_sharded": ({k: round(held[-1][k] / held[-1][f"{k}_whole"], 3) for k in ("params", "optimizer_state")}
                                if held else None),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("client_seconds_per_round", "ratio_to_one_process", "rank0_share_sharded")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
