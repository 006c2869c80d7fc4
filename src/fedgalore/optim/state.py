"""GaLoreAdamW's per-parameter state as typed data (as optax's ``ScaleByAdamState``):
one :class:`GaLoreParamState` per GaLore matrix, one :class:`AdamParamState` per parameter of a
plain group. Every module reads and writes named fields; this module alone knows how a state is
written into (and read back from) ``Optimizer.state_dict()`` — plain dicts of tensors and Python
numbers (:func:`to_plain`, :func:`from_plain`), so a checkpoint loads with
``torch.load(weights_only=True)``.

The fields (paper App. B, Alg. 1; DESIGN §3.1): the projected moments ``M`` (``exp_avg``) and
``V`` (``exp_avg_sq``), their step counts ``t`` (``step``, M's: always from a cold start) and
``s`` (``v_step``, V's since it last started), the basis ``P`` and its identity (``basis_seed``,
``basis_refresh``, ``refresh`` = the next refresh index ``q``; ``held``: a warm start's basis held
by group key ``hold_warm_basis``), the evidence ``c`` of
``bias_correction="weight"`` (``v_weight``), the shadow cold moment (``cold_v``, ``cold_step``),
the exact update record ``W_T − W_0`` (:class:`UpdateRecord`), a pending warm start
(:class:`WarmStart`), the step-ratio histogram (:class:`RatioHistogram`) and the low-precision
weight's fp32 master copy or compensation (``master``, ``comp``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from fedgalore.protocol.bases import SIDES

__all__ = ["RecordTerm", "UpdateRecord", "WarmStart", "RatioHistogram", "GaLoreParamState", "AdamParamState", "ParamState",
           "STACKED", "SHARDED", "WEIGHT_SHAPED", "ADAM_WEIGHT_SHAPED", "map_tensors", "to_plain", "from_plain"]


@dataclass
class RecordTerm:
    """A closed term ``f_q C_q P_q`` of the update record (:mod:`fedgalore.optim.update_record`):
    coefficients ``C_q``, the decay factor ``f_q`` applied since it closed, the basis's seed (−1:
    data-driven, then ``basis`` is the matrix; ``None`` for the identity projector) and, with
    ``track_cold``, the shadow cold-start coefficients."""

    coef: torch.Tensor
    factor: float = 1.0
    seed: int = -1
    basis: Optional[torch.Tensor] = None
    cold: Optional[torch.Tensor] = None


@dataclass
class UpdateRecord:
    """The exact record ``ΔW = (a − 1) W_0 + Σ_q f_q C_q P_q`` since ``mark`` (paper §5): ``on``,
    ``decay_product`` (= ``a``), the closed ``terms`` and the open term (``coef`` = its ``C``, None
    when no term is open; ``steps`` recorded into it; ``cold`` its shadow cold coefficients)."""

    on: bool = False
    decay_product: float = 1.0
    terms: list[RecordTerm] = field(default_factory=list)
    coef: Optional[torch.Tensor] = None
    steps: int = 0
    cold: Optional[torch.Tensor] = None


@dataclass
class WarmStart:
    """A synchronised second moment ``v̄`` waiting for the basis it will start on (Alg. 1 line 3):
    its coordinates on ``basis``, their prior weights (``None``: full weight) and the seed of
    ``basis`` when it is a seeded one (−1: a matrix; read by group key ``hold_warm_basis``)."""

    moment: torch.Tensor
    basis: torch.Tensor
    weight: Optional[torch.Tensor] = None
    seed: int = -1


@dataclass
class RatioHistogram:
    """``|U| / |U_cold|`` of every coordinate and step since ``mark`` (``track_cold``;
    :mod:`fedgalore.optim.step_diagnostics`): histogram, maximum, count above 1, count."""

    hist: torch.Tensor
    max: float = 0.0
    above: int = 0
    count: int = 0


@dataclass
class GaLoreParamState:
    """The optimizer state of one GaLore matrix (module doc). ``side`` is ``"right"`` or ``"left"``;
    the moments are fp32 ``(m × r)`` (right) / ``(r × n)`` (left), this rank's block on a shard."""

    side: str
    rank: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    skipped: int = 0
    v_step: int = 0
    refresh: int = 0
    basis: Optional[torch.Tensor] = None
    basis_seed: int = -1
    basis_refresh: int = -1
    on_view: bool = False  # the basis is the round's view basis R_k (schedule.view_seed)
    view_steps: int = 0  # steps taken on R_k
    held: bool = False  # the basis is a warm start's, held until the switch to R_k (group key hold_warm_basis)
    v_weight: Optional[torch.Tensor] = None  # evidence c, (1, r) right / (r, 1) left
    cold_v: Optional[torch.Tensor] = None
    cold_step: int = 0
    record: UpdateRecord = field(default_factory=UpdateRecord)
    warm: Optional[WarmStart] = None
    warm_diag: Optional[dict[str, float]] = None  # what the warm start did (set when one was applied)
    warm_rescale: bool = False  # warm_scale="gradient": rescale V at the next step
    upload_kept: Optional[float] = None
    ratio: Optional[RatioHistogram] = None
    master: Optional[torch.Tensor] = None  # low_precision="master"
    comp: Optional[torch.Tensor] = None  # low_precision="compensated"


@dataclass
class AdamParamState:
    """The state of one parameter of a plain AdamW group (torch's names)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    skipped: int = 0


ParamState = Union[GaLoreParamState, AdamParamState]

#: the moment fields a bucket stacks (:mod:`fedgalore.optim.bucket`), in this order, when present
STACKED = ("exp_avg", "exp_avg_sq", "v_weight", "cold_v")
#: the GaLore fields sharded like their matrix (:mod:`fedgalore.optim.sharded`), besides the record
SHARDED = ("exp_avg", "exp_avg_sq", "cold_v")
#: the weight-shaped fields of a GaLore state (the bf16 working weight's master copy or compensation)
WEIGHT_SHAPED = ("master", "comp")
#: the fields of a plain AdamW state shaped like its parameter (its moments)
ADAM_WEIGHT_SHAPED = ("exp_avg", "exp_avg_sq")

_NESTED = {"record": UpdateRecord, "warm": WarmStart, "ratio": RatioHistogram}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (a state, or anything inside one) with ``fn`` applied to every tensor: new
    dataclasses, dicts and lists; the rest kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def to_plain(obj: Any) -> Any:
    """A state as plain dicts, lists, tensors and numbers (``state_dict()``; tensors shared, not
    copied; the side as a number, ``0`` = right, ``1`` = left)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, GaLoreParamState):
            out["side"] = SIDES.index(obj.side)
        return out
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    return obj


def from_plain(d: dict[str, Any]) -> ParamState:
    """The typed state written by :func:`to_plain` (``load_state_dict``)."""
    if "rank" not in d:
        return AdamParamState(**d)
    kw = dict(d)
    kw["side"] = SIDES[kw["side"]] if isinstance(kw["side"], int) else kw["side"]
    for name, cls in _NESTED.items():
        if kw.get(name) is not None:
            kw[name] = cls(**kw[name])
    if kw.get("record") is not None:
        kw["record"].terms = [RecordTerm(**t) for t in kw["record"].terms]
    return GaLoreParamState(**kw)
