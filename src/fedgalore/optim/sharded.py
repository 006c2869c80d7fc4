"""GaLore on sharded parameters (FSDP2's ``fully_shard``; docs/scale-out.md, "A site with several devices").

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a ``DTensor`` whose rank-local
shard is a block of rows (``Shard(0)``, FSDP2's default) or of columns (``Shard(1)``). GaLore's
step needs no communication when each matrix is sharded along the dimension its basis does *not*
span (:func:`galore_placement`):

* right side (``m ≥ n`` under ``std``; basis ``P`` is ``r × n``): rows. ``R = G Pᵀ`` is ``m × r``;
  its rows, the rows of ``M, V`` and of the update ``U P`` are the rows of the shard;
* left side (basis ``P`` is ``m × r``): columns. ``R = Pᵀ G`` is ``r × n``; its columns, those of
  ``M, V`` and of ``P U`` are the shard's columns.

So a rank holds the moments, the cold moment, the compensation and the update record of its own
rows (columns) — GaLore's state is sharded with its parameters — and the basis ``P`` whole
(``r × n`` or ``m × r``: small). A matrix sharded along the dimension its basis spans (FSDP2's
default rows for a left-side matrix; FSDP2 cannot split columns unevenly, so a left-side matrix
whose column count the ranks do not divide stays on rows) costs one all-reduce of ``R`` per step:
``R = Σ_ranks P_kᵀ G_k`` over the ranks' row blocks, and the moments and the record are then whole
(and equal) on every rank (:func:`along_basis`). What needs the whole matrix or every rank:

* a data-driven refresh (SVD / RSVD) reads the whole gradient: it is gathered at that step only
  (with the epoch schedule, once per round), the basis computed from it and broadcast from the
  group's first rank, so every rank holds the same ``P`` bit for bit; seeded bases are built
  locally from their seed;
* the non-finite checks decide together (an all-reduce of one flag), so that every rank skips or
  raises at the same matrix and step;
* the exports (:func:`fedgalore.optim.client_protocol.export_update`,
  :func:`fedgalore.optim.client_protocol.export_moments`, :func:`fedgalore.optim.client_protocol.export_state`)
  gather the sharded tensors, once, into the whole record / moment every rank returns; a warm start
  (:func:`fedgalore.optim.client_protocol.load_second_moment`) takes the whole ``v̄`` and keeps each
  rank's rows (columns).

Not supported on sharded matrices (refused with a clear error): ``track_cold`` (its diagnostics
are statistics over the whole matrix) and ``warm_scale="gradient"`` (a mean over the whole
projected gradient). The per-matrix AVX2 moment kernel is not used on shards (the torch algebra,
by bucket, is).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fedgalore.optim.projector import resolve_side
from fedgalore.optim.state import GaLoreParamState, ParamState, map_tensors



def _dtensor() -> Any:
    """``torch.distributed.tensor.DTensor`` once someone has imported it (``fully_shard`` does),
    else None: no tensor can be a ``DTensor`` before, and importing it costs about a second (sympy,
    the DTensor op tables) that a process which never shards should not pay at start."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)

__all__ = ["is_sharded", "local", "galore_placement", "shard_dim", "along_basis", "all_reduce_sum", "any_rank", "any_rank_each", "gather",
           "keep_local", "broadcast_basis", "convert_state", "move_state"]

# Which fields of a state are sharded like their matrix: fedgalore.optim.state.SHARDED (the moments
# and cold moment, with the update record's coefficients; gathered for the exports by
# fedgalore.optim.functional.whole_state — the rest, basis, evidence c, numbers, is the same on every
# rank) and fedgalore.optim.state.WEIGHT_SHAPED (the bf16 working weight's fp32 master or
# compensation; like a plain group's moments, always sharded like the matrix).


def is_sharded(x: Any) -> bool:
    """Whether ``x`` is a ``DTensor`` (a parameter under FSDP2, or its gradient)."""
    dtensor = _dtensor()
    return dtensor is not None and isinstance(x, dtensor)


def local(x: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a ``DTensor`` (a view: in-place changes reach the parameter); any
    other tensor itself."""
    return x.to_local() if is_sharded(x) else x


def galore_placement(proj_type: str = "std", world_size: Optional[int] = None) -> Callable[[torch.nn.Parameter], Any]:
    """A ``shard_placement_fn`` for ``fully_shard`` that shards every 2-D weight along the
    dimension its GaLore basis does not span: ``Shard(0)`` (rows) for a right-side matrix,
    ``Shard(1)`` (columns) for a left-side one (side by ``proj_type``, as the optimizer's group
    key) whose columns the mesh's size (``world_size``; default: the default group's) divides
    (FSDP2 splits columns only evenly; otherwise rows, and the step all-reduces ``R``); everything
    else ``Shard(0)``, FSDP2's default."""
    from torch.distributed.tensor import Shard

    def place(p: torch.nn.Parameter) -> Any:
        if p.dim() == 2 and resolve_side((int(p.shape[0]), int(p.shape[1])), proj_type) == "left":
            n = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
            return Shard(1) if int(p.shape[1]) % n == 0 else Shard(0)
        return Shard(0)

    return place


def shard_dim(p: torch.Tensor, name: str) -> Optional[int]:
    """The dimension (0: rows, 1: columns) ``p``'s shards split; ``None``: not sharded (or
    replicated). One mesh dimension of ``Shard`` placements only (FSDP2's, or HSDP's replicate ×
    shard); anything else is refused with the placement named."""
    if not is_sharded(p):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = [pl for pl in p.placements if not isinstance(pl, Replicate)]
    if not placements:
        return None
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim not in (0, 1):
        raise ValueError(f"GaLore parameter {name!r} is sharded as {tuple(p.placements)}: GaLoreAdamW steps matrices "
                         "sharded along one dimension (Shard(0) or Shard(1), as fully_shard places them)")
    return int(placements[0].dim)


def along_basis(side: str, dim: Optional[int]) -> bool:
    """Whether a shard split along ``dim`` cuts the dimension the basis spans (rows of a left-side
    matrix, columns of a right-side one): then ``R`` is a sum over the ranks (one all-reduce of
    ``R`` per step, the moments whole on every rank); otherwise the step is local and the moments
    are sharded like the matrix."""
    return dim is not None and dim == (1 if side == "right" else 0)


def all_reduce_sum(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks of ``p``'s mesh, in place (every rank gets the same bits)."""
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_group(p))
    return x


def _group(p: torch.Tensor) -> Any:
    """The process group of the mesh dimension that shards ``p`` (HSDP: not the replicas')."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            return mesh.get_group(i) if mesh.ndim > 1 else mesh.get_group()
    return mesh.get_group(0) if mesh.ndim > 1 else mesh.get_group()


def any_rank(flag: bool, p: torch.Tensor) -> bool:
    """Whether ``flag`` holds on any rank of ``p``'s mesh (an all-reduce of one number); ``flag``
    itself for a tensor that is not sharded."""
    if not is_sharded(p):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=local(p).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group(p))
    return bool(t.item() > 0)


def any_rank_each(flags: list[bool], params: list[torch.Tensor]) -> list[bool]:
    """:func:`any_rank` for many parameters in one all-reduce (over the mesh of the first sharded
    one; every sharded parameter of an optimizer group lives on one mesh under FSDP2); the flags
    themselves when none is sharded."""
    ref = next((p for p in params if is_sharded(p)), None)
    if ref is None or not flags:
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=local(ref).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group(ref))
    return [bool(v > 0) for v in t.tolist()]


def _blocks(p: torch.Tensor, dim: int, n: int) -> list[int]:
    """The sizes of ``p``'s ``n`` blocks along ``dim`` (``torch.chunk``'s, as DTensor's ``Shard``;
    trailing ranks may hold 0)."""
    sizes = [len(c) for c in torch.arange(int(p.shape[dim])).chunk(n)]
    return sizes + [0] * (n - len(sizes))


def gather(x: torch.Tensor, p: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """The whole tensor of which ``x`` is this rank's block along ``dim`` (the blocks of ``p``'s
    sharding: ``torch.chunk`` sizes of ``p``'s dimension ``dim``); ``x`` itself when ``dim`` is None."""
    if dim is None:
        return x
    group = _group(p)
    sizes = _blocks(p, dim, dist.get_world_size(group))
    width = max(sizes)
    pad = [0, 0] * x.dim()
    pad[2 * (x.dim() - 1 - dim) + 1] = width - x.shape[dim]
    padded = torch.nn.functional.pad(x.contiguous(), pad).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, s) for part, s in zip(parts, sizes)], dim=dim)


def keep_local(x: torch.Tensor, p: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """This rank's block of the whole tensor ``x`` along ``dim`` (the inverse of :func:`gather`)."""
    if dim is None:
        return x
    group = _group(p)
    rank = dist.get_rank(group)
    sizes = _blocks(p, dim, dist.get_world_size(group))
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank]).contiguous()


def broadcast_basis(basis: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``basis`` as the first rank of ``p``'s mesh computed it (in place), so every rank projects on
    the same bits whatever its kernels did with the same gathered gradient."""
    if not is_sharded(p):
        return basis
    group = _group(p)
    basis = basis.contiguous()
    dist.broadcast(basis, src=dist.get_global_rank(group, 0), group=group)
    return basis


def convert_state(state: ParamState, conv: Callable[[torch.Tensor], torch.Tensor], fields: tuple[str, ...],
                  record: bool) -> ParamState:
    """A copy of ``state`` with ``conv`` applied to its tensors named in ``fields`` and, with
    ``record``, to the update record's (the open term's and every closed term's ``coef`` and
    ``cold``); ``state`` itself is not changed."""
    changes = {k: conv(getattr(state, k)) for k in fields if isinstance(getattr(state, k, None), torch.Tensor)}
    if record and isinstance(state, GaLoreParamState):
        rec = state.record

        def opt(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if x is None else conv(x)

        changes["record"] = dataclasses.replace(rec, coef=opt(rec.coef), cold=opt(rec.cold),
                                                terms=[dataclasses.replace(t, coef=conv(t.coef), cold=opt(t.cold)) for t in rec.terms])
    return dataclasses.replace(state, **changes)


def move_state(state: ParamState, p: torch.Tensor, dim: Optional[int], fields: tuple[str, ...], record: bool,
               to_shard: bool, device: torch.device) -> ParamState:
    """``state`` of one parameter moved between the whole matrix and ``p``'s shards (``p`` the
    sharded one, split along ``dim``): ``to_shard`` keeps this rank's block (:func:`keep_local`) of
    each tensor named in ``fields`` and, with ``record``, of the update record's terms (``coef``,
    ``cold``); otherwise those are gathered (:func:`gather`, collective: every rank calls it for the
    same parameters in the same order). Every other tensor (basis, evidence, pending warm state) is
    the same whole on every rank and only moves to ``device``. A new state; ``state`` is not changed."""
    def conv(x: torch.Tensor) -> torch.Tensor:
        if dim is None:
            return x
        return keep_local(x.to(device), p, dim) if to_shard else gather(x, p, dim)

    return map_tensors(convert_state(state, conv, fields, record), lambda x: x.to(device))
