"""Flower app (Message API, simulation runtime): same seed → same results as sequential."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr")
pytest.importorskip("ray")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402

import fedgalore  # noqa: E402
from fedgalore.federated.config import FederatedConfig  # noqa: E402


def cfg(tmp: Path, method: str, opts: dict) -> FederatedConfig:
    return FederatedConfig.from_dict({
        "name": "t",
        "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 120, "n_test": 48}},
        "method": {"name": method, "rank": 4, "options": opts},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1},
        "output": {"dir": str(tmp), "progress": "quiet"},
    })


def test_codec_roundtrips_bf16_and_payload_bytes():
    from fedgalore.federated.payload import Dense, MomentView, Payload, decode, encode
    from fedgalore.flower.codec import blob_to_record, record_to_blob, record_to_tensors, tensors_to_record

    t = {"w": torch.randn(4, 3).bfloat16(), "i": torch.arange(6).reshape(2, 3), "e": torch.zeros(0, 2)}
    back = record_to_tensors(tensors_to_record(t))
    assert all(back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]) for k in t)
    p = Payload({"w": Dense(torch.randn(3, 2).bfloat16()), "v": MomentView(torch.rand(3, 1), "right", (3, 2), seed=5)},
                {"num_examples": 3})
    blob = encode(p)
    assert record_to_blob(blob_to_record(blob)) == blob
    assert decode(record_to_blob(blob_to_record(blob)))["w"].tensor.dtype == torch.bfloat16


def test_flower_simulation_reproduces_sequential(tmp_path):
    from flwr.simulation import run_simulation

    from fedgalore.flower.client_app import app as client_app
    from fedgalore.flower.server_app import make_server_app

    method, opts = "fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    seq = fedgalore.run(cfg(tmp_path / "seq", method, opts))
    run_dir = tmp_path / "flower" / "run"
    run_simulation(
        server_app=make_server_app(cfg(tmp_path / "flower", method, opts), run_dir=run_dir),
        client_app=client_app,
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "include_dashboard": False}},
    )
    hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"
    assert len(hist) == len(seq.history) == 2
    for a, b in zip(seq.history, hist):
        assert a["clients"] == b["clients"] and b["dropped"] == []
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for k in ("train_loss", "eval/accuracy", "eval/loss"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])
