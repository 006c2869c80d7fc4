"""What the server owns and what a round and a client are told (paper §3, Algorithm 1).

* :class:`ServerState` — everything the server keeps between rounds (checkpointed);
* :class:`RoundContext` — round k, its seed s_k, the sampled clients P_k and weights p̃_i;
* :class:`ClientContext` — what operator T of one client needs (its data, schedule, device; its
  local-training hyperparameters are a :class:`~fedgalore.protocol.train_config.TrainConfig`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from fedgalore.protocol.train_config import TrainConfig

__all__ = ["ServerState", "RoundContext", "ClientContext", "own_entries"]


@dataclass
class ServerState:
    """Everything the server owns between rounds; checkpointed as safetensors + JSON.

    ``params``: the global federated tensors (dense, fp32), keyed by parameter name.
    ``extras``: method-specific tensors (fixed inits, ...).
    ``moments``: synchronised optimizer states as typed payload entries (FedGaLore's ``v̄`` per
    adapted matrix, a :class:`~fedgalore.protocol.payload.MomentView`), checkpointed with
    the payload codec.
    ``meta``: JSON-able method state (round seed chain, counters, ...).
    """

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    moments: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundContext:
    """What the server's operators A and S know about round k (Algorithm 1, lines 3–4)."""

    round: int  # 0-based communication round k
    total_rounds: int
    round_seed: int  # s_k, broadcast to clients (seeded projectors)
    clients: list[int]  # sampled client ids
    weights: list[float]  # p_i over the sampled clients (sum to 1)
    #: the run's ``diagnostics`` switch: S may skip what only feeds the diagnostics file
    diagnostics: bool = True
    #: the run's ``diagnostics_exact``: A returns every applied update as a dense ``m × n`` matrix; otherwise a
    #: low-rank method may return it in factors (fedgalore.federated.diagnostics.FactoredDelta)
    diagnostics_exact: bool = False


@dataclass
class ClientContext:
    """What a client's local-training operator T is given (Algorithm 1, lines 6–10)."""

    round: int
    total_rounds: int
    client: int
    round_seed: int
    num_examples: int
    train: TrainConfig
    target_modules: list[str]  # full module names (raw model) of the adapted nn.Linear layers
    head_params: list[str]  # full parameter names (raw model) trained fully by every method
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    batches: Callable[[], Iterable[dict[str, torch.Tensor]]]  # this round's local batches (E epochs or T steps)
    steps: int  # number of local steps the batches iterator yields
    steps_per_round: int  # nominal local steps per round (for global LR schedules)
    on_step: Callable[[int, float], None] | None = None  # progress hook (step, loss)
    device: torch.device = torch.device("cpu")
    #: this client's own store, kept between its rounds by backends whose clients keep state
    #: (sequential); ``None`` when clients are stateless. FedGaLore's factored downlink keeps the
    #: client's model version there (fedgalore.protocol.downlink.ClientCache).
    state: dict[str, Any] | None = None
    #: SCAFFOLD's client side (a :class:`fedgalore.federated.scaffold.ScaffoldClient`) when
    #: ``train.scaffold`` is on; ``local_train`` applies its correction after every optimizer step
    scaffold: Any = None
    #: the run's ``diagnostics`` switch: a client may skip what only feeds the diagnostics file
    #: (FedGaLore: the shadow cold second moment and the moment diagnostics in the upload meta)
    diagnostics: bool = True
    #: record-level DP-SGD of this client-round (a :class:`fedgalore.privacy.dpsgd.DPSGD`, ``privacy.record``):
    #: ``local_train`` clips per-example gradients and adds noise before every optimizer step; None: no DP
    privacy: Any = None


def own_entries(store: dict[str, Any] | None) -> dict[str, dict[str, torch.Tensor]]:
    """The method's own entries of a client's store (:attr:`ClientContext.state`): each a mapping of
    names to tensors (FedSA-LoRA's local ``B``), what a site must keep between rounds; the factored
    downlink's copy (``"downlink"``, rebuilt from the server) is not among them."""
    if not store:
        return {}
    return {k: v for k, v in store.items() if k != "downlink" and isinstance(v, dict) and v
            and all(isinstance(t, torch.Tensor) for t in v.values())}
