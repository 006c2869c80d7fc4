"""GaLoreAdamW on FSDP2-sharded parameters (issue 43, fedgalore.optim.sharded): two gloo processes,
each holding half of every matrix, train on half of each batch. With ``galore_placement``
right-side matrices are split by rows and left-side ones by columns (a local step, the moments
sharded), except a left-side matrix with an odd column count, which FSDP2 can only split by rows
(R all-reduced, the moments whole); with FSDP2's default placement every matrix is split by rows.
Rows split unevenly (9 over 2 ranks) too. The whole weights, the exported update record and the
exported second moments equal one process's run on the whole batch to fp32 rounding, for seeded
refreshes, a data-driven (RSVD) refresh on the gathered gradient, the epoch schedule's switch to
R_k, the aligned protocol's evidence and cold cap, a warm start from a synchronised state, stacked
GEMMs, a non-finite gradient on one rank only (both ranks skip that matrix) and a resume from each
rank's own ``state_dict`` (same world size)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW

dist_tensor = pytest.importorskip("torch.distributed.tensor")
fsdp = pytest.importorskip("torch.distributed.fsdp")

WORLD = 2
STEPS = 4
VARIANTS = {
    "seeded": {"projector": "random", "update_proj_gap": 2},
    "rsvd-epoch-aligned": {"projector": "rsvd_then_random", "update_proj_gap": 1, "seeded_from_step": 2,
                           "bias_correction": "weight", "cap_to_cold": True},
    "warm-aligned": {"projector": "rsvd_then_random", "update_proj_gap": 1, "seeded_from_step": 1,
                     "bias_correction": "weight", "cap_to_cold": True, "warm": True},
    "stacked-gemm": {"projector": "random", "update_proj_gap": 3, "bucket_gemm": "stacked"},
    "resume": {"projector": "rsvd_then_random", "update_proj_gap": 1, "seeded_from_step": 3, "bias_correction": "weight",
               "cap_to_cold": True, "resume": True},
    "default-placement-aligned": {"projector": "rsvd_then_random", "update_proj_gap": 1, "seeded_from_step": 2,
                                  "bias_correction": "weight", "cap_to_cold": True, "warm": True, "placement": "default"},
    "default-placement-stacked": {"projector": "random", "update_proj_gap": 2, "bucket_gemm": "stacked",
                                  "placement": "default", "nonfinite": "skip", "nan": True},
    "nan-one-rank": {"projector": "random", "update_proj_gap": 2, "nonfinite": "skip", "nan": True},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # weights (out, in): 40x16 right side (sharded by rows), 24x40 left (by columns), 24x24 right,
    # 21x24 left, 9x21 left (21 columns: by rows, 5 + 4), 9x9 right (rows, 5 + 4)
    return nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 21), nn.Tanh(), nn.Linear(21, 9), nn.Tanh(), nn.Linear(9, 9))


def _data():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(STEPS)]
    ys = [torch.randn(8, 9, generator=g) for _ in range(STEPS)]
    return xs, ys


def _opt(model: nn.Module, variant: dict) -> GaLoreAdamW:
    keys = {k: v for k, v in variant.items() if k not in ("warm", "nan", "placement", "resume")}
    mats = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() != 2]
    return GaLoreAdamW([{"params": mats, "rank": 4, "scale": 0.5, **keys}, {"params": rest}],
                       lr=1e-2, weight_decay=0.1, projection_seed=5, nonfinite=variant.get("nonfinite", "raise"))


def _warm_views() -> dict:
    """A synchronised state to warm-start from: a plain run's exported moments (the same in every process)."""
    model = _model()
    opt = _opt(model, {"projector": "random", "update_proj_gap": 100, "bias_correction": "weight"})
    xs, ys = _data()
    for x, y in zip(xs[:2], ys[:2]):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return client_protocol.export_moments(opt)


def _train(model: nn.Module, variant: dict, rows: slice, rank: int) -> dict:
    opt = _opt(model, variant)
    if variant.get("warm"):
        for name, view in _warm_views().items():
            client_protocol.load_second_moment(opt, name, view)
    client_protocol.mark(opt)
    xs, ys = _data()
    for t, (x, y) in enumerate(zip(xs, ys)):
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if variant.get("nan") and t == 1:  # a weight matrix and a bias (plain AdamW)
            for w in (model[2].weight, model[4].bias):
                g = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
                if rank == 1 or not hasattr(w.grad, "to_local"):  # the sharded run: one rank's shard only
                    g.view(-1)[-1] = float("nan")
        opt.step()
        opt.zero_grad()
        if variant.get("resume") and t == 1:  # each rank saves its state and a new optimizer loads it
            saved = opt.state_dict()
            opt = _opt(model, variant)
            opt.load_state_dict(saved)
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    w0 = {n: p.detach() for n, p in _model().named_parameters()}
    exported = client_protocol.export_update(opt)
    updates = {n: u.materialize(w0[n]) for n, u in exported.items()}  # ΔW = decay·W0 + Σ terms
    decays = {n: u.decay for n, u in exported.items()}
    moments = {n: v.moment.clone() for n, v in client_protocol.export_moments(opt).items()}
    skipped = {n: int(opt.state[p].skipped) for n, p in model.named_parameters()}
    return {"weights": whole, "updates": updates, "decays": decays, "moments": moments, "skipped": skipped}


def _worker(rank: int, store: str, variant_name: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fedgalore.optim.sharded import galore_placement

    torch.set_num_threads(1)
    # a file rendezvous: no port to race for with the other test workers
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (WORLD,))
        place = None if VARIANTS[variant_name].get("placement") == "default" else galore_placement()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, shard_placement_fn=place)
        fully_shard(model, mesh=mesh, shard_placement_fn=place)
        res = _train(model, VARIANTS[variant_name], slice(4 * rank, 4 * rank + 4), rank)
        local_rows = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({**res, "local": local_rows}, out)
    finally:
        dist.destroy_process_group()


def _sharded_run(variant: str, tmp_path) -> dict:
    import torch.multiprocessing as mp

    out = str(tmp_path / f"{variant}.pt")
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), variant, out), nprocs=WORLD, join=True)
    return torch.load(out)


@pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups on Linux")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sharded_step_equals_one_process(variant, tmp_path):
    got = _sharded_run(variant, tmp_path)
    ref = _train(_model(), VARIANTS[variant], slice(0, 8), rank=0)
    if VARIANTS[variant].get("placement") == "default":  # every matrix by rows
        assert got["local"]["2.weight"] == (12, 40) and got["local"]["8.weight"] == (5, 21)
    else:  # as galore_placement says: right side by rows, left side by columns unless they are odd
        assert got["local"]["0.weight"] == (20, 16) and got["local"]["2.weight"] == (24, 20)
        assert got["local"]["6.weight"] == (21, 12) and got["local"]["8.weight"] == (5, 21)
    assert got["local"]["10.weight"] == (5, 9)  # rank 0's rows of 9 (5 + 4)
    for n, w in ref["weights"].items():
        assert torch.allclose(got["weights"][n], w, rtol=1e-4, atol=1e-6), n
        assert not torch.equal(w, dict(_model().named_parameters())[n].detach()), n  # it trained
    for n in ref["updates"]:
        assert got["decays"][n] == pytest.approx(ref["decays"][n], rel=1e-6)
        assert torch.allclose(got["updates"][n], ref["updates"][n], rtol=1e-4, atol=1e-6), n
        assert got["moments"][n].shape == ref["moments"][n].shape
        assert torch.allclose(got["moments"][n], ref["moments"][n], rtol=1e-4, atol=1e-9), n
    assert got["skipped"] == ref["skipped"]
    if VARIANTS[variant].get("nan"):
        assert got["skipped"]["2.weight"] == 1 and got["skipped"]["4.bias"] == 1 and sum(got["skipped"].values()) == 2
