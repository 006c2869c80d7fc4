"""A site that shards its client's model across its devices (``train.shard_params: true`` with
``train.devices_per_client = N ≥ 2``; FSDP2's ``fully_shard``).

:mod:`fedgalore.federated.data_parallel` runs the site's ranks; this module is what each rank does
with the round's job when the parameters are sharded:

* **the copy** (:func:`shard_job`). Every rank, rank 0 included, unpickles the client's model and
  optimizer (the same bytes) on the CPU and shards the copy with ``fully_shard``: each child of
  every ``nn.ModuleList`` (a transformer's layers) is one FSDP unit, the root one more, so a rank
  holds ``1/N`` of every weight plus, while a unit runs, that unit whole. Each matrix is placed
  by :func:`placement`: a GaLore matrix along the dimension its basis does not span
  (:func:`fedgalore.optim.sharded.galore_placement`'s rule), everything else by rows (FSDP2's
  default). The copy's optimizer is rebound onto the sharded parameters
  (:func:`rebind_optimizer`): GaLore's moments, cold moment and update record keep the rank's
  block (:meth:`fedgalore.optim.GaLoreAdamW.rebind`), so GaLore's state is sharded with its
  parameters; a plain torch optimizer's weight-shaped state becomes ``DTensor`` blocks.
* **a step.** Every rank runs forward and backward on its row shard of every micro-batch
  (:func:`backward_shards`); FSDP2 reduce-scatters the gradients, averaging over the N ranks, so
  the loss is scaled by N: rank i backpropagates ``N (n_ji / n) L_ji`` and each rank's gradient
  block is ``Σ_j Σ_i (n_ji / n) ∇L_ji``, one process's accumulated gradient (the rule of
  :mod:`fedgalore.federated.data_parallel`). A rank whose shard of a micro-batch is empty (or has
  no loss term) still runs the units' collectives: it forwards one row of the micro-batch that has
  a loss term and backpropagates that loss times 0. Then every rank runs the same end of step
  (:func:`fedgalore.federated.step_end.end_of_step`) on its blocks.
* **the round's end** (:func:`gather_back`). The trained matrices and the optimizer's state are
  gathered once (matrix by matrix, so no rank holds more than one gathered matrix besides its
  shards), and rank 0 writes them into the client's own model and optimizer, from which the method
  uploads, evaluates and checkpoints exactly as with one process.

Where the whole model lives: rank 0's process keeps the client's model (the method loads,
evaluates and exports it whole). On a GPU it is moved to the host for the round, so during
training no device holds more than its shards, one unit gathered, the shards' gradients and
optimizer state, and its activations; before and after the round the whole *weights* are on
rank 0's device again. So a model whose weights fit one device but whose training (weights,
gradients, optimizer state, activations) does not, trains on N devices. A model whose weights alone
do not fit one device is not supported by the site launcher (the method would have to load and
export it sharded too); :mod:`fedgalore.optim.sharded` with your own loop is the way there
(``examples/fsdp_galore.py``).

Not supported with sharding, refused when the config is checked (:func:`shard_problem`): SCAFFOLD
(its control variates are whole tensors added after every step) and ``train.devices_per_client``
below 2. Record-level DP is refused for any ``devices_per_client > 1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from fedgalore.optim.projector import resolve_side

__all__ = ["ShardedCopy", "shard_problem", "placement", "shard_job", "rebind_optimizer", "backward_shards", "fillers",
           "gather_back"]


def shard_problem(shard: Any, devices: int, scaffold: bool) -> Optional[str]:
    """Why ``train.shard_params = shard`` cannot run with this config (``None``: it can)."""
    if not isinstance(shard, bool):
        return f"train.shard_params={shard!r} must be true or false"
    if not shard:
        return None
    if devices < 2:
        return (f"train.shard_params=true shards the client's model across train.devices_per_client devices, but "
                f"devices_per_client={devices}; set train.devices_per_client >= 2 or train.shard_params: false")
    if scaffold:
        return ("train.shard_params=true with train.scaffold: SCAFFOLD's control variates are whole tensors added after "
                "every step; set train.shard_params: false (data parallel) to use SCAFFOLD on several devices")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:  # pragma: no cover - old torch
        return f"train.shard_params=true needs FSDP2 (torch.distributed.fsdp.fully_shard; torch >= 2.6), not torch {torch.__version__}"
    return None


@dataclass
class ShardedCopy:
    """One rank's sharded copy of the client's model for a round: the model, its optimizer rebound
    onto the shards, the trainable parameters (shards) in the client's order and their names."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    names: list[str]


def placement(optimizer: torch.optim.Optimizer, world: int) -> Callable[[nn.Parameter], Any]:
    """The ``shard_placement_fn`` of a copy: a 2-D matrix of a GaLore group (one with ``rank``)
    along the dimension its basis does not span — columns (``Shard(1)``) for a left-side matrix
    whose columns ``world`` divides, else rows — and every other parameter by rows (``Shard(0)``).
    The rule of :func:`fedgalore.optim.sharded.galore_placement`, read per group (each group's
    ``proj_type``)."""
    from torch.distributed.tensor import Shard

    proj: dict[int, str] = {}
    for g in optimizer.param_groups:
        if "rank" in g:
            for p in g["params"]:
                proj[id(p)] = str(g.get("proj_type", "std"))

    def place(p: nn.Parameter) -> Any:
        kind = proj.get(id(p))
        if kind is not None and p.dim() == 2 and resolve_side((int(p.shape[0]), int(p.shape[1])), kind) == "left":
            return Shard(1) if int(p.shape[1]) % world == 0 else Shard(0)
        return Shard(0)

    return place


def _units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root: every child of every ``nn.ModuleList`` that holds parameters
    (a transformer's layers), outermost lists first; none of them inside another."""
    out: list[nn.Module] = []
    taken: set[int] = set()
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and id(mod) not in taken:
            for child in mod:
                if any(True for _ in child.parameters()):
                    out.append(child)
            taken.update(id(m) for m in mod.modules())
    return out


def shard_job(model: nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], names: Sequence[str],
              mesh: Any) -> ShardedCopy:
    """Shard ``model`` (this rank's unpickled copy, on the CPU) over ``mesh`` and rebind
    ``optimizer`` onto its shards (module doc). ``params``/``names``: the trainable parameters of the
    copy (before sharding) and their names in ``model``."""
    from torch.distributed.fsdp import fully_shard

    place = placement(optimizer, int(mesh.size()))
    before = dict(model.named_parameters())
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    after = dict(model.named_parameters())
    rebind_optimizer(optimizer, {before[n]: after[n] for n in before if n in after})
    model.train()
    return ShardedCopy(model, optimizer, [after[n] for n in names], list(names))


def rebind_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[torch.Tensor, torch.Tensor]) -> None:
    """``optimizer`` moved onto other tensors of the same shapes, ``mapping[old] = new``, between whole
    tensors and FSDP2 shards either way: :meth:`fedgalore.optim.GaLoreAdamW.rebind` for GaLore;
    for a torch optimizer, the groups follow and its weight-shaped state tensors become ``new``'s
    ``DTensor`` blocks (to shards) or whole tensors (``full_tensor``, a collective) — the rest (a
    step count) moves to ``new``'s device."""
    if hasattr(optimizer, "rebind"):
        optimizer.rebind(mapping)
        return
    from torch.distributed.tensor import DTensor

    from fedgalore.optim import sharded

    for group in optimizer.param_groups:
        params = []
        for old in group["params"]:
            new = mapping.get(old, old)
            if new is not old:
                st = optimizer.state.pop(old, None)
                if st:
                    moved = {}
                    for k, v in st.items():
                        if isinstance(v, DTensor):
                            v = v.full_tensor().to(new.device)
                        elif isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(old.shape) and isinstance(new, DTensor):
                            dim = sharded.shard_dim(new, k)
                            block = sharded.keep_local(v.to(sharded.local(new).device), new, dim)
                            v = DTensor.from_local(block, new.device_mesh, new.placements, shape=new.shape, stride=new.stride())
                        elif isinstance(v, torch.Tensor):
                            v = v.to(sharded.local(new).device)
                        moved[k] = v
                    optimizer.state[new] = moved
            params.append(new)
        group["params"] = params


def fillers(micro_batches: Sequence[dict[str, torch.Tensor]], counts: Sequence[Sequence[int]],
            counter: Callable[[dict[str, torch.Tensor]], int]) -> list[Optional[dict[str, torch.Tensor]]]:
    """Per micro-batch, one row with a loss term for the ranks whose shard has none (module doc),
    or ``None`` where every shard has one or the micro-batch has none at all."""
    out: list[Optional[dict[str, torch.Tensor]]] = []
    for b, c in zip(micro_batches, counts):
        if not b or sum(c) == 0 or all(x > 0 for x in c):
            out.append(None)
            continue
        rows = int(next(iter(b.values())).shape[0])
        row = next((r for r in range(rows) if counter({k: v[r:r + 1] for k, v in b.items()}) > 0), None)
        out.append(None if row is None else {k: v[row:row + 1] for k, v in b.items()})
    return out


def _loss(loss_fn: Callable[..., torch.Tensor], model: nn.Module, batch: dict[str, torch.Tensor],
          device: torch.device) -> torch.Tensor:
    """``loss_fn`` on ``batch``; a loss that reaches the weights without the model's own forward
    (FSDP2 gathers them in the root's and the layers' forward hooks) fails in one line that says so."""
    try:
        return loss_fn(model, {k: v.to(device) for k, v in batch.items()})
    except RuntimeError as exc:
        if "DTensor" not in str(exc):
            raise
        raise RuntimeError("train.shard_params=true: the task's loss used a sharded weight outside the model's forward "
                           "(FSDP2 gathers weights when model(...) runs, not when a submodule or parameter is used "
                           "directly); call the model itself in the loss, or set train.shard_params: false "
                           f"(torch: {str(exc).splitlines()[0]})") from exc


def backward_shards(model: nn.Module, loss_fn: Callable[..., torch.Tensor], shards: Sequence[dict[str, torch.Tensor]],
                    counts: Sequence[int], totals: Sequence[int], n_total: int, world: int,
                    filler: Sequence[Optional[dict[str, torch.Tensor]]], device: torch.device) -> list[float]:
    """This rank's part of a sharded step: ``N (n_ji / n) L_ji`` backpropagated for each of its
    shards with loss terms, a filler row times 0 for the others of a micro-batch that has some
    (``totals[j] > 0``), nothing for a micro-batch without any; returns ``n_ji · L_ji`` per
    micro-batch (0 where this rank had no term)."""
    sums = []
    for shard, n, total, fill in zip(shards, counts, totals, filler):
        if total == 0:
            sums.append(0.0)
            continue
        if n == 0 or not shard:
            if fill is None:
                raise RuntimeError("a shard without loss terms and no filler row (fedgalore.federated.sharded_site.fillers)")
            loss = _loss(loss_fn, model, fill, device)
            (loss * 0.0).backward()
            sums.append(0.0)
            continue
        loss = _loss(loss_fn, model, shard, device)
        value = float(loss.detach())
        (loss * (world * n / n_total)).backward()
        sums.append(n * value if math.isfinite(value) else float("nan"))
    return sums


@torch.no_grad()
def gather_back(copy: ShardedCopy, model: Optional[nn.Module] = None,
                optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """The round's end (collective; every rank calls it): the copy's trainable matrices and its
    optimizer state gathered matrix by matrix. With ``model``/``optimizer`` (rank 0: the client's
    own), the values are written into ``model``'s parameters of the same names and the state is
    loaded into ``optimizer``; without (ranks 1..N−1) they are dropped as they arrive."""
    from fedgalore.optim import sharded

    own = dict(model.named_parameters()) if model is not None else {}
    mapping: dict[torch.Tensor, torch.Tensor] = {}
    for name, p in zip(copy.names, copy.params):
        whole = p.full_tensor() if sharded.is_sharded(p) else p.detach()
        if model is not None:
            target = own[name]
            target.copy_(whole.to(device=target.device, dtype=target.dtype))
            mapping[p] = target
        else:
            mapping[p] = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")  # gathered state dropped
        del whole
    rebind_optimizer(copy.optimizer, mapping)
    if optimizer is not None:
        optimizer.load_state_dict(copy.optimizer.state_dict())
