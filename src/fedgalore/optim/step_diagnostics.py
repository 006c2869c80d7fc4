"""What a GaLore step did, for the diagnostics file (``track_cold``; the cold cap's check,
benchmarks/RESULTS.md §5.2): the ratio of each
coordinate's update to the update a cold start would have made, ``|U| / |U_cold|``, gathered per
matrix into a histogram, its maximum and the share above 1.

The first moments are shared, so ``|U| / |U_cold| = D_cold / D`` with ``D = sqrt(V̂) + eps``. The
histogram has bins of 1/64 over ``log2`` ratios in ``[-8, 8]`` (upper edges inclusive), so its 99th
percentile is read to 1.1 %. Nothing here changes a weight or a moment.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from fedgalore.optim.state import GaLoreParamState, RatioHistogram

__all__ = ["RATIO_EDGES", "observe_ratio", "ratio_summary"]

#: upper bin edges of the |U| / |U_cold| histogram (log2 ratios, 1/64 apart over [-8, 8])
RATIO_EDGES = torch.arange(-8 * 64, 8 * 64 + 1, dtype=torch.float32) / 64.0


def observe_ratio(state: GaLoreParamState, v: torch.Tensor, evidence: Optional[torch.Tensor], cold_v: torch.Tensor,
                  v_bias: float, cold_bias: float, cold_cap: float, eps: float) -> None:
    """This step's ``|U| / |U_cold| = D_cold / D`` on every coordinate, added to the matrix's
    :class:`~fedgalore.optim.state.RatioHistogram` (``state.ratio``: histogram, maximum, count
    above 1, count). ``V̂ = V / c`` (``evidence`` ``c``; capped at the cold estimate with
    ``cold_cap``) or ``V / c₂²`` (``v_bias`` = ``c₂``); ``V̂_cold = cold_v / c_cold²``
    (``cold_bias`` = ``c_cold``)."""
    if evidence is not None:
        est = v / evidence
        if cold_cap:
            est = torch.maximum(est, cold_v * cold_cap)
    else:
        est = v / (v_bias * v_bias)
    ratio = ((cold_v.sqrt() / cold_bias + eps) / (est.sqrt() + eps)).flatten()
    ratio = torch.nan_to_num(ratio, nan=1.0, posinf=2.0**9)
    if state.ratio is None:
        state.ratio = RatioHistogram(torch.zeros(len(RATIO_EDGES) + 1, dtype=torch.int64))
    h = state.ratio
    idx = torch.bucketize(ratio.log2().float().cpu(), RATIO_EDGES)
    h.hist += torch.bincount(idx, minlength=len(RATIO_EDGES) + 1)
    h.max = max(h.max, float(ratio.max()))
    h.above += int((ratio > 1.0 + 1e-6).sum())
    h.count += ratio.numel()


def ratio_summary(hist: torch.Tensor, top: float, above: int, n: int) -> dict[str, float]:
    """Max, 99th percentile (read at a bin's upper edge, so ratios all ≤ 1 give ≤ 1) and share
    above 1 of a ``|U| / |U_cold|`` histogram."""
    cum = torch.cumsum(hist, 0)
    k = int(torch.searchsorted(cum, torch.tensor(math.ceil(0.99 * int(cum[-1])), dtype=cum.dtype)))  # first bin reaching 99 %
    p99 = top if k >= len(RATIO_EDGES) else min(top, float(2.0 ** RATIO_EDGES[k]))
    return {"update_ratio_max": top, "update_ratio_p99": p99, "update_ratio_above": above / n}
