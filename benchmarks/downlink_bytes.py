"""Downlink bytes per client and round, from the ledger: FedGaLore's factored downlink (the
default) against its dense downlink and FedAvg-Full's (issue 18).

    python benchmarks/downlink_bytes.py                       # every scenario, ~10 min on 1 core
    python benchmarks/downlink_bytes.py minilm_cross_silo     # one scenario
    python benchmarks/downlink_bytes.py --out DIR ...         # keep the run directories

Scenarios (bytes do not depend on the number of local steps while it stays below the projector
gap τ, nor on the sequence length, so the runs are short):

* ``minilm_cross_silo`` — MiniLM-L6 × BBC News, 4 clients, all 4 every round, 10 rounds;
* ``minilm_m50`` — the same model, the paper's M = 50 clients, K = 5 per round, 10 rounds (most
  clients are sampled once or never: they get the chain since W_0 or, per matrix, dense);
* ``smollm2_cross_silo`` — SmolLM2-135M on the offline math task, 4 clients, all every round,
  4 rounds (conf/pipeline/offline_math.yaml's federation).

For each: FedGaLore with the factored downlink (the counting mode, ``downlink: auto``), FedGaLore
with ``downlink: dense`` (its final metrics must equal the factored run's: the server applies the
same arithmetic), and FedAvg-Full. Reported: mean bytes_down per client-round, the run's total,
the tensor bytes by payload kind, and the ratios FedAvg-Full / FedGaLore-factored and
FedGaLore-dense / FedGaLore-factored. Single-threaded; JSON to
``benchmarks/results/downlink_bytes.json`` (scenarios run later are merged into it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "downlink_bytes.json"


def _scenario(name: str) -> dict:
    from fedgalore.job.config import load_config

    if name.startswith("minilm"):
        d = load_config(ROOT / "conf" / "pipeline" / "offline_text.yaml").to_dict()
        d["task"]["options"]["max_length"] = 32
        d["train"].update(local_steps=2, local_epochs=None)
        d["federation"].update(rounds=10, eval_every=100)
        if name == "minilm_cross_silo":
            d["federation"].update(num_clients=4, clients_per_round=None)
        else:
            d["federation"].update(num_clients=50, clients_per_round=5)
            d["federation"]["partition"].update(min_size=1, max_retries=1000)
    elif name == "smollm2_cross_silo":
        d = load_config(ROOT / "conf" / "pipeline" / "offline_math.yaml").to_dict()
        d["task"]["options"].update(n_test=2, eval_max_new_tokens=4)
        d["train"].update(local_steps=1, batch_size=2)
        d["federation"].update(eval_every=100)
    else:
        raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    d["diagnostics"] = False
    d["output"] = {"dir": "runs", "progress": "quiet", "checkpoint_every": 1000, "keep_checkpoints": 1}
    return d


SCENARIOS = ["minilm_cross_silo", "minilm_m50", "smollm2_cross_silo"]
VARIANTS = {"fedgalore_factored": ("fedgalore", "auto"), "fedgalore_dense": ("fedgalore", "dense"),
            "fedavg_full": ("fedavg_full", None)}


def _down(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in recs if r["direction"] == "down"]


def run_scenario(name: str, out: Path) -> dict:
    import fedgalore
    from fedgalore.job.config import FederatedConfig

    res: dict = {"scenario": name, "variants": {}}
    finals = {}
    for label, (method, downlink) in VARIANTS.items():
        d = json.loads(json.dumps(_scenario(name)))
        d["method"]["name"] = method
        if downlink is not None:
            d["method"]["options"]["downlink"] = downlink
        cfg = FederatedConfig.from_dict(d)
        t0 = time.perf_counter()
        r = fedgalore.run(cfg, run_dir=out / name / label)
        down = _down(out / name / label)
        tensor = {}
        for rec in down:
            for k, v in rec.get("tensor_bytes", {}).items():
                tensor[k] = tensor.get(k, 0) + v
        res["variants"][label] = {
            "client_rounds": len(down), "bytes_down_total": sum(x["bytes"] for x in down),
            "bytes_down_per_client_round": sum(x["bytes"] for x in down) / len(down),
            "bytes_down_per_round": [h["bytes_down"] for h in r.history],
            "tensor_bytes_per_client_round": {k: v / len(down) for k, v in tensor.items()},
            "final": r.final, "wall_s": time.perf_counter() - t0,
        }
        finals[label] = r.final
        print(f"{name} {label}: {res['variants'][label]['bytes_down_per_client_round'] / 2**20:.3f} MiB down per client-round "
              f"({len(down)} client-rounds)", flush=True)
    v = res["variants"]
    res["fedavg_full_over_factored"] = v["fedavg_full"]["bytes_down_total"] / v["fedgalore_factored"]["bytes_down_total"]
    res["dense_over_factored"] = v["fedgalore_dense"]["bytes_down_total"] / v["fedgalore_factored"]["bytes_down_total"]
    res["factored_equals_dense_model"] = finals["fedgalore_factored"] == finals["fedgalore_dense"]
    res["config"] = {k: _scenario(name)[k] for k in ("task", "federation", "train")}
    res["rank"] = _scenario(name)["method"]["rank"]
    print(f"{name}: FedAvg-Full / FedGaLore-factored = {res['fedavg_full_over_factored']:.2f}x, "
          f"FedGaLore dense / factored = {res['dense_over_factored']:.2f}x, same final model: {res['factored_equals_dense_model']}",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", default=SCENARIOS, help=f"any of {', '.join(SCENARIOS)} (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="keep the run directories here (default: a temporary one)")
    a = ap.parse_args(argv)
    for name in a.scenarios:
        if name not in SCENARIOS:
            ap.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    torch.set_num_threads(1)
    results = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
    results.setdefault("scenarios", {})
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or Path(tmp)
        for name in a.scenarios:
            results["scenarios"][name] = run_scenario(name, out)
            results["load_average"] = os.getloadavg()
            results["torch"] = torch.__version__
            RESULT.parent.mkdir(parents=True, exist_ok=True)
            RESULT.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
