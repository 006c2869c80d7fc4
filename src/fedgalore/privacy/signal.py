"""Client-level DP's noise against the signal it hides, before a round is paid for (docs/privacy.md).

DP-FedAvg (McMahan et al. 2018, "Learning differentially private recurrent language models")
clips each client's change Δ_i to ‖Δ_i‖ ≤ C and releases the mean of K of them with Gaussian
noise z ~ N(0, σ²C² I_d) on their sum (:mod:`fedgalore.privacy.client_dp`):

    Δ̄ = (1/K) (Σ_i clip_C(Δ_i) + z),     ‖(1/K) Σ_i clip_C(Δ_i)‖ ≤ C,

so each of the d coordinates of the mean carries noise of std σ·C/K, and the noise's norm is
‖z/K‖ ≈ σ·C·√d / K, against a signal (the mean update) of norm at most C. The ratio

    ρ = ‖z/K‖ / C = σ·√d / K

says how many times the noise outweighs the largest possible mean update; ρ ≤ 1 needs
K ≥ σ·√d clients per round. A method whose aggregate uses every upload on its own
(``MethodTraits.dp_aggregate = "individual"``: FLoRA's stacking, LoRA-FAIR) noises each upload with the
whole N(0, σ²C²), so the mean of K carries std σ·C/√K per coordinate: ρ = σ·√(d/K) and
K ≥ σ²·d. :func:`noise_vs_signal` is the one place this is computed; ``fedgalore plan`` and a
run's start print its :meth:`NoiseVsSignal.line`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NoiseVsSignal", "noise_vs_signal"]


@dataclass(frozen=True)
class NoiseVsSignal:
    """What :func:`noise_vs_signal` computes (module doc)."""

    #: σ of the update's noise, C, d (coordinates of one client's clipped change), K, whether A is a mean
    sigma: float
    clip: float
    dim: int
    clients: int
    mean: bool
    #: the noise's std per coordinate of the released mean: σ·C/K (mean) or σ·C/√K (individual)
    noise_std: float
    #: ‖noise‖ of the mean ≈ noise_std·√d
    noise_norm: float
    #: ρ = noise_norm / C: the noise against the largest mean update
    ratio: float
    #: the fewest clients per round with noise_norm ≤ C: ⌈σ·√d⌉ (mean) or ⌈σ²·d⌉ (individual)
    clients_needed: int

    @property
    def hopeless(self) -> bool:
        """Whether the noise outweighs the largest mean update (ρ > 1)."""
        return self.ratio > 1.0

    def line(self) -> str:
        """One line for the console and the plan: the numbers, and what K would make the noise small."""
        k = "σ·C/K" if self.mean else "σ·C/√K"
        out = (f"client-level DP noise vs signal: the noised mean of K = {self.clients} clients carries noise of std "
               f"{k} = {self.noise_std:.3g} per coordinate over d = {self.dim:,} coordinates, norm ≈ "
               f"{self.noise_norm:.3g}, against a mean update of norm ≤ C = {self.clip:g}: {self.ratio:.3g}× the signal's bound")
        if self.sigma <= 0:
            return out + " (σ = 0: no noise, and nothing protected)"
        need = f"K ≥ {'σ·√d' if self.mean else 'σ²·d'} = {self.clients_needed:,} clients per round"
        if self.hopeless:
            return ("WARNING: " + out + f" — the updates drown in the noise; noise norm ≤ C needs {need} "
                    "(federation.clients_per_round), or less noise (a larger ε)")
        return out + f" (noise norm ≤ C holds from {need})"


def noise_vs_signal(sigma: float, clip: float, dim: int, clients: int, mean: bool = True) -> NoiseVsSignal:
    """The noise of client-level DP's released mean against the signal (module doc; McMahan et al.
    2018): with ``sigma`` σ, ``clip`` C, ``dim`` d coordinates in one client's clipped change and
    ``clients`` K per round, the noise std per coordinate σ·C/K, its norm σ·C·√d/K, the ratio
    ρ = σ·√d/K to the mean update's bound C, and the fewest K with ρ ≤ 1, ⌈σ·√d⌉; ``mean=False``
    (each upload noised on its own): σ·C/√K, σ·C·√(d/K), σ·√(d/K) and ⌈σ²·d⌉."""
    sigma, clip, dim, clients = float(sigma), float(clip), int(dim), max(int(clients), 1)
    std = sigma * clip / (clients if mean else math.sqrt(clients))
    norm = std * math.sqrt(dim)
    needed = math.ceil(sigma * math.sqrt(dim) - 1e-9) if mean else math.ceil(sigma * sigma * dim - 1e-9)
    return NoiseVsSignal(sigma, clip, dim, clients, bool(mean), std, norm, norm / clip, max(needed, 1))
