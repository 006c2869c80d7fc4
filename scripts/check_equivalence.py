"""Record or check the behaviour of every registered method on the tiny task, bit for bit.

A refactor must not change results. This script runs each of the nine built-in methods for two
rounds on ``tiny_text`` (the same config as the engine tests) and records, per method, every
round's metrics and diagnostics (times removed), the ledger's byte totals and a SHA-256 of the
final server state (params, extras, synchronised moments, in name order).

    python scripts/check_equivalence.py record tests/golden/tiny_methods.json
    python scripts/check_equivalence.py check  tests/golden/tiny_methods.json

``check`` compares bitwise (floats by ``repr``, state hashes) when the recording was made on a
machine with the same CPU kernel set (``torch.backends.cpu.get_cpu_capability()``) and torch
version, and with a relative tolerance of 1e-4 otherwise (float kernels differ across CPUs in the
last digits); it prints every difference and exits 1 on any. ``tests/test_equivalence.py`` runs
the tolerant check in the suite.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

METHODS = ["fedavg_full", "fedit", "ffa_lora", "flora", "fr_lora", "lora_fair", "fedgalore", "fedgalore_minus", "fedgalore_mean"]


def _config(out: Path, method: str):
    from fedgalore.engine.config import FederatedConfig

    return FederatedConfig.from_dict({
        "name": "equiv", "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 160, "n_test": 64}},
        "method": {"name": method, "rank": 4, "options": {"update_proj_gap": 2} if method.startswith("fedgalore") else {}},
        "federation": {"num_clients": 6, "clients_per_round": 3, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01},
        "output": {"dir": str(out), "progress": "quiet"},
    })


def _state_hash(run_dir: Path) -> str:
    from fedgalore.federated.checkpoint import load_latest_checkpoint
    from fedgalore.protocol.payload import flatten_entries

    state, _ = load_latest_checkpoint(run_dir)
    h = hashlib.sha256()
    _, moments = flatten_entries(state.moments)
    for prefix, tensors in (("p", state.params), ("x", state.extras), ("m", moments)):
        for k in sorted(tensors):
            t = tensors[k].detach().contiguous().cpu()
            h.update(f"{prefix}/{k}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith("time") and k != "time_s"}


def record_all() -> dict:
    import fedgalore
    from fedgalore.jsonl import read_jsonl

    torch.set_num_threads(1)
    out = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in METHODS:
            res = fedgalore.run(_config(Path(tmp) / m, m))
            out["methods"][m] = {
                "metrics": [_strip(r) for r in read_jsonl(res.run_dir / "metrics.jsonl")],
                "diagnostics": [_strip(r) for r in read_jsonl(res.run_dir / "diagnostics.jsonl")],
                "bytes_up_total": res.summary["bytes_up_total"],
                "bytes_down_total": res.summary["bytes_down_total"],
                "state_sha256": _state_hash(res.run_dir),
            }
    return out


def compare(expected: dict, got: dict, exact: bool, rel: float = 1e-4) -> list[str]:
    """Differences between two recordings (empty when equal)."""
    diffs: list[str] = []

    def walk(a, b, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in a or k not in b:
                    diffs.append(f"{where}.{k}: only in {'recording' if k in a else 'this run'}")
                else:
                    walk(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                diffs.append(f"{where}: length {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
            same = (repr(a) == repr(float(b))) if exact else (a == b or (math.isnan(a) and math.isnan(b))
                                                              or abs(a - b) <= rel * max(abs(a), abs(b), 1e-12))
            if not same:
                diffs.append(f"{where}: {a!r} != {b!r}")
        elif where.endswith("state_sha256") and not exact:
            return
        elif a != b:
            diffs.append(f"{where}: {a!r} != {b!r}")

    walk(expected["methods"], got["methods"], "methods")
    return diffs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    path = Path(argv[1])
    got = record_all()
    if argv[0] == "record":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(got['methods'])} methods -> {path}")
        return 0
    expected = json.loads(path.read_text())
    exact = (expected["cpu_capability"], expected["torch"]) == (got["cpu_capability"], got["torch"])
    diffs = compare(expected, got, exact)
    mode = "bitwise" if exact else "relative 1e-4 (another CPU kernel set or torch)"
    if diffs:
        print(f"{len(diffs)} difference(s) ({mode}):\n" + "\n".join(diffs[:50]))
        return 1
    print(f"all {len(got['methods'])} methods identical ({mode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
