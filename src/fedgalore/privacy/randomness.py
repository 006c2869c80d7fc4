"""Where every draw of differential privacy gets its randomness (docs/privacy.md, "Randomness").

The Gaussian mechanism protects only against a party that cannot regenerate the noise. The
server holds the run's seed and sends the resolved config to every node, so a draw seeded from
it protects nobody from the server — the very party client-level DP (and above all distributed
noise) exists for. Therefore, by default, every DP draw of a run — record-level Poisson sampling,
DP-SGD's noise, client-level noise (central and distributed), adaptive clipping's bit noise —
comes from a generator seeded with 63 bits of the operating system's CSPRNG (``os.urandom``),
fresh for every client-round and release, and the Gaussian noise is drawn with Opacus' secure
sampling (the sum of four draws over two, against the floating-point attack of Jin et al. 2021,
``opacus.optimizers.optimizer._generate_noise`` with ``secure_mode=True``).

The stream generator itself is torch's (Mersenne twister on the CPU, Philox on CUDA): Opacus'
``PrivacyEngine`` would use ``torchcsprng`` for a cryptographically secure stream, and that
package does not build for current torch. A stream generator's state can in principle be
recovered from enough of its raw outputs; here no raw output is ever released (every draw is
added to a clipped signal, and secure sampling averages four), and the 63-bit seed is never
stored or sent. That is the residual assumption, stated in ``privacy.json``'s mechanism.

``privacy.reproducible: true`` (studies only) seeds every draw from (run seed, round, client,
stream) as before — the run is reproducible and resumable bit for bit, and the guarantee holds
only against parties who do not hold the config; ``privacy.json`` says so and a Flower
deployment (server and every node) refuses it.
"""
from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["entropy_seed", "dp_seed", "dp_generator", "gaussian", "RANDOMNESS_ENTROPY", "RANDOMNESS_SEEDED",
           "REPRODUCIBLE_REFUSED"]

#: privacy.json's account of the default randomness
RANDOMNESS_ENTROPY = ("OS entropy: every DP draw (Poisson sampling, DP-SGD noise, client-level noise, the clip bits' "
                      "noise) from a generator seeded with 63 fresh bits of os.urandom per client-round and release, "
                      "never stored or sent; Gaussian noise by Opacus' secure sampling (floating-point attack mitigation). "
                      "The stream generator is torch's (torchcsprng does not build for current torch): no raw output "
                      "of it is released")
#: privacy.json's account of privacy.reproducible: true
RANDOMNESS_SEEDED = ("seeded from the run's seed, round and client (privacy.reproducible: true, for studies): anyone who "
                     "holds the config — the server included — can regenerate every draw; NOT protected against them")
#: one line a Flower deployment (server or node) answers privacy.reproducible with
REPRODUCIBLE_REFUSED = ("privacy.reproducible: true seeds the DP noise and sampling from the run's seed, which the server "
                        "holds and sends to every node, so the server could remove the noise; a Flower deployment refuses "
                        "it: drop privacy.reproducible (the default draws from OS entropy)")


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's CSPRNG (``os.urandom``)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def dp_seed(seq: np.random.SeedSequence, reproducible: bool) -> int:
    """The seed of one DP stream: from ``seq`` (the run seed's derived sequence) only with
    ``reproducible``; otherwise fresh OS entropy (module doc)."""
    if reproducible:
        return int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1))
    return entropy_seed()


def dp_generator(seq: np.random.SeedSequence, reproducible: bool, device: torch.device | str | None = None) -> torch.Generator:
    """A torch generator for one DP stream, seeded by :func:`dp_seed`."""
    g = torch.Generator(device=device) if device is not None else torch.Generator()
    g.manual_seed(dp_seed(seq, reproducible))
    return g


def gaussian(shape: torch.Size | tuple[int, ...], std: float, generator: torch.Generator, secure: bool) -> torch.Tensor:
    """N(0, std²) noise of ``shape`` (float32). ``secure``: Opacus' secure Gaussian sampling
    (``_generate_noise(secure_mode=True)``: four draws summed and halved, one discarded before);
    otherwise one ``torch.normal`` draw (the reproducible studies' stream)."""
    ref = torch.empty(tuple(shape), dtype=torch.float32)
    if std <= 0:
        return torch.zeros_like(ref)
    if secure:
        from opacus.optimizers.optimizer import _generate_noise

        return _generate_noise(std=float(std), reference=ref, generator=generator, secure_mode=True).float()
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * float(std)
