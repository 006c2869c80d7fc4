"""What a GaLore step did, for the diagnostics file (``track_cold``; issue 33): the ratio of each
coordinate's update to the update a cold start would have made, ``|U| / |U_cold|``, gathered per
matrix into a histogram, its maximum and the share above 1.

The first moments are shared, so ``|U| / |U_cold| = D_cold / D`` with ``D = sqrt(V̂) + eps``. The
histogram has bins of 1/64 over ``log2`` ratios in ``[-8, 8]`` (upper edges inclusive), so its 99th
percentile is read to 1.1 %. Nothing here changes a weight or a moment.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["RATIO_EDGES", "observe_ratio", "ratio_summary"]

#: upper bin edges of the |U| / |U_cold| histogram (log2 ratios, 1/64 apart over [-8, 8])
RATIO_EDGES = torch.arange(-8 * 64, 8 * 64 + 1, dtype=torch.float32) / 64.0


def observe_ratio(state: dict[str, Any], v: torch.Tensor, w8: Optional[torch.Tensor], cv: torch.Tensor,
                  c2: float, cc: float, cap: float, eps: float) -> None:
    """This step's ``|U| / |U_cold| = D_cold / D`` on every coordinate, added to the matrix's
    histogram (``ratio_hist``), maximum (``ratio_max``), count above 1 (``ratio_above``) and
    count (``ratio_n``). ``V̂ = V / c`` (evidence ``w8``; capped at the cold estimate with
    ``cap``) or ``V / c2²``; ``V̂_cold = cv / cc²``."""
    if w8 is not None:
        est = v / w8
        if cap:
            est = torch.maximum(est, cv * cap)
    else:
        est = v / (c2 * c2)
    ratio = ((cv.sqrt() / cc + eps) / (est.sqrt() + eps)).flatten()
    ratio = torch.nan_to_num(ratio, nan=1.0, posinf=2.0**9)
    if "ratio_hist" not in state:
        state["ratio_hist"] = torch.zeros(len(RATIO_EDGES) + 1, dtype=torch.int64)
        state["ratio_max"], state["ratio_above"], state["ratio_n"] = 0.0, 0, 0
    idx = torch.bucketize(ratio.log2().float().cpu(), RATIO_EDGES)
    state["ratio_hist"] += torch.bincount(idx, minlength=len(RATIO_EDGES) + 1)
    state["ratio_max"] = max(state["ratio_max"], float(ratio.max()))
    state["ratio_above"] += int((ratio > 1.0 + 1e-6).sum())
    state["ratio_n"] += ratio.numel()


def ratio_summary(hist: torch.Tensor, top: float, above: int, n: int) -> dict[str, float]:
    """Max, 99th percentile (read at a bin's upper edge, so ratios all ≤ 1 give ≤ 1) and share
    above 1 of a ``|U| / |U_cold|`` histogram."""
    cum = torch.cumsum(hist, 0)
    k = int(torch.searchsorted(cum, torch.tensor(math.ceil(0.99 * int(cum[-1])), dtype=cum.dtype)))  # first bin reaching 99 %
    p99 = top if k >= len(RATIO_EDGES) else min(top, float(2.0 ** RATIO_EDGES[k]))
    return {"update_ratio_max": top, "update_ratio_p99": p99, "update_ratio_above": above / n}
