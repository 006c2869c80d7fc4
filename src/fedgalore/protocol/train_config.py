"""Local-training hyperparameters shared by every method: the config's ``train`` section
(paper Appendix H, Table 8), handed to each client in :attr:`ClientContext.train
<fedgalore.protocol.state.ClientContext>`.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Local-training hyperparameters shared by every method (paper Appendix H, Table 8)."""

    lr: float = 5e-5
    batch_size: int = 32  # examples per micro-batch (per forward/backward)
    grad_accum_steps: int = 1  # micro-batches per optimizer step: effective batch = batch_size × grad_accum_steps
    local_epochs: float | None = 2.0  # E; ignored when local_steps is set
    local_steps: int | None = None  # T
    warmup_ratio: float = 0.06
    weight_decay: float = 0.01
    schedule: str = "cosine"  # "cosine" | "linear" | "constant"
    schedule_scope: str = "global"  # "global": one warmup+cosine over all rounds; "round": per round
    grad_clip: float | None = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    head_lr: float | None = None  # lr of the head params (None: same as lr)
    sgd_lr: float | None = None  # lr for methods whose reference optimizer is SGD (FFA-LoRA, LoRA-FAIR)
    sgd_momentum: float = 0.0
    #: FedProx μ (Li et al. 2020): local objective F_i(θ) + μ/2‖θ − θ_global‖² over the trainable
    #: parameters (0: off, bit-identical to plain training); fedgalore.federated.client.local_train
    prox_mu: float = 0.0
    #: SCAFFOLD control variates (Karimireddy et al. 2020, option II; fedgalore.federated.scaffold)
    scaffold: bool = False
    #: processes (devices) that train one client: N > 1 cuts every step's batch into N row shards and
    #: sums the gradients across them (data parallel; fedgalore.federated.data_parallel): gloo on the
    #: CPU, NCCL on cuda:d..d+N-1. 1 = one process.
    devices_per_client: int = 1
    #: with devices_per_client N >= 2: each of the N ranks holds 1/N of the client's model (FSDP2's
    #: fully_shard) and of its optimizer state, GaLore's included, instead of a whole replica
    #: (fedgalore.federated.sharded_site). false = data parallel, a replica per rank.
    shard_params: bool = False
