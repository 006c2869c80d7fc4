"""GaLoreAdamW in your own FSDP2 training loop (fedgalore.optim.sharded).

Every rank holds half of each weight matrix (``fully_shard`` with ``galore_placement``: right-side
matrices by rows, left-side ones by columns) and the GaLore state of its half; the step needs no
communication beyond FSDP2's own (a data-driven refresh gathers that matrix's gradient once). At the
end every rank gets the whole exact update ``W_T − W_0`` (``export_update``), as one process would
upload it.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_galore.py --steps 20

CPU: gloo; with ``--device cuda``: NCCL, one GPU per rank.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fedgalore.optim import GaLoreAdamW, client_protocol
from fedgalore.optim.sharded import galore_placement


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _model().to(device)  # the same initial model on every rank
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, shard_placement_fn=galore_placement())
    fully_shard(model, mesh=mesh, shard_placement_fn=galore_placement())
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    others = [(n, p) for n, p in model.named_parameters() if p.dim() != 2]
    opt = GaLoreAdamW([{"params": matrices, "rank": 8, "projector": "rsvd_then_random", "update_proj_gap": 10,
                        "scale": 0.5}, {"params": others}], lr=1e-2, weight_decay=0.01)
    client_protocol.mark(opt)  # record W_T - W_0 from here
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    target = 0.2 * torch.randn(64, 10, generator=torch.Generator().manual_seed(0)).to(device)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    update = client_protocol.export_update(opt)  # collective: every rank gets the whole record
    whole = {n: p.full_tensor() for n, p in matrices}  # collective too
    if rank == 0:
        w0 = {n: p.detach() for n, p in _model().named_parameters()}
        for name, p in matrices:
            err = float((w0[name] + update[name].materialize(w0[name]) - whole[name].detach().cpu()).abs().max())
            print(f"{name}: local shard {tuple(p.to_local().shape)} of {tuple(p.shape)}; {len(update[name].terms)} "
                  f"low-rank term(s); |W0 + record - W_T| = {err:.1e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
