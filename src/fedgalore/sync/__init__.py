"""Server-side optimizer-state synchronisation ``S`` (paper §5; docs/design.md §3.2).

:func:`ajive` — AJIVE on dense or factored views; :func:`synchronize_moments` — the server's
second-moment sync (``none | mean | mean_svd | ajive``) on client :class:`MomentView` uploads;
:func:`synchronize_moments_many` — the same for every matrix of a round, same-shape matrices
batched.
"""
from fedgalore.sync.ajive import AJIVEResult, ajive, elbow_rank, thin_svd_factored
from fedgalore.sync.batched import synchronize_moments_many
from fedgalore.sync.moments import MODES, SyncResult, consensus_basis, frobenius_gram, synchronize, synchronize_moments

__all__ = [
    "AJIVEResult",
    "ajive",
    "elbow_rank",
    "thin_svd_factored",
    "MODES",
    "SyncResult",
    "synchronize",
    "synchronize_moments",
    "synchronize_moments_many",
    "consensus_basis",
    "frobenius_gram",
]
