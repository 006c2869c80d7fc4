"""The engine on a CUDA device (skipped without one; CI has none — run on a lent GPU with
``python -m pytest tests/test_gpu.py tests/test_ajive.py -k gpu``)."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("method", ["fedgalore", "fedavg_full", "flora"])
def test_a_federation_runs_on_the_gpu_and_repeats_exactly(tmp_path, method):
    """Each client's CUDA generator is seeded per (round, client) (a CPU generator's state, set on
    the CUDA generator, failed every client): two runs are identical, and the messages are the CPU
    run's (sizes equal up to the metadata's float text)."""
    import fedgalore
    from test_engine import strip_times, tiny_cfg

    def run(name, device):
        cfg = tiny_cfg(tmp_path, method, rounds=2, device=device)
        return fedgalore.run(cfg, run_dir=tmp_path / name)

    a, b = run("a", "cuda"), run("b", "cuda")
    assert strip_times(a.history) == strip_times(b.history)
    assert all(math.isfinite(h["train_loss"]) for h in a.history)
    cpu = run("c", "cpu")
    # the same messages: equal but for the metadata's float text (a loss printed with another digit count)
    for key in ("bytes_up", "bytes_down"):
        assert all(abs(g - c) <= 64 for g, c in zip([h[key] for h in a.history], [h[key] for h in cpu.history]))
