"""bytes_down per client-round, dense vs factored FedGaLore downlink, from the ledger (issue 18).

    python benchmarks/downlink_bytes.py tiny OUT_DIR
    python benchmarks/downlink_bytes.py offline_text OUT_DIR    # ~8 min on 2 loaded cores
"""
import json, sys
from pathlib import Path
import fedgalore
from fedgalore.engine.config import load_config, FederatedConfig

def per_client_round(run_dir):
    recs = [json.loads(l) for l in open(Path(run_dir) / "ledger.jsonl")]
    down = [r for r in recs if r["direction"] == "down"]
    tb = {}
    for r in down:
        for k, v in r["tensor_bytes"].items():
            tb[k] = tb.get(k, 0) + v
    return sum(r["bytes"] for r in down) / len(down), len(down), {k: v / len(down) for k, v in tb.items()}

which, out = sys.argv[1], Path(sys.argv[2])
for mode in ("dense", "factored"):
    if which == "tiny":
        sys.path.insert(0, "tests")
        from test_engine import tiny_cfg
        cfg = tiny_cfg(out / mode, "fedgalore", rounds=10, method_options={"update_proj_gap": 2, "downlink": mode})
    else:
        d = load_config(Path("conf/pipeline/offline_text.yaml")).to_dict()
        d["method"]["options"]["downlink"] = mode
        d["train"]["local_steps"] = 3  # < tau = 50: one data-driven basis per client-round, as the full E = 1 epoch (~28 steps)
        d["task"]["options"]["max_length"] = 32  # bytes do not depend on it
        d["federation"]["eval_every"] = 100
        d["diagnostics"] = False
        d["output"] = {"dir": str(out / mode), "progress": "quiet", "checkpoint_every": 100, "keep_checkpoints": 1}
        cfg = FederatedConfig.from_dict(d)
    res = fedgalore.run(cfg, run_dir=out / mode / "r")
    mean, n, tb = per_client_round(out / mode / "r")
    print(json.dumps({"config": which, "downlink": mode, "client_rounds": n, "bytes_down_per_client_round": round(mean),
                      "tensor_bytes_per_client_round": {k: round(v) for k, v in tb.items()},
                      "per_round": [r["bytes_down"] for r in res.history], "final": res.final}), flush=True)
