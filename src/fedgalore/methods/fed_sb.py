"""Fed-SB (Singhal, Ponkshe et al., arXiv 2502.15436), on LoRA-SB: train only an ``r × r`` matrix
between two frozen factors, and average it.

Model. Every adapted matrix computes ``W0 x + s·B R A x`` (the paper's ``ΔW = B R A``): ``B``
(m×r) and ``A`` (r×n) frozen and identical at every site, ``R`` (r×r) trained. In PEFT terms the
layer's ``lora_A`` is the two-layer map ``x → A x → R(A x)`` (:class:`SBLatent`, whose
``weight`` is ``R A``), so PEFT's forward and merge give ``W0 + s·B R A``.

T  each client trains ``R`` and the head with AdamW (the reference's optimizer), built fresh each
   round, starting from the global ``R̄``.
A  ``R̄ ← Σ_i p_i R_i`` (the paper's aggregation, its eq. for ``R``), the head likewise. Exact:
   ``B R̄ A = Σ_i p_i B R_i A`` because ``B`` and ``A`` are the same everywhere. ``W0`` never
   changes; the final model is ``W0 + s·B R̄ A``.
S  none.

Initialisation (deviation, named). LoRA-SB sets ``B = U_r``, ``A = V_rᵀ``, ``R = Σ_r`` from a
truncated SVD of a sign step of the gradient of the *pooled* training data (§4b.3, steps 1–3):
no server holds that data, and its release is not private (the reference's own defect, §4b.3 (f)
1). Option ``init``:

* ``weight_svd`` (default): ``B = U_r``, ``A = V_rᵀ`` — the top-``r`` singular subspace of the
  pretrained ``W0`` (public, computed by every process in fp32, signs fixed), ``R = 0``, so the
  model starts at ``W0`` exactly (the reference starts at ``W0 + trunc_r(Ĝ)``, a first step);
* ``random``: ``B``, ``A`` with i.i.d. ``N(0, 1/m)`` and ``N(0, 1/n)`` entries from a local
  generator seeded by option ``adapter_seed`` — bit-identical on every machine — and ``R = 0``.

The exactness of A needs bit-identical ``B``, ``A`` at every site (§4b.3 (f) 4); an SVD can round
differently on other hardware, so every upload carries a fingerprint of its frozen factors
(``meta["frozen_sha"]``) and the server rejects an upload whose factors are not its own (with
``init: weight_svd`` on mixed hardware, use ``init: random``).

Scale: option ``lora_alpha`` defaults to ``r`` (``s = 1``: the reference forces ``α = r``).

Communication, per adapted matrix: down ``Dense(R̄)`` (``r²`` values) + the head; up
``Dense(R_i)`` (``r²``) + the head — independent of the number of clients. ``B`` and ``A`` never
travel: every process builds them (``r(m+n)`` values per matrix if they had to, once).

Client-level DP and secure aggregation: ``R̄`` is a weighted mean of the uploads
(``dp_aggregate = "mean"``) — noise on the sum of ``R``'s ``r²`` coordinates protects the aggregate,
and SecAgg+ gives the server exactly what A needs (the method's selling point). Robust
aggregation: ``R`` lives in the same coordinates at every site, so coordinate-wise statistics
(trimmed mean, median) apply to it, and Krum / the norm filter compare ``s·B(R_i − R̄)A``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

import torch
from torch import nn

from fedgalore.federated.robust import factored_term
from fedgalore.federated.seeding import mixed_seed
from fedgalore.methods.base import MethodError, option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.lora_common import LoraMethod, LoraOptions, check_weights, w_key, weighted_sum
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = ["FedSB", "FedSBOptions", "SBLatent", "r_key", "weight_svd_factors"]


def r_key(module: str) -> str:
    return f"{module}.lora_R.weight"


class SBLatent(nn.Sequential):
    """``x → R(A x)``: PEFT's ``lora_A`` slot holding the frozen ``A`` (``[0]``) and the trained
    ``R`` (``[1]``); ``weight`` is their product ``R A`` (what PEFT reads for dtype and merging)."""

    def __init__(self, a: nn.Linear, rank: int) -> None:
        r = nn.Linear(rank, rank, bias=False, device=a.weight.device, dtype=a.weight.dtype)
        super().__init__(a, r)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self[1].weight @ self[0].weight


def weight_svd_factors(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r, V_rᵀ)`` of ``W0`` in fp32, each singular pair's sign fixed (the largest-magnitude
    entry of ``u_k`` positive), so every process on the same kernels builds the same factors."""
    u, _, vh = torch.linalg.svd(w.detach().float().cpu(), full_matrices=False)
    u, vh = u[:, :rank], vh[:rank]
    idx = u.abs().argmax(dim=0)
    sign = torch.sign(u[idx, torch.arange(u.shape[1])])
    sign[sign == 0] = 1.0
    return (u * sign).contiguous(), (vh * sign[:, None]).contiguous()


@dataclass(frozen=True)
class FedSBOptions(LoraOptions):
    lora_alpha: float | None = option(None, "LoRA α, scaling s = α/r (null: rank, s = 1 as the reference)")
    init: Literal["weight_svd", "random"] = option(
        "weight_svd", "frozen B, A: top-r singular vectors of W0, or seeded Gaussians (R starts at 0 either way)")


@register
class FedSB(LoraMethod):
    name = "fed_sb"
    summary = "frozen B, A (W0's top-r SVD) and a trained r×r R + head with AdamW; server averages R (exact)"
    options_class = FedSBOptions
    #: R̄ and the head are weighted means of the uploads (dp_aggregate mean); R has the same coordinates
    #: at every site (B, A fixed): coordinate-wise statistics apply
    traits = MethodTraits(optimizer="adamw", dp_aggregate="mean", coordinate_uploads=True)

    @classmethod
    def resolve_options(cls, options: FedSBOptions, rank: int) -> FedSBOptions:
        """``lora_alpha`` = rank when not given (``s = 1``, as the reference)."""
        return options if options.lora_alpha is not None else replace(options, lora_alpha=float(rank))

    def __init__(self, rank: int = 8, options: FedSBOptions | None = None) -> None:
        super().__init__(rank, options)
        self.frozen_sha = ""

    # ------------------------------------------------------------------ model access
    def lora_a(self, model: nn.Module, module: str) -> nn.Parameter:
        """The frozen ``A`` (the first layer of :class:`SBLatent`, or PEFT's own before it is built)."""
        slot = self.layer(model, module).lora_A["default"]
        return slot[0].weight if isinstance(slot, SBLatent) else slot.weight

    def lora_r(self, model: nn.Module, module: str) -> nn.Parameter:
        return self.layer(model, module).lora_A["default"][1].weight

    def train_a(self) -> bool:
        return False

    def train_b(self) -> bool:
        return False

    @torch.no_grad()
    def prepare(self, model: nn.Module) -> None:
        """Frozen ``B``, ``A`` (option ``init``) and ``R = 0`` in every adapted layer."""
        g = torch.Generator().manual_seed(mixed_seed(self.adapter_seed, 1))
        digest = hashlib.sha256()
        for m in self.targets:
            layer = self.layer(model, m)
            a_lin = layer.lora_A["default"]
            if self.options.init == "weight_svd":
                b, a = weight_svd_factors(layer.base_layer.weight, self.rank)
            else:
                out_f, in_f = self.shapes[m]
                b = torch.randn(out_f, self.rank, generator=g) / out_f ** 0.5
                a = torch.randn(self.rank, in_f, generator=g) / in_f ** 0.5
            self.assign(a_lin.weight, a)
            self.assign(layer.lora_B["default"].weight, b)
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
                latent = SBLatent(a_lin, self.rank)
            latent[1].weight.zero_()
            layer.lora_A["default"] = latent
            for t in (a_lin.weight, layer.lora_B["default"].weight):
                digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        self.frozen_sha = digest.hexdigest()[:16]

    def setup(self, model: nn.Module, target_modules: Sequence[str], head_params: Sequence[str]) -> nn.Module:
        if self.site_ranks is not None:  # base refusal runs first (use_site_ranks); defensive
            raise MethodError("fed_sb trains one r×r matrix at every site; remove federation.site_ranks")
        model = super().setup(model, target_modules, head_params)
        for m in self.targets:
            self.lora_r(model, m).requires_grad_(True)
        return model

    def trainable(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [self.lora_r(model, m) for m in self.targets], list(self.head_params(model).values())

    def adapter_product(self, model: nn.Module, module: str) -> torch.Tensor:
        """``B R A`` of one adapted layer (fp32), without the scaling."""
        return self.lora_b(model, module).detach().float() @ self.lora_r(model, module).detach().float() @ self.lora_a(model, module).detach().float()

    # ------------------------------------------------------------------ server state
    def init_server_state(self, model: nn.Module) -> ServerState:
        params = {r_key(m): self.lora_r(model, m).detach().float().cpu().clone() for m in self.targets}
        params.update(self.server_heads(model))
        extras: dict[str, torch.Tensor] = {}
        for m in self.targets:
            extras[f"{m}.lora_A.weight"] = self.lora_a(model, m).detach().float().cpu().clone()
            extras[f"{m}.lora_B.weight"] = self.lora_b(model, m).detach().float().cpu().clone()
        return ServerState(params=params, extras=extras, meta={"scaling": self.scaling, "frozen_sha": self.frozen_sha})

    def frozen(self, state: ServerState, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return state.extras[f"{module}.lora_B.weight"].float(), state.extras[f"{module}.lora_A.weight"].float()

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {r_key(m): Dense(state.params[r_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        for m in self.targets:
            self.assign(self.lora_r(model, m), self.upload_tensor(broadcast, r_key(m)))
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        upload = super().client_update(model, broadcast, ctx)
        upload.meta["frozen_sha"] = self.frozen_sha
        return upload

    @torch.no_grad()
    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        entries: dict[str, Any] = {r_key(m): Dense(self.lora_r(model, m).detach().cpu().clone()) for m in self.targets}
        entries.update(self.head_entries(self.head_state(model)))
        return entries

    def validate_upload(self, state: ServerState, upload: Payload, ctx: Any) -> str | None:
        sha = upload.meta.get("frozen_sha")
        if sha is not None and state.meta.get("frozen_sha") and sha != state.meta["frozen_sha"]:
            return (f"the client's frozen B, A (fingerprint {sha}) are not the server's ({state.meta['frozen_sha']}): its "
                    "SVD rounded differently; set method.options.init=random")
        return None

    # ------------------------------------------------------------------ server
    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``R̄ = Σ p_i R_i``; returns ``ΔW̄ = s·B(R̄ − R̄_old)A`` per matrix."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        for m in self.targets:
            r_new = weighted_sum([self.upload_tensor(u, r_key(m)) for u in uploads], p)
            b, a = self.frozen(state, m)
            delta[w_key(m)] = self.scaling * (b @ (r_new - state.params[r_key(m)].float()) @ a)
            state.params[r_key(m)] = r_new
        self.average_heads(state, uploads, p)
        return delta

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s·B(R_i − R̄)A`` against the ``R̄`` the client started from."""
        out = {}
        for m in self.targets:
            b, a = self.frozen(state, m)
            out[w_key(m)] = self.scaling * (b @ (self.upload_tensor(upload, r_key(m)) - state.params[r_key(m)].float()) @ a)
        return out

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s·B(R_i − R̄)A`` as one factored term (federation.robust)."""
        out = {}
        for m in self.targets:
            b, a = self.frozen(state, m)
            dr = self.upload_tensor(upload, r_key(m)) - state.params[r_key(m)].float()
            out[w_key(m)] = [factored_term(self.scaling * (b @ dr), a)]
        return out

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.lora_r(model, m), state.params[r_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})
