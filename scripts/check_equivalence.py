"""Record or check the behaviour of every registered method on the tiny task.

A refactor must not change results. This script runs each of the nine built-in methods for two
rounds on ``tiny_text`` (the same config as the engine tests) and records, per method, every
round's metrics and diagnostics (times removed), the ledger's bytes (totals, and per direction
the messages, header bytes and tensor bytes per entry kind) and a summary of the final server
state: per tensor its dtype, shape and L2 norm, the moment entries' specs (kinds, sides, shapes,
seeds) and the state's metadata — plus a SHA-256 of the state's bytes for ``check --exact``.

    python scripts/check_equivalence.py record tests/golden/tiny_methods.json
    python scripts/check_equivalence.py check  tests/golden/tiny_methods.json

``record`` (re-)writes the recording, after a deliberate behaviour change (the commit says why).
It records with the CPU kernels forced down (it re-runs itself with :data:`LOW_ISA_ENV`:
``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``), so the
committed recording is checked against other kernels (AVX2, AVX-512) on every machine that has
them, and against the same ones by ``make test``'s forced-down pass: one recording, both kinds
of check. ``record --native`` records with this process's kernels instead.

``check`` re-runs the methods and compares, printing every difference and exiting 1 on any:

* exactly: the methods, keys, list lengths, strings, integers and booleans — tensor names,
  dtypes and shapes, entry kinds, the clients sampled, ranks, and every byte count. Byte counts
  do not depend on the machine: payload headers write floats in a fixed width
  (:func:`fedgalore.protocol.payload.dump_header_json`), so a message's size depends only on
  its structure, not on the last digits of the losses in its metadata;
* floats: within ``|a − b| ≤ RTOL·max(|a|, |b|) + ATOL``. The CPU's vector width (AVX-512,
  AVX2, none) and the BLAS kernels change fp32 results in the last bits, and two rounds of
  training grow that. Measured on one AVX-512 machine across seven settings (native; torch's
  ``avx2`` and ``default`` kernels; MKL and oneDNN capped at AVX2; combinations): the recorded
  metrics and diagnostics differed by up to 8e-5 relative (FedGaLore's diagnostics; losses by
  2e-7), the state's tensor norms by up to 3e-4 (one low-rank factor, of norm 0.01: 3e-6
  absolute). ``RTOL = 1e-3`` with ``ATOL`` leaves a margin of 7× or more on each; a real
  change of the arithmetic moves the numbers by more (a linear instead of a cosine
  learning-rate decay: 3–8 %; GaLore's weight decay ×10: up to 0.8 %; tests/methods/test_equivalence.py
  shows both failing). ``ATOL = 1e-5`` is the floor for numbers that are rounding noise
  themselves (the tail energy of an exactly rank-r LoRA update, ~1e-7, has no stable digit);
  every recorded float is of unit scale (losses, accuracies, fractions, ratios, norms of
  weights and updates), so the floor hides no real change of a meaningful one.

``check --exact`` compares floats by ``repr`` and the state hashes instead: for a pure refactor,
against a recording you made yourself with ``record --native`` on the same machine and
environment (another CPU or BLAS build differs in the last bits: never against the committed
recording).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

METHODS = ["fedavg_full", "fedit", "ffa_lora", "flora", "fr_lora", "lora_fair", "fedgalore", "fedgalore_minus", "fedgalore_mean"]
#: relative tolerance of floats in ``check`` (module doc)
RTOL = 1e-3
#: absolute floor of the float tolerance: every recorded float is of unit scale (module doc)
ATOL = 1e-5
#: the kernels ``record`` runs with and ``make test`` runs the tests marked ``isa`` with again:
#: torch's portable kernels (no AVX2/AVX-512 code; fedgalore's AVX2 kernels off), MKL and oneDNN at most AVX2
LOW_ISA_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _config(out: Path, method: str):
    from fedgalore.job.config import FederatedConfig

    return FederatedConfig.from_dict({
        "name": "equiv", "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 160, "n_test": 64}},
        "method": {"name": method, "rank": 4, "options": {"update_proj_gap": 2} if method.startswith("fedgalore") else {}},
        "federation": {"num_clients": 6, "clients_per_round": 3, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01},
        "output": {"dir": str(out), "progress": "quiet"},
    })


def _state(run_dir: Path) -> tuple[dict[str, Any], str]:
    """``(summary, sha256)`` of the final server state: per tensor ``[dtype, shape, L2 norm]``
    (params ``p/``, extras ``x/``, moment tensors ``m/``), the moment entries' specs and the
    state's metadata; the hash covers every tensor's bytes (compared only with ``--exact``)."""
    from fedgalore.federated.checkpoint import load_latest_checkpoint
    from fedgalore.protocol.payload import flatten_entries

    state, _ = load_latest_checkpoint(run_dir)
    h = hashlib.sha256()
    specs, moments = flatten_entries(state.moments)
    tensors: dict[str, list] = {}
    for prefix, group in (("p", state.params), ("x", state.extras), ("m", moments)):
        for k in sorted(group):
            t = group[k].detach().contiguous().cpu()
            tensors[f"{prefix}/{k}"] = [str(t.dtype), list(t.shape), float(t.double().norm())]
            h.update(f"{prefix}/{k}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.numpy().tobytes())
    summary = json.loads(json.dumps({"tensors": tensors, "moment_specs": specs, "meta": state.meta}))
    return summary, h.hexdigest()


def _ledger(run_dir: Path) -> dict[str, Any]:
    """Per direction: messages, bytes, header bytes and tensor bytes per entry kind (integers)."""
    from fedgalore.jsonl import read_jsonl

    out: dict[str, Any] = {}
    for r in read_jsonl(run_dir / "ledger.jsonl"):
        d = out.setdefault(r["direction"], {"messages": 0, "bytes": 0, "header_bytes": 0, "tensor_bytes": {}})
        d["messages"] += 1
        d["bytes"] += r["bytes"]
        d["header_bytes"] += r["header_bytes"]
        for kind, n in r["tensor_bytes"].items():
            d["tensor_bytes"][kind] = d["tensor_bytes"].get(kind, 0) + n
    return out


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith("time") and k != "time_s"}


def record_all(methods: list[str] | None = None) -> dict:
    """Run ``methods`` (default: all nine) on the tiny task and record them (module doc)."""
    import fedgalore
    from fedgalore.jsonl import read_jsonl

    torch.set_num_threads(1)
    out = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "env": {k: os.environ.get(k) for k in LOW_ISA_ENV}, "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for m in methods or METHODS:
            res = fedgalore.run(_config(Path(tmp) / m, m))
            state, sha = _state(res.run_dir)
            out["methods"][m] = {
                "metrics": [_strip(r) for r in read_jsonl(res.run_dir / "metrics.jsonl")],
                "diagnostics": [_strip(r) for r in read_jsonl(res.run_dir / "diagnostics.jsonl")],
                "bytes_up_total": res.summary["bytes_up_total"],
                "bytes_down_total": res.summary["bytes_down_total"],
                "ledger": _ledger(res.run_dir),
                "state": state,
                "state_sha256": sha,
            }
    return out


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON of a recording, one line per list without dicts (a tensor's ``[dtype, shape, norm]``,
    a round's clients): ``json.loads`` reads it back; a re-recording's diff names what changed."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj)


def close(a: float, b: float, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """``|a − b| ≤ rtol·max(|a|, |b|) + atol`` (NaN equals NaN; infinities only themselves)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + atol


def compare(expected: dict, got: dict, exact: bool = False, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Differences between two recordings' ``methods`` (empty when they agree).

    Floats (a float on either side, the other a number) within :func:`close`, or by ``repr``
    with ``exact``; everything else (keys, lengths, strings, integers, booleans) exactly;
    ``state_sha256`` only with ``exact``."""
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
        elif (isinstance(a, float) or isinstance(b, float)) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            if not (repr(float(a)) == repr(float(b)) if exact else close(float(a), float(b), rtol, atol)):
                diffs.append(f"{where}: {a!r} != {b!r}")
        elif where.endswith("state_sha256") and not exact:
            return
        elif type(a) is not type(b) or a != b:
            diffs.append(f"{where}: {a!r} != {b!r}")

    walk(expected["methods"], got["methods"], "methods")
    return diffs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {a for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    if (len(args) != 2 or args[0] not in ("record", "check") or not flags <= {"--exact", "--native"}
            or ("--exact" in flags and args[0] != "check") or ("--native" in flags and args[0] != "record")):
        print(__doc__)
        return 2
    path = Path(args[1])
    if args[0] == "record":
        if "--native" not in flags and any(os.environ.get(k) != v for k, v in LOW_ISA_ENV.items()):
            # the committed recording is made with the kernels forced down (module doc)
            return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env={**os.environ, **LOW_ISA_ENV}).returncode
        got = record_all()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(got) + "\n")
        print(f"recorded {len(got['methods'])} methods ({got['cpu_capability']}, torch {got['torch']}) -> {path}")
        return 0
    if not path.is_file():
        print(f"{path}: no such recording; make one with: python scripts/check_equivalence.py record {path}")
        return 2
    expected = json.loads(path.read_text())
    got = record_all()
    exact = "--exact" in flags
    diffs = compare(expected, got, exact)
    mode = "bitwise" if exact else f"floats within {RTOL:g} relative + {ATOL:g}, the rest exactly"
    where = (f"recorded on {expected.get('cpu_capability')}, torch {expected.get('torch')}; "
             f"checked on {got['cpu_capability']}, torch {got['torch']}")
    if diffs:
        print(f"{len(diffs)} difference(s) ({mode}; {where}):\n" + "\n".join(diffs[:50]))
        if exact and any(expected.get(k) != got[k] for k in ("cpu_capability", "env", "torch")):
            print("(--exact against a recording made with other kernels or torch differs in the last bits by design; "
                  "record one here with: record --native)")
        return 1
    print(f"all {len(got['methods'])} methods agree ({mode}; {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
