"""Every seed of a run, derived from the run seed and integers (docs/design.md §2: "Everything
random takes an explicit seed or ``torch.Generator``; nothing reseeds global RNGs").

A seed is a pure function of (run seed, round, client, stream), so a run resumed from any
checkpoint, or run on any backend in any client order, draws exactly the same numbers:

* :func:`round_seed` — ``s_k``, the projection seed the server broadcasts in round ``k``
  (paper Algorithm 1);
* :func:`sample_clients` — ``P_k``, the clients sampled in round ``k`` (and in a retried round);
* :func:`client_seed` — client ``i``'s streams in round ``k``: :data:`BATCHES` (the order of its
  local mini-batches; under ``privacy.record`` its Poisson draws), :data:`DROPOUT` (the global RNG
  state its training starts from) and :data:`DP_NOISE` (its DP-SGD noise);
* :func:`validation_seed` — the stratified hold-out of ``federation.validation_fraction``;
* :func:`client_test_seed` — client ``i``'s held-out share (``federation.client_test_fraction``);
* :func:`mixed_seed` — a 63-bit seed mixed from any integers (LoRA adapter initialisation).

All use numpy's ``SeedSequence``, which mixes its entropy words so that nearby inputs give
unrelated streams. (The seeded *bases* of the wire format have their own SHA-256 seed,
:func:`fedgalore.protocol.bases.basis_seed`, which every client recomputes from ``s_k``.)
"""
from __future__ import annotations

import numpy as np

__all__ = ["round_seed", "sample_clients", "client_seed", "validation_seed", "client_test_seed", "mixed_seed",
           "BATCHES", "DROPOUT", "HOLD_OUT", "DP_NOISE"]

#: :func:`client_seed` stream of a client's mini-batch order
BATCHES = 1
#: :func:`client_seed` stream of the global RNG state a client's training starts from (dropout)
DROPOUT = 2
#: :func:`client_seed` stream of a client's held-out share (:func:`client_test_seed`)
HOLD_OUT = 3
#: :func:`client_seed` stream of a client's DP-SGD noise (``privacy.record`` without secure_mode; fedgalore.privacy.dpsgd)
DP_NOISE = 4
#: :func:`client_seed` stream of client-level DP noise (``privacy.client`` without secure_mode;
#: fedgalore.engine.stages.client_dp): a client's own share (distributed) or the server's (central, client 2³¹ + attempt)
DP_CLIENT_NOISE = 5


def round_seed(run_seed: int, round_idx: int) -> int:
    """s_k: the projection seed broadcast in round k (a deterministic chain from the run seed)."""
    return int(np.random.SeedSequence([int(run_seed), int(round_idx), 7]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def sample_clients(run_seed: int, round_idx: int, num_clients: int, k: int | None, attempt: int = 0) -> list[int]:
    """P_k: k of M clients uniformly without replacement (all when k is None or k = M).
    ``attempt`` > 0 draws the new sample of a retried round."""
    if k is None or k >= num_clients:
        return list(range(num_clients))
    key = [int(run_seed), int(round_idx), 3] + ([int(attempt)] if attempt else [])
    rng = np.random.default_rng(np.random.SeedSequence(key))
    return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def client_seed(run_seed: int, round_idx: int, client: int, stream: int) -> np.random.SeedSequence:
    """Seed sequence for client ``client`` in round ``round_idx`` (``stream`` separates uses:
    :data:`BATCHES`, :data:`DROPOUT`)."""
    return np.random.SeedSequence([int(run_seed), int(round_idx), int(client), int(stream)])


def validation_seed(run_seed: int) -> np.random.SeedSequence:
    """Seed sequence of the validation hold-out (``federation.validation_fraction``)."""
    return np.random.SeedSequence([int(run_seed), 11])


def client_test_seed(run_seed: int, client: int) -> np.random.SeedSequence:
    """Seed sequence of client ``client``'s held-out share (``federation.client_eval``): its
    :data:`HOLD_OUT` stream, drawn once (round 0) for the whole run."""
    return client_seed(run_seed, 0, client, HOLD_OUT)


def mixed_seed(*values: int) -> int:
    """A 63-bit seed mixed deterministically from integers (numpy ``SeedSequence``)."""
    state = np.random.SeedSequence([int(v) & 0xFFFFFFFFFFFFFFFF for v in values]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & 0x7FFFFFFFFFFFFFFF
