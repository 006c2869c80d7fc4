"""The server optimizer (``federation.server_optimizer``; Reddi et al. 2021, "Adaptive Federated
Optimization", Algorithm 2) as a round stage around A; the update rules are
:mod:`fedgalore.federated.server_opt`.

A's change of the server parameters is the pseudo-gradient: θ_{k+1} = server_step(θ_k, A's θ).
Its buffers live in ``state.extras["server_opt/..."]`` and its step count in
``state.meta["server_opt"]``, so they are checkpointed with the state. Entries of A's applied
update that are server parameters become the update actually applied; others (the LoRA
methods' ΔW̄ of the factor products) stay A's, before the server optimizer.
"""
from __future__ import annotations

from typing import Any, Callable

from fedgalore.engine.stages.base import RoundStage, RunView
from fedgalore.federated.server_opt import STATE_PREFIX, ServerOptimizerConfig, server_step

__all__ = ["ServerOptimizer"]


class ServerOptimizer(RoundStage):
    """``federation.server_optimizer`` other than plain FedAvg (module doc)."""

    name = "server_optimizer"
    server_only = True

    def __init__(self, cfg: ServerOptimizerConfig) -> None:
        self.cfg = cfg

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "ServerOptimizer | None":
        opt = cfg.federation.server_optimizer
        return None if opt.identity else cls(opt)

    def aggregate(self, state: Any, apply: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = {k: v.clone() for k, v in state.params.items()}
        applied = apply()
        meta = state.meta.setdefault("server_opt", {"step": 0})
        step = int(meta["step"]) + 1
        buffers = {k[len(STATE_PREFIX):]: v for k, v in state.extras.items() if k.startswith(STATE_PREFIX)}
        new = server_step(self.cfg, before, state.params, buffers, step)
        state.params.update(new)
        state.extras.update({STATE_PREFIX + k: v for k, v in buffers.items()})
        meta["step"] = step
        return {k: (new[k] - before[k] if k in new else v) for k, v in applied.items()}
