"""The ``fedgalore`` command: a tiny pipeline's YAML, the command in a subprocess, one-line user errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedgalore.cli import main


TINY = """\
name: tiny
seed: 0
task: {{name: tiny_text, options: {{n_train: 48, n_test: 16, hidden_size: 16, num_layers: 1, seq_len: 8}}}}
method: {{name: fedgalore, rank: 4, options: {{}}}}
federation: {{num_clients: 3, clients_per_round: 2, rounds: {rounds}, eval_every: 1,
             partition: {{kind: dirichlet, alpha: 0.5, min_size: 2}}}}
train: {{lr: 1.0e-3, batch_size: 16, local_steps: 2}}
output: {{dir: {out}, progress: plain}}
"""


def tiny_config(tmp_path: Path, rounds: int = 2) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(rounds=rounds, out=tmp_path / "runs"))
    return path


def cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "fedgalore.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedgalore: error: "), err
    assert "Traceback" not in err
    return lines[0]
