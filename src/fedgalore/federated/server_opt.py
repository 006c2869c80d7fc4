"""Server optimizers: the aggregate as a pseudo-gradient (Reddi et al. 2021, "Adaptive Federated
Optimization", Algorithm 2; FedAvgM: Hsu, Qi, Brown 2019).

The round loop (``fedgalore.engine.loop``) runs the method's aggregation A, then hands this module
the server parameters before and after it. With ``Δ_k = θ_{k+1}^{agg} − θ_k`` (the aggregated
update, the negative pseudo-gradient) the server parameters become, per tensor and elementwise:

* ``fedavg``      θ_{k+1} = θ_k + η Δ_k                (η = 1: the method's own aggregate; the loop
                                                         then does nothing, bit-identical);
* ``fedavgm``     v_k = β v_{k−1} + Δ_k, v_{−1} = 0;     θ_{k+1} = θ_k + η v_k   (Hsu et al. 2019;
                  Flower's FedAvgM: heavy ball on the pseudo-gradient −Δ, no dampening);
* ``fedadam``     m_k = β₁ m_{k−1} + (1−β₁) Δ_k;  v_k = β₂ v_{k−1} + (1−β₂) Δ_k²;
                  θ_{k+1} = θ_k + η_t m_k / (√v_k + τ)   (Reddi Alg. 2, line "FedAdam");
* ``fedyogi``     v_k = v_{k−1} − (1−β₂) Δ_k² sign(v_{k−1} − Δ_k²)   (Reddi Alg. 2, "FedYogi");
* ``fedadagrad``  v_k = v_{k−1} + Δ_k²                                (Reddi Alg. 2, "FedAdagrad"),

with m_{−1} = v_{−1} = 0 (as Flower initialises them; Reddi's Algorithm 2 allows v_{−1} ≥ τ²).
``bias_correction: true`` (FedAdam only) uses Adam's step size
η_t = η √(1 − β₂^t) / (1 − β₁^t) for the t-th server step (t = 1, 2, ...). Flower 1.x's FedAdam
always bias-corrects, with exponent ``server_round + 1`` (one step ahead of Adam's t for its
1-based rounds); tests/federated/test_server_opt.py checks our rules against Flower's strategies' code.

State (checkpointed by the loop in ``ServerState.extras`` under ``server_opt/``, the step count
in ``ServerState.meta["server_opt"]``): FedAvgM one buffer v, FedAdam / FedYogi two (m, v),
FedAdagrad one (v; m too when β₁ > 0) — each the size of the method's server parameters. For
FedGaLore those are the dense adapted matrices and the head, so FedAdam keeps two dense fp32 copies
of the targets on the server (plus one transient copy of θ_k per round).

Everything here works on dicts of tensors and knows nothing of methods or the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from fedgalore.typed import ConfigError

__all__ = ["SERVER_OPTIMIZERS", "ServerOptimizerConfig", "server_step", "STATE_PREFIX"]

SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
#: prefix of the optimizer's buffers in ServerState.extras (``server_opt/m/<param>``, ``server_opt/v/<param>``)
STATE_PREFIX = "server_opt/"

#: per-optimizer defaults of the options left null (Flower's strategy defaults for β and τ)
_DEFAULT_BETAS = {"fedadam": (0.9, 0.99), "fedyogi": (0.9, 0.99), "fedadagrad": (0.0, 0.0)}
_DEFAULT_TAU = {"fedadam": 1e-9, "fedyogi": 1e-3, "fedadagrad": 1e-9}


@dataclass
class ServerOptimizerConfig:
    """``federation.server_optimizer``: what the server does with the aggregated update (module doc)."""

    name: str = "fedavg"  # fedavg | fedavgm | fedadam | fedyogi | fedadagrad
    lr: float | None = None  # server η (null: 1.0 for fedavg / fedavgm; required for the adaptive ones)
    momentum: float | None = None  # fedavgm's β (null: 0.9)
    betas: tuple[float, float] | None = None  # (β₁, β₂) of fedadam / fedyogi / fedadagrad (null: Flower's)
    tau: float | None = None  # adaptivity τ (null: Flower's: fedadam 1e-9, fedyogi 1e-3, fedadagrad 1e-9)
    bias_correction: bool = False  # fedadam only: Adam's bias-corrected step size

    # ------------------------------------------------------------------ resolved values
    @property
    def identity(self) -> bool:
        """True when the server keeps the method's aggregate as it is (fedavg, η = 1)."""
        return self.name == "fedavg" and self.eta == 1.0

    @property
    def eta(self) -> float:
        return 1.0 if self.lr is None else float(self.lr)

    @property
    def beta(self) -> float:
        return 0.9 if self.momentum is None else float(self.momentum)

    @property
    def beta12(self) -> tuple[float, float]:
        return tuple(self.betas) if self.betas is not None else _DEFAULT_BETAS.get(self.name, (0.9, 0.99))  # type: ignore[return-value]

    @property
    def eps(self) -> float:
        return float(self.tau) if self.tau is not None else _DEFAULT_TAU.get(self.name, 1e-9)

    def check(self, path: str = "federation.server_optimizer") -> "ServerOptimizerConfig":
        """Raise :class:`ConfigError` (one line) on an unknown name, an out-of-range value or an
        option the chosen optimizer does not take."""
        n = self.name
        if n not in SERVER_OPTIMIZERS:
            raise ConfigError(f"{path}.name={n!r} must be one of {', '.join(SERVER_OPTIMIZERS)}")
        adaptive = n in ("fedadam", "fedyogi", "fedadagrad")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"{path}.lr={self.lr} must be a positive number")
        if adaptive and self.lr is None:
            raise ConfigError(f"{path}.lr must be set for {n} (its step is about lr per coordinate; e.g. "
                              f"{path}.lr=1e-4 for fine-tuning, Reddi et al. tune it on a grid)")
        if self.momentum is not None and n != "fedavgm":
            raise ConfigError(f"{path}.momentum is fedavgm's; {n} takes no momentum (remove it, or use betas)")
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"{path}.momentum={self.momentum} must be in [0, 1)")
        if (self.betas is not None or self.tau is not None) and not adaptive:
            raise ConfigError(f"{path}.betas / tau are for fedadam, fedyogi and fedadagrad, not {n} (remove them)")
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"{path}.betas={list(self.betas)} must each be in [0, 1)")
        if self.tau is not None and not (math.isfinite(self.tau) and self.tau > 0):
            raise ConfigError(f"{path}.tau={self.tau} must be a positive number")
        if self.bias_correction and n != "fedadam":
            raise ConfigError(f"{path}.bias_correction is fedadam's only (set it false for {n})")
        return self


@torch.no_grad()
def server_step(cfg: ServerOptimizerConfig, before: Mapping[str, torch.Tensor], aggregated: Mapping[str, torch.Tensor],
                buffers: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """One server step: the new server parameters from θ_k (``before``) and the method's
    aggregate θ_{k+1}^{agg} (``aggregated``), both keyed by parameter name.

    ``buffers`` holds the optimizer's state (``m/<name>``, ``v/<name>``; updated in place, created
    on the first step) and ``step`` is t, the 1-based count of server steps including this one.
    Arithmetic is fp32; the result has each ``before`` tensor's dtype."""
    out: dict[str, torch.Tensor] = {}
    eta, name = cfg.eta, cfg.name
    if name == "fedadam" and cfg.bias_correction:
        b1, b2 = cfg.beta12
        eta = eta * math.sqrt(1.0 - b2**step) / (1.0 - b1**step)
    for k, x in before.items():
        x32 = x.float()
        delta = aggregated[k].float() - x32
        if name == "fedavg":
            upd = delta
        elif name == "fedavgm":
            v = buffers.get(f"m/{k}")
            v = delta.clone() if v is None else v.mul_(cfg.beta).add_(delta)
            buffers[f"m/{k}"] = v
            upd = v
        else:
            b1, b2 = cfg.beta12
            m = buffers.get(f"m/{k}")
            if b1 > 0.0:
                m = (1.0 - b1) * delta if m is None else m.mul_(b1).add_(delta, alpha=1.0 - b1)
                buffers[f"m/{k}"] = m
            else:
                m = delta
            v = buffers.get(f"v/{k}")
            sq = delta * delta
            if v is None:
                v = torch.zeros_like(delta)
            if name == "fedadam":
                v.mul_(b2).add_(sq, alpha=1.0 - b2)
            elif name == "fedyogi":
                v.sub_((1.0 - b2) * sq * torch.sign(v - sq))
            else:  # fedadagrad
                v.add_(sq)
            buffers[f"v/{k}"] = v
            upd = m / (v.sqrt() + cfg.eps)
        out[k] = (x32 + eta * upd).to(x.dtype)
    return out
