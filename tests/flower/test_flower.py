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
from fedgalore.job.config import FederatedConfig  # noqa: E402


def cfg(tmp: Path, method: str, opts: dict, federation: dict | None = None, **train) -> FederatedConfig:
    return FederatedConfig.from_dict({
        "name": "t",
        "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 120, "n_test": 48}},
        "method": {"name": method, "rank": 4, "options": opts},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, **(federation or {})},
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, **train},
        "output": {"dir": str(tmp), "progress": "quiet"},
    })


def test_codec_roundtrips_bf16_and_payload_bytes():
    from fedgalore.flower.codec import blob_to_record, record_to_blob, record_to_tensors, tensors_to_record
    from fedgalore.protocol.payload import Dense, MomentView, Payload, decode, encode

    t = {"w": torch.randn(4, 3).bfloat16(), "i": torch.arange(6).reshape(2, 3), "e": torch.zeros(0, 2)}
    back = record_to_tensors(tensors_to_record(t))
    assert all(back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]) for k in t)
    p = Payload({"w": Dense(torch.randn(3, 2).bfloat16()), "v": MomentView(torch.rand(3, 1), "right", (3, 2), seed=5)},
                {"num_examples": 3})
    blob = encode(p)
    assert record_to_blob(blob_to_record(blob)) == blob
    assert decode(record_to_blob(blob_to_record(blob)))["w"].tensor.dtype == torch.bfloat16


GALORE = ("fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1})


@pytest.mark.parametrize("site,fed,method", [({}, None, GALORE), ({"devices_per_client": 2, "shard_params": True}, None, GALORE),
                                             ({}, {"site_ranks": {"ranks": {0: 2, 1: 4, 2: 2, 3: 4}}}, GALORE),
                                             ({}, {"rounds": 3}, ("fedsa_lora", {}))],
                         ids=["one-process", "sharded-site", "site-ranks", "site-state"])
def test_flower_simulation_reproduces_sequential(tmp_path, site, fed, method):
    """Flower's simulation against the sequential backend; ``sharded-site``: every ClientApp trains
    its client on two sharded processes and still gives the one-process run's numbers;
    ``site-ranks``: sites at ranks 2 and 4 (federation.site_ranks), each SuperNode at its own;
    ``site-state``: FedSA-LoRA, whose sites keep their own B between rounds (each node in its
    ``Context.state``)."""
    from flwr.simulation import run_simulation

    from fedgalore.flower.client_app import app as client_app
    from fedgalore.flower.server_app import make_server_app

    method, opts = method
    seq = fedgalore.run(cfg(tmp_path / "seq", method, opts, fed))
    run_dir = tmp_path / "flower" / "run"
    run_simulation(
        server_app=make_server_app(cfg(tmp_path / "flower", method, opts, fed, **site), run_dir=run_dir),
        client_app=client_app,
        num_supernodes=4,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 2, "include_dashboard": False}},
    )
    hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert len(hist) == len(seq.history) == (fed or {}).get("rounds", 2)
    for a, b in zip(seq.history, hist):
        assert a["clients"] == b["clients"] and b["dropped"] == []
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for k in ("train_loss", "eval/accuracy", "eval/loss"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


def test_server_app_shows_progress_result_and_refuses_a_rerun(tmp_path, capsys):
    """The ServerApp prints one line per round (output.progress), the final metrics and the run
    directory; started again on the same run directory it fails with one fedgalore line."""
    from flwr.simulation import run_simulation

    from fedgalore.flower.client_app import app as client_app
    from fedgalore.flower.server_app import make_server_app

    c = cfg(tmp_path, "fedavg_full", {})
    c.output.progress = "plain"
    run_dir = tmp_path / "run"
    sim = dict(client_app=client_app, num_supernodes=4,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"num_cpus": 2, "include_dashboard": False}})
    run_simulation(server_app=make_server_app(c, run_dir=run_dir), **sim)
    out = capsys.readouterr().out
    assert "round 1/2 | clients" in out and "round 2/2 | clients" in out
    assert "final (2/2 rounds, finished): accuracy=" in out and f"run dir: {run_dir.resolve()}" in out
    with pytest.raises(Exception) as err:  # Flower re-raises the ServerApp's error (the run fails)
        run_simulation(server_app=make_server_app(c, run_dir=run_dir), **sim)
    text = str(err.value) + str(err.value.__cause__ or "") + capsys.readouterr().err
    assert f"fedgalore: error: {run_dir} already holds this run (complete, 2/2 rounds" in text


def _fake_flwr(tmp_path: Path, status: str) -> dict:
    """A `flwr` on PATH that streams a log (with a fedgalore error line) and reports ``status``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "flwr"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "run" ]; then echo "Successfully started run 42"; echo "round 1/2 | clients 0,1";\n'
        '  echo "fedgalore: error: runs/x already holds this run (complete, 2/2 rounds)"; exit 0; fi\n'
        'if [ "$1" = "ls" ]; then echo "{\\"success\\": true, \\"runs\\": [{\\"run-id\\": \\"42\\", '
        f'\\"status\\": \\"{status}\\", \\"status-details\\": \\"\\"}}]}}"; exit 0; fi\n'
        "exit 3\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize("status, rc", [("finished:completed", 0), ("finished:failed", 1)])
def test_launcher_exit_status_follows_the_run(tmp_path, status, rc):
    """`python -m fedgalore.flower . local ...` exits 0 only when the run completed (flwr run exits 0 always)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fedgalore.flower", ".", "local", "--federation-config", "num-supernodes=4"],
                       capture_output=True, text=True, env=_fake_flwr(tmp_path, status), timeout=120)
    assert r.returncode == rc, r.stderr
    assert "round 1/2 | clients 0,1" in r.stdout  # the log is passed through
    if rc:
        assert r.stderr.strip().endswith("run 42 finished:failed: fedgalore: error: runs/x already holds this run (complete, 2/2 rounds)")
    else:
        assert "fedgalore.flower: run 42 finished:completed" in r.stdout
