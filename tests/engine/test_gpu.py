"""The engine on a CUDA device (skipped without one; CI has none — run on a lent GPU with
``python -m pytest tests/engine/test_gpu.py tests/sync/test_ajive.py -k gpu``)."""
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
    from fedgalore_testing.runs import strip_times, tiny_cfg

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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_bucket_forms_on_cuda_equal_the_per_matrix_step(compiled):
    """On CUDA, ``bucket_gemm: auto`` stacks the GEMMs (one bmm per bucket) and, with
    ``compile_moments``, the moment step is compiled: the weights equal the per-matrix eager step
    to fp32 rounding (the same check as tests/optim/test_bucket_gemm.py on the CPU)."""
    from fedgalore.optim import GaLoreAdamW

    shapes = [(96, 64), (64, 160), (96, 64), (64, 160)]
    gen = torch.Generator().manual_seed(0)
    init = [0.1 * torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(5)]

    def run(gemm, compile_moments):
        ps = [torch.nn.Parameter(w.clone().cuda()) for w in init]
        opt = GaLoreAdamW([{"params": [(f"w{i}", p) for i, p in enumerate(ps)], "rank": 4, "projector": "rsvd_then_random",
                            "update_proj_gap": 2, "bias_correction": "weight", "cap_to_cold": True, "bucket_gemm": gemm}],
                          lr=1e-2, weight_decay=0.1, compile_moments=compile_moments)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.cuda()
            opt.step()
        return [p.detach().cpu() for p in ps]

    for a, b in zip(run("auto", compiled), run("per_matrix", False)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("shard", [False, True], ids=["data-parallel", "sharded"])
def test_a_site_with_two_gpus_gives_the_one_gpu_update(tmp_path, shard):
    """``train.devices_per_client: 2`` on cuda:0 and cuda:1 (NCCL), replicas or FSDP2 shards: the
    global model of one GPU's run, to float rounding (the CPU/gloo check of tests/federated/test_sharded_site.py
    on the lent hardware)."""
    import fedgalore
    from fedgalore_testing.local import _final
    from fedgalore_testing.runs import tiny_cfg

    opts = {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    train = {"lr": 1e-2, "batch_size": 7, "local_epochs": 1, "weight_decay": 0.01, "grad_accum_steps": 2}
    one = fedgalore.run(tiny_cfg(tmp_path / "one", "fedgalore", rounds=2, method_options=opts, train=train, device="cuda:0"))
    two = fedgalore.run(tiny_cfg(tmp_path / "two", "fedgalore", rounds=2, method_options=opts, device="cuda:0",
                                 train={**train, "devices_per_client": 2, "shard_params": shard}))
    p1, p2 = _final(one), _final(two)
    assert max(float((p1[k] - p2[k]).abs().max()) for k in p1) < 1e-4
