"""Shared machinery of the federated LoRA baselines (FedIT, FFA-LoRA, FLoRA, FR-LoRA, LoRA-FAIR,
FedEx-LoRA, FedSA-LoRA, Fed-SB, FlexLoRA, HetLoRA).

LoRA as in Hugging Face PEFT: an adapted ``nn.Linear`` with weight ``W`` (m×n) computes
``x Wᵀ + s · x Aᵀ Bᵀ`` with ``A`` (r×n, ``lora_A``), ``B`` (m×r, ``lora_B``) and ``s = α/r``.

Common choices (every baseline, unless its module says otherwise):

* rank ``r`` = ``Method(rank=...)``; option ``lora_alpha`` (default ``2·r``, the paper's
  Table 9: r=8/α=16, r=16/α=32, r=32/α=64); option ``lora_dropout`` (default ``0.0`` so runs are
  deterministic — PEFT's default too; the FedIT reference uses 0.05. A non-zero dropout draws its
  masks from the global RNG during training, like any dropout layer).
* Adapters are created with ``peft.get_peft_model`` + ``LoraConfig(target_modules=<exact
  names>)`` inside ``torch.random.fork_rng`` (PEFT's own initialisation draws from the global
  RNG; the fork restores it), then overwritten deterministically: ``A`` by PEFT's default law
  (Kaiming-uniform with a=√5, i.e. ``U(−1/√n, 1/√n)``) drawn from a *local*
  ``torch.Generator`` seeded by :func:`~fedgalore.federated.seeding.mixed_seed` from option ``adapter_seed`` (default 0);
  ``B = 0``. Every process therefore builds identical adapters and the global RNG is untouched.
* The classifier head (``head_params``) is trained fully and averaged size-weighted by every
  method; it is re-enabled with ``requires_grad=True`` after wrapping (no ``modules_to_save``,
  so parameter names stay those of the raw model).
* Clients are stateless: the optimizer is built fresh every round (FedIT's reference rebuilds
  its HF ``Trainer`` every round). AdamW methods use ``train.lr``, ``betas``, ``eps``,
  ``weight_decay`` and ``head_lr``; SGD methods use ``train.sgd_lr`` (else option ``sgd_lr``,
  else 2e-2 — FFA-LoRA's reference GLUE config, FederatedScope SGD), ``train.sgd_momentum``,
  no weight decay unless option ``sgd_weight_decay`` is set (the SGD reference configs use none;
  ``train.weight_decay`` is AdamW's *decoupled* decay and means something else for SGD), and for
  the head ``sgd_lr · head_lr / lr`` when ``train.head_lr`` is set (the head keeps the same lr
  ratio to the adapters as under AdamW).
* Local training is :func:`fedgalore.federated.client.local_train` (the paper's LR schedule and
  gradient clipping over the trainable parameters).

Sites at different ranks (``federation.site_ranks``; methods with the ``site_ranks`` trait: FLoRA,
FlexLoRA, HetLoRA). Every process prepares the adapters at :attr:`~fedgalore.methods.base.Method.frame_rank`
``R`` (the largest site rank) with PEFT's ``lora_alpha = s·R``, so PEFT's scaling is the method's
``s = α/r`` (``r`` = ``method.rank``) at every site: with the default ``α = 2r``, ``s = 2`` — what
PEFT's own rule ``α_i = 2·r_i`` gives a site that builds a rank-``r_i`` adapter, so a site's update
``s·B_iA_i`` means the same at every rank. A client at rank ``r_i < R`` trains only the leading
``r_i`` rows of ``A`` and columns of ``B``: the tail is set to zero when the broadcast is loaded,
its gradient is zeroed by tensor hooks (so AdamW's moments stay exactly zero there) and — so that
a gradient written past the hooks (record-level DP's noise) cannot move it — set to zero again
after every optimizer step; the hooks are removed when the round ends
(:meth:`LoraMethod.site_rank_mask`). Its upload carries ``LowRank(B[:, :r_i], A[:r_i])`` — a
rank-``r_i`` adapter as a rank-``r_i`` PEFT layer would hold it (the leading ``r_i`` rows of the
rank-``R`` draw of ``A`` are the rank-``r_i`` draw of the same generator: the draws are nested).
Without site ranks none of this runs: the adapters, the training and the uploads are bit for bit
as before.

Names. Server tensors are keyed by raw-model names: ``<module>.lora_A.weight``,
``<module>.lora_B.weight``, ``<module>.weight`` (the base matrix ``W``), and the head parameter
names. In payloads a pair of factors travels as one :class:`LowRank` entry ``<module>.lora`` with
``left = B`` and ``right = A`` (so ``materialize()`` gives ``B·A`` *without* the scaling ``s``);
single tensors travel as :class:`Dense`. Every tensor is sent in the dtype it has on the client
(PEFT keeps adapters in fp32); server arithmetic is fp32.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from fedgalore.federated.client import local_train
from fedgalore.federated.seeding import mixed_seed
from fedgalore.methods.base import Method, MethodError, MethodOptions, named_params, option
from fedgalore.protocol.payload import Dense, LowRank, Payload
from fedgalore.protocol.state import ClientContext, ServerState

__all__ = [
    "LoraMethod",
    "GlobalFactors",
    "NestedFactorsMethod",
    "LoraOptions",
    "LoraSGDOptions",
    "kaiming_uniform",
    "weighted_sum",
    "a_key",
    "b_key",
    "w_key",
    "pair_key",
    "DEFAULT_SGD_LR",
    "check_weights",
    "lifted",
    "matrix_shape",
]

#: SGD learning rate when neither ``train.sgd_lr`` nor option ``sgd_lr`` is given (FFA-LoRA's
#: reference GLUE config: FederatedScope SGD, lr 2e-2).
DEFAULT_SGD_LR = 2e-2


def a_key(module: str) -> str:
    return f"{module}.lora_A.weight"


def b_key(module: str) -> str:
    return f"{module}.lora_B.weight"


def w_key(module: str) -> str:
    return f"{module}.weight"


def pair_key(module: str) -> str:
    return f"{module}.lora"


def kaiming_uniform(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """PEFT's default ``lora_A`` law, ``kaiming_uniform_(a=√5)``: ``U(−1/√n, 1/√n)``, n = fan-in."""
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2.0 - 1.0) * bound


def weighted_sum(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_i p_i X_i`` in fp32."""
    out = torch.zeros_like(tensors[0], dtype=torch.float32, device="cpu")
    for t, p in zip(tensors, weights):
        out += float(p) * t.detach().float().cpu()
    return out


def _tensor(entry: Any) -> torch.Tensor:
    if not isinstance(entry, Dense):
        raise MethodError(f"expected a Dense payload entry, got {type(entry).__name__}")
    return entry.tensor


def _pair(entry: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) of a ``LowRank`` factor pair."""
    if not isinstance(entry, LowRank):
        raise MethodError(f"expected a LowRank payload entry, got {type(entry).__name__}")
    return entry.left, entry.right


@dataclass(frozen=True)
class LoraOptions(MethodOptions):
    """Options every LoRA baseline takes (module doc)."""

    lora_alpha: float | None = option(None, "LoRA α, scaling s = α/r (null: 2·rank, the paper's Table 9)")
    lora_dropout: float = option(0.0, "dropout on the adapters' input (0: deterministic runs)")
    adapter_seed: int = option(0, "seed of the adapters' initial A (identical in every process)")

    def __post_init__(self) -> None:
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise MethodError(f"option lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise MethodError(f"option lora_dropout must be in [0, 1), got {self.lora_dropout}")


@dataclass(frozen=True)
class LoraSGDOptions(LoraOptions):
    """Options of the LoRA baselines whose reference optimizer is SGD (FFA-LoRA, LoRA-FAIR)."""

    sgd_lr: float | None = option(None, f"SGD learning rate when train.sgd_lr is not set (null: {DEFAULT_SGD_LR:g})")
    sgd_weight_decay: float = option(0.0, "SGD weight decay (the SGD reference configs use none)")


class LoraMethod(Method):
    """Base of the PEFT LoRA baselines: wrapping, deterministic init, heads, optimizers, payloads.

    Subclasses declare ``traits`` (its ``optimizer``: "adamw" | "sgd") and ``options_class`` (a
    :class:`LoraOptions`; :class:`LoraSGDOptions` for SGD methods), and implement the per-round
    pieces (broadcast / load / upload / aggregate).
    """

    options_class = LoraOptions

    @classmethod
    def resolve_options(cls, options: LoraOptions, rank: int) -> LoraOptions:
        """``lora_alpha`` = 2·rank when not given."""
        return options if options.lora_alpha is not None else replace(options, lora_alpha=float(2 * rank))

    def __init__(self, rank: int = 8, options: LoraOptions | None = None) -> None:
        super().__init__(rank, options)
        self.lora_alpha = float(self.options.lora_alpha)
        self.lora_dropout = float(self.options.lora_dropout)
        self.adapter_seed = int(self.options.adapter_seed)
        self.scaling = self.lora_alpha / self.rank  # PEFT: s = α / r
        self.targets: list[str] = []
        self.heads: list[str] = []

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "scaling": self.scaling}

    # ------------------------------------------------------------------ model access
    @staticmethod
    def inner(model: nn.Module) -> nn.Module:
        """The underlying model with LoRA layers injected (raw-model names)."""
        get = getattr(model, "get_base_model", None)
        return get() if callable(get) else model

    def layer(self, model: nn.Module, module: str) -> nn.Module:
        return self.inner(model).get_submodule(module)

    def lora_a(self, model: nn.Module, module: str) -> nn.Parameter:
        return self.layer(model, module).lora_A["default"].weight

    def lora_b(self, model: nn.Module, module: str) -> nn.Parameter:
        return self.layer(model, module).lora_B["default"].weight

    def base_weight(self, model: nn.Module, module: str) -> nn.Parameter:
        return self.layer(model, module).base_layer.weight

    def head_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return named_params(self.inner(model), self.heads)

    @torch.no_grad()
    def head_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.head_params(model).items()}

    @torch.no_grad()
    def load_heads(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        for n, p in self.head_params(model).items():
            p.copy_(values[n].to(p.device, p.dtype))

    @staticmethod
    @torch.no_grad()
    def assign(param: torch.Tensor, value: torch.Tensor) -> None:
        param.copy_(value.to(param.device, param.dtype))

    # ------------------------------------------------------------------ setup
    def train_a(self) -> bool:
        """Whether ``lora_A`` trains on the clients (FFA-LoRA / FR-LoRA freeze it)."""
        return True

    def train_b(self) -> bool:
        """Whether ``lora_B`` trains on the clients (Fed-SB freezes it)."""
        return True

    def setup(self, model: nn.Module, target_modules: Sequence[str], head_params: Sequence[str]) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        self.targets, self.heads = list(target_modules), list(head_params)
        if not self.targets:
            raise MethodError(f"{self.name}: no target modules to adapt")
        mods = dict(model.named_modules())
        self.shapes = {m: matrix_shape(mods[m]) for m in self.targets}  # (out, in) per target
        named_params(model, self.heads)  # fail early on a wrong head name
        frame = self.frame_rank  # the largest site rank (method.rank without site ranks)
        config = LoraConfig(
            r=frame,
            # PEFT's scaling α'/R kept at the method's s = α/r (module doc); without site ranks α' = α
            lora_alpha=self.lora_alpha if self.site_ranks is None else self.scaling * frame,
            lora_dropout=self.lora_dropout,
            target_modules=list(self.targets),
            bias="none",
        )
        with torch.random.fork_rng(devices=[]):  # PEFT's init draws from the global RNG
            peft_model = get_peft_model(model, config)
        for module in self.targets:
            if abs(float(self.layer(peft_model, module).scaling["default"]) - self.scaling) > 1e-12:
                raise MethodError(f"{self.name}: unexpected PEFT scaling for {module}")
        self.init_adapters(peft_model, mixed_seed(self.adapter_seed))
        self.prepare(peft_model)
        for module in self.targets:
            self.lora_a(peft_model, module).requires_grad_(self.train_a())
            self.lora_b(peft_model, module).requires_grad_(self.train_b())
        for p in self.head_params(peft_model).values():
            p.requires_grad_(True)
        return peft_model

    @torch.no_grad()
    def start_from(self, model: nn.Module, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                   scaling: Mapping[str, float]) -> None:
        """Start from a trained LoRA adapter (``task.options.model`` a PEFT adapter folder): its
        ``(B, A)`` per adapted module replace the fresh adapters, so the model is ``W0 + s·BA`` as
        the adapter's is (targets the adapter lacks keep ``B = 0``). Its rank and scaling must be
        this method's, and its layers among the targets; else one :class:`MethodError` line that
        says what to set. Call it on the set-up model, before the server state is taken from it."""
        if self.site_ranks is not None:
            raise MethodError("starting from a trained adapter (task.options.model) with federation.site_ranks is not "
                              "supported: the adapter has one rank; remove federation.site_ranks")
        outside = sorted(set(factors) - set(self.targets))
        if outside:
            raise MethodError(f"the starting adapter adapts {outside[0]}{f' (and {len(outside) - 1} more)' if len(outside) > 1 else ''}, "
                              "which is not among the target modules; set task.options.target_modules to include its layers "
                              "(or leave it null to use the adapter's)")
        for m, (b, a) in factors.items():
            if int(a.shape[0]) != self.rank:
                raise MethodError(f"the starting adapter has rank {int(a.shape[0])} and method.rank={self.rank}; set "
                                  f"method.rank={int(a.shape[0])} to continue training it (or use a method that merges it: "
                                  "fedgalore, fedavg_full, flora, fr_lora)")
            if abs(float(scaling[m]) - self.scaling) > 1e-6 * self.scaling:
                raise MethodError(f"the starting adapter scales by α/r = {float(scaling[m]):g} and {self.name} by "
                                  f"{self.scaling:g}; set method.options.lora_alpha={float(scaling[m]) * self.rank:g}")
            if (tuple(b.shape[:1]) + tuple(a.shape[1:])) != self.shapes[m]:
                raise MethodError(f"the starting adapter's factors of {m} are {tuple(b.shape)}·{tuple(a.shape)}, the layer is "
                                  f"{self.shapes[m]}: it is not an adapter of this model")
        for m, (b, a) in factors.items():
            self.assign(self.lora_a(model, m), a)
            self.assign(self.lora_b(model, m), b)

    def fresh_a(self, shapes: Mapping[str, Sequence[int]], seed: int) -> dict[str, torch.Tensor]:
        """Every target's fresh ``A ~ U(−1/√n, 1/√n)`` (shape ``shapes[target]``), drawn from one
        local generator seeded ``seed``, targets in order: what :meth:`init_adapters` puts into a
        model, and what FLoRA's client-level DP reference rebuilds from an upload's shapes."""
        g = torch.Generator().manual_seed(seed)
        return {m: kaiming_uniform(tuple(shapes[m]), g) for m in self.targets}

    @torch.no_grad()
    def init_adapters(self, model: nn.Module, seed: int) -> None:
        """``A`` from :meth:`fresh_a`, ``B = 0``."""
        fresh = self.fresh_a({m: tuple(self.lora_a(model, m).shape) for m in self.targets}, seed)
        for module in self.targets:
            self.assign(self.lora_a(model, module), fresh[module])
            self.lora_b(model, module).zero_()

    def prepare(self, model: nn.Module) -> None:
        """Hook after the default init (FR-LoRA: PiSSA init of the adapters and residual base)."""

    # ------------------------------------------------------------------ client side
    def trainable(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(adapter params, head params) that train on the client."""
        adapters: list[nn.Parameter] = []
        for module in self.targets:
            if self.train_a():
                adapters.append(self.lora_a(model, module))
            if self.train_b():
                adapters.append(self.lora_b(model, module))
        return adapters, list(self.head_params(model).values())

    def adapter_weight_decay(self, ctx: ClientContext) -> float:
        return ctx.train.weight_decay

    def build_optimizer(self, ctx: ClientContext, adapters: list[nn.Parameter], heads: list[nn.Parameter]) -> torch.optim.Optimizer:
        tc = ctx.train
        if self.traits.optimizer == "adamw":
            head_lr = tc.head_lr if tc.head_lr is not None else tc.lr
            groups = [
                {"params": adapters, "lr": tc.lr, "weight_decay": self.adapter_weight_decay(ctx)},
                {"params": heads, "lr": head_lr, "weight_decay": tc.weight_decay},
            ]
            return torch.optim.AdamW([g for g in groups if g["params"]], betas=tuple(tc.betas), eps=tc.eps)
        lr = tc.sgd_lr if tc.sgd_lr is not None else self.options.sgd_lr
        lr = float(DEFAULT_SGD_LR if lr is None else lr)
        head_lr = lr * tc.head_lr / tc.lr if tc.head_lr is not None else lr
        wd = float(self.options.sgd_weight_decay)
        groups = [{"params": adapters, "lr": lr}, {"params": heads, "lr": head_lr}]
        return torch.optim.SGD([g for g in groups if g["params"]], momentum=tc.sgd_momentum, weight_decay=wd)

    def start_notes(self, train: Any) -> list[str]:
        """An SGD method (FFA-LoRA, LoRA-FAIR) does not read ``train.lr``: when ``train.sgd_lr`` is
        not set, say which rate it trains at, so a sweep of ``train.lr`` is not silently a no-op."""
        if self.traits.optimizer != "sgd" or train.sgd_lr is not None:
            return []
        lr, where = (self.options.sgd_lr, "option sgd_lr") if self.options.sgd_lr is not None else (DEFAULT_SGD_LR, "the default")
        return [f"method {self.name} trains with SGD at lr {float(lr):g} ({where}); train.lr={float(train.lr):g} is not "
                "used — set train.sgd_lr to choose its rate"]

    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        """Put the broadcast (and any per-round re-initialisation) into the client model."""
        raise NotImplementedError

    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        """The typed entries this client sends after training."""
        raise NotImplementedError

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        """T: load the broadcast, build a fresh optimizer, run ``local_train``, upload."""
        self.load_broadcast(model, broadcast, ctx)
        adapters, heads = self.trainable(model)
        optimizer = self.build_optimizer(ctx, adapters, heads)
        with self.site_rank_mask(model, optimizer, ctx.client):
            stats = local_train(model, optimizer, ctx, clip_params=adapters + heads)
        meta = {"client": int(ctx.client), "round": int(ctx.round), "num_examples": int(ctx.num_examples), **stats}
        return Payload(self.site_slice(self.upload_entries(model), ctx.client), meta)

    # ------------------------------------------------------------------ sites at different ranks
    def adapter_product(self, model: nn.Module, module: str) -> torch.Tensor:
        """The adapter's ``B A`` of one layer (fp32, without the scaling): the layer's weight is
        ``base + s·adapter_product`` (Fed-SB: ``B R A``)."""
        return self.lora_b(model, module).detach().float() @ self.lora_a(model, module).detach().float()

    def site_rank(self, client: int) -> int | None:
        """The rank client ``client`` trains at when it is below the frame (its adapters' tail
        masked), else None (no site ranks, or a site at the largest rank)."""
        if self.site_ranks is None:
            return None
        r = self.rank_of(client)
        return r if r < self.frame_rank else None

    def _tails(self, model: nn.Module, rank: int) -> list[tuple[nn.Parameter, tuple[slice, slice]]]:
        """Every adapter's tail past ``rank``: ``A[rank:]`` and ``B[:, rank:]``."""
        out = []
        for m in self.targets:
            out.append((self.lora_a(model, m), (slice(rank, None), slice(None))))
            out.append((self.lora_b(model, m), (slice(None), slice(rank, None))))
        return out

    @contextmanager
    def site_rank_mask(self, model: nn.Module, optimizer: torch.optim.Optimizer, client: int) -> Iterator[None]:
        """A client below the frame rank trains only the leading ``r_i`` rows of ``A`` and columns of
        ``B`` (module doc): the tail is zeroed now, its gradient zeroed by hooks and the tail zeroed
        again after every optimizer step, until the block ends. No-op without site ranks."""
        rank = self.site_rank(client)
        if rank is None:
            yield
            return
        tails = self._tails(model, rank)

        @torch.no_grad()
        def zero_tails(*_: Any) -> None:
            for p, idx in tails:
                p[idx] = 0

        def masked(idx: tuple[slice, slice]):
            def hook(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad[idx] = 0
                return grad
            return hook

        zero_tails()
        handles = [p.register_hook(masked(idx)) for p, idx in tails if p.requires_grad]
        handles.append(optimizer.register_step_post_hook(zero_tails))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def site_slice(self, entries: dict[str, Any], client: int) -> dict[str, Any]:
        """The upload of a client below the frame rank: each adapter pair as its leading block
        ``LowRank(B[:, :r_i], A[:r_i])`` (the rest of the entries as they are)."""
        rank = self.site_rank(client)
        if rank is None:
            return entries
        out = dict(entries)
        for m in self.targets:
            e = out.get(pair_key(m))
            if isinstance(e, LowRank):
                out[pair_key(m)] = LowRank(e.left[:, :rank].clone(), e.right[:rank].clone())
        return out

    def expected_rank(self, upload: Payload) -> int:
        """The rank of the factor pairs an upload must carry: its site's (``upload.meta["client"]``)."""
        if self.site_ranks is None:
            return self.rank
        return self.rank_of(int(upload.meta.get("client", -1)))

    # ------------------------------------------------------------------ payload helpers
    @torch.no_grad()
    def pair_entries(self, model: nn.Module) -> dict[str, Any]:
        return {
            pair_key(m): LowRank(self.lora_b(model, m).detach().cpu().clone(), self.lora_a(model, m).detach().cpu().clone())
            for m in self.targets
        }

    def head_entries(self, values: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {n: Dense(values[n]) for n in self.heads}

    @staticmethod
    def round_meta(ctx: Any) -> dict[str, Any]:
        return {"round": int(ctx.round), "round_seed": int(ctx.round_seed)}

    def broadcast_merged(self, state: ServerState, ctx: Any) -> Payload:
        """Down-link of methods that merge updates into the base (FLoRA, FR-LoRA): the dense
        adapted matrices W and the head (a factored downlink adds the model version and its
        per-client message replaces W by its chain: fedgalore.methods.downlink_mixin)."""
        entries: dict[str, Any] = {w_key(m): Dense(state.params[w_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    @torch.no_grad()
    def load_merged(self, model: nn.Module, broadcast: Payload, ws: dict[str, torch.Tensor]) -> None:
        """Load the merged matrices ``ws`` (by ``w_key``: the broadcast's W, a factored downlink's
        chain already rebuilt, fedgalore.methods.downlink_mixin ``start_matrices``) into the base
        layers and the broadcast's head."""
        for m in self.targets:
            self.assign(self.base_weight(model, m), ws[w_key(m)])
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    def merged_downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Version 0 of the merged base matrices (the set-up model's, fp32 copies)."""
        return {w_key(m): self.base_weight(model, m).detach().float().cpu().clone() for m in self.targets}

    def validate_upload(self, state: ServerState, upload: Payload, ctx: Any) -> str | None:
        """Factor pairs must be ``LowRank(B (out×r), A (r×in))`` of each adapted module."""
        for m in self.targets:
            key = pair_key(m)
            if key not in upload.entries:
                continue
            e = upload.entries[key]
            if not isinstance(e, LowRank):
                return f"{key}: expected a LoRA factor pair, got {type(e).__name__}"
            out_f, in_f = self.shapes[m]
            r = self.expected_rank(upload)
            if tuple(e.left.shape) != (out_f, r) or tuple(e.right.shape) != (r, in_f):
                return f"{key}: factors {tuple(e.left.shape)}·{tuple(e.right.shape)} != ({out_f}, {r})·({r}, {in_f})"
        return None

    @staticmethod
    def upload_pair(upload: Payload, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B_i, A_i) of one module from an upload, in fp32."""
        b, a = _pair(upload[pair_key(module)])
        return b.float(), a.float()

    @staticmethod
    def upload_tensor(upload: Payload, key: str) -> torch.Tensor:
        return _tensor(upload[key]).float()

    def average_heads(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float]) -> None:
        """Head parameters: ``θ ← Σ_i p_i θ_i`` (fp32)."""
        for n in self.heads:
            state.params[n] = weighted_sum([self.upload_tensor(u, n) for u in uploads], weights)

    def server_heads(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {n: t.float() for n, t in self.head_state(model).items()}


def matrix_shape(module: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a linear layer — from its features, since a quantised layer's ``weight``
    (bitsandbytes ``Params4bit``) is stored packed in another shape."""
    if hasattr(module, "out_features") and hasattr(module, "in_features"):
        return int(module.out_features), int(module.in_features)
    return tuple(module.weight.shape)  # type: ignore[return-value]


def check_weights(uploads: Sequence[Payload], weights: Sequence[float]) -> list[float]:
    if len(uploads) != len(weights) or not uploads:
        raise MethodError(f"aggregate needs one weight per upload (got {len(uploads)} uploads, {len(weights)} weights)")
    return [float(w) for w in weights]


def lifted(b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """``s · B A`` in fp32."""
    return scaling * (b.float() @ a.float())


class GlobalFactors(LoraMethod):
    """Base of the LoRA methods whose server keeps one pair of global factors ``(B̄, Ā)`` and the
    head, broadcasts them as they are, and whose clients start from them and upload their trained
    pair (FedIT, FedEx-LoRA, and — at the frame rank, each site its leading block — FlexLoRA and
    HetLoRA). A client's effective update is ``s(B_iA_i − B̄[:, :r_i]Ā[:r_i])`` against the block it
    started from (``r_i`` its rank: all of it without site ranks)."""

    def init_server_state(self, model: nn.Module) -> ServerState:
        params: dict[str, torch.Tensor] = {}
        for m in self.targets:
            params[a_key(m)] = self.lora_a(model, m).detach().float().cpu().clone()
            params[b_key(m)] = self.lora_b(model, m).detach().float().cpu().clone()
        params.update(self.server_heads(model))
        return ServerState(params=params, meta={"scaling": self.scaling})

    def broadcast(self, state: ServerState, ctx: Any) -> Payload:
        entries: dict[str, Any] = {pair_key(m): LowRank(state.params[b_key(m)], state.params[a_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        for m in self.targets:
            b, a = self.upload_pair(broadcast, m)
            self.assign(self.lora_a(model, m), a)
            self.assign(self.lora_b(model, m), b)
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        return {**self.pair_entries(model), **self.head_entries(self.head_state(model))}

    def start_pair(self, state: ServerState, module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B[:, :r], A[:r])``: what a rank-``r`` client started from (fp32)."""
        return state.params[b_key(module)][:, :rank].float(), state.params[a_key(module)][:rank].float()

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s(B_iA_i − B[:, :r_i]A[:r_i])`` against the truncation the client started from."""
        r = self.expected_rank(upload)
        return {w_key(m): lifted(*self.upload_pair(upload, m), self.scaling) - lifted(*self.start_pair(state, m, r), self.scaling)
                for m in self.targets}

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s(B_iA_i − B[:, :r_i]A[:r_i])`` as two factored terms (federation.robust)."""
        from fedgalore.federated.robust import factored_term

        r, out = self.expected_rank(upload), {}
        for m in self.targets:
            b, a = self.upload_pair(upload, m)
            b0, a0 = self.start_pair(state, m, r)
            out[w_key(m)] = [factored_term(self.scaling * b, a), factored_term(-self.scaling * b0, a0)]
        return out

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.lora_a(model, m), state.params[a_key(m)])
            self.assign(self.lora_b(model, m), state.params[b_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})


class NestedFactorsMethod(GlobalFactors):
    """Base of the LoRA methods whose server keeps one pair of global factors at the frame rank
    ``R`` (the largest site rank) and whose sites train its leading block (FlexLoRA, HetLoRA).

    The broadcast is common: ``LowRank(B, A)`` of rank ``R`` + the head; client ``i`` loads it and
    keeps the leading ``r_i`` columns of ``B`` and rows of ``A`` (:meth:`LoraMethod.site_rank_mask`
    zeroes the tail — the truncation ``B[:, :r_i]``, ``A[:r_i]``), trains them with AdamW and
    uploads ``LowRank(B_i, A_i)`` of rank ``r_i`` + the head. A site below ``R`` is therefore sent
    ``(R − r_i)(m + n)`` values per matrix it discards: the price of a broadcast that is the same
    for every client (the round loop's). Subclasses implement :meth:`combine` (A for one matrix).
    """

    #: subclasses declare ``traits`` with ``site_ranks=True``: the uploads are of each site's own rank (module doc)

    def release_reference(self, broadcast: Payload | None, key: str, upload: Payload | None = None) -> Any:
        """The broadcast's entry, a factor pair cut to the upload's rank (what the client started from)."""
        ref = super().release_reference(broadcast, key, upload)
        if isinstance(ref, LowRank) and upload is not None and isinstance(upload.entries.get(key), LowRank):
            r = upload[key].left.shape[1]
            return LowRank(ref.left[:, :r], ref.right[:r])
        return ref

    def combine(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
                module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The new global ``(B, A)`` of one matrix (rank :attr:`frame_rank`) from the clients'
        factors (each of its own rank) and the round's weights."""
        raise NotImplementedError

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: Any) -> dict[str, torch.Tensor]:
        """A: :meth:`combine` per matrix, the head averaged; returns ``ΔW̄ = s(BA − B_oldA_old)``
        of the server's model."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        for m in self.targets:
            b_new, a_new = self.combine([self.upload_pair(u, m) for u in uploads], p, m)
            if ctx.diagnostics:
                delta[w_key(m)] = lifted(b_new, a_new, self.scaling) - lifted(state.params[b_key(m)], state.params[a_key(m)], self.scaling)
            state.params[a_key(m)], state.params[b_key(m)] = a_new, b_new
        self.average_heads(state, uploads, p)
        return delta
