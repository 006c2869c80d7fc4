"""Tiny federated runs: configs on the tiny_text task, a run killed and resumed, state comparisons."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fedgalore
from fedgalore.engine.events import ProgressSink
from fedgalore.job.config import FederatedConfig


def tiny_cfg(tmp_path: Path, method: str = "fedavg_full", rounds: int = 3, **over) -> FederatedConfig:
    d = {
        "name": "t",
        "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 160, "n_test": 64}},
        "method": {"name": method, "rank": 4, "options": over.pop("method_options", {})},
        "federation": {
            "num_clients": 6,
            "clients_per_round": 3,
            "rounds": rounds,
            "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
        },
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01},
        "output": {"dir": str(tmp_path), "progress": "quiet"},
    }
    for k, v in over.items():
        d[k] = v
    return FederatedConfig.from_dict(d)


def strip_times(recs):
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in recs]


class _Kill(ProgressSink):
    def __init__(self, at_round):
        self.at = at_round

    def round_end(self, round, record):
        if round == self.at:
            raise KeyboardInterrupt("simulated kill")


def killed_and_resumed(full_cfg, killed_cfg, at_round: int = 2):
    """Run ``full_cfg`` to the end; run ``killed_cfg`` (the same run in another output folder),
    kill it inside round ``at_round + 1`` (after checkpoint ``at_round``) and resume it. Asserts
    the killed run was left unfinished and the resumed one has the uninterrupted run's history and
    final metrics; returns ``(full, resumed)`` for further checks."""
    full = fedgalore.run(full_cfg)
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(killed_cfg, progress=_Kill(at_round=at_round))
    run_dir = next(Path(killed_cfg.output.dir).iterdir())
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "interrupted" and stopped["interrupted_by"] == "Ctrl-C"  # KeyboardInterrupt
    assert stopped["rounds_completed"] == at_round + 1 and stopped["checkpointed_round"] == at_round  # round at_round+1 not kept
    assert not (run_dir / "run.lock").exists()  # released
    resumed = fedgalore.resume(run_dir)
    assert strip_times(resumed.history) == strip_times(full.history)
    assert resumed.summary["final"] == full.summary["final"]
    return full, resumed


def assert_same_checkpointed_state(run_a, run_b) -> None:
    """The newest checkpoints of two runs hold identical parameters and extras (bitwise)."""
    from fedgalore.federated.checkpoint import load_latest_checkpoint

    s1, _ = load_latest_checkpoint(run_a.run_dir)
    s2, _ = load_latest_checkpoint(run_b.run_dir)
    for a, b in ((s1.params, s2.params), (s1.extras, s2.extras)):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


SEEDED = {"projector": "random", "view_basis": "seeded"}


def cdp_cfg(tmp_path: Path, method: str = "fedavg_full", rounds: int = 1, method_options: dict | None = None,
            output: dict | None = None, reproducible: bool = False, federation: dict | None = None, **client):
    opts = method_options if method_options is not None else (dict(SEEDED) if method.startswith("fedgalore") else {})
    if method == "fedgalore_minus":
        opts.pop("view_basis", None)
    cfg = {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5, **client}
    # no weight decay: FedGaLore's decay·W0 term would sit outside the clip (refused under privacy.client)
    kw = {"output": {"dir": str(tmp_path), "progress": "quiet", **(output or {})},
          "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.0}}
    if method.startswith("fedgalore"):  # its upload follows the step count: fixed steps under client-level DP
        kw["train"] = {**kw["train"], "local_steps": 4}
    cfg = tiny_cfg(tmp_path, method, rounds=rounds, method_options=opts, privacy={"client": cfg, "reproducible": reproducible},
                   **kw)
    for k, v in (federation or {}).items():
        setattr(cfg.federation, k, v)
    return cfg
