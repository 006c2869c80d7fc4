"""FLoRA (Wang et al., NeurIPS 2024): stack the client adapters, merge into W, start fresh.

T  each round every sampled client attaches *fresh* LoRA adapters to the current global base
   (``A`` by PEFT's law, ``B = 0``) and trains ``A``, ``B`` and the head with AdamW (fresh).
   The fresh ``A`` is drawn from a local generator seeded by
   ``mixed_seed(adapter_seed, round_seed, client)`` — option ``fresh_init: per_client``
   (default; the reference calls PEFT's initialisation once per client, so every client gets its
   own random ``A``) — or ``mixed_seed(adapter_seed, round_seed)`` with
   ``fresh_init: shared`` (one ``A`` per round for everybody). Either way any process rebuilds
   it from integers, so it never has to travel.
A  stacking: ``B_st = [B_1 … B_K]`` (m×Kr), ``A_st = [p_1A_1; …; p_KA_K]`` (Kr×n), so
   ``ΔW̄ = s·B_st A_st = s·Σ_i p_i B_i A_i`` exactly (fp32), then ``W ← W + ΔW̄`` (the reference's
   ``merge_and_unload`` of the stacked adapter, whose α and r are both multiplied by K so ``s``
   is unchanged). The head is averaged size-weighted. Adapters are re-initialised next round.
S  none.

Under client-level DP (fedgalore.privacy.client_dp) the released change of a pair is measured
from what the client started from — ``(B = 0, A = its fresh A)``, rebuilt on the server from the
public seeds (:meth:`FLoRA.release_reference`) — not from zero: the fresh ``A``'s own norm
(~‖U(−1/√n, 1/√n)‖, far above a round's change) would otherwise fill the clip bound and scale the
trained change away. It is public, so the guarantee is the same.

Sites at different ranks (``federation.site_ranks``; fedgalore.methods.lora_common): site ``i``
trains a rank-``r_i`` adapter (its fresh ``A``: the leading ``r_i`` rows of the rank-``R`` draw) and
uploads ``LowRank(B_i, A_i)`` of rank ``r_i``; stacking takes any ranks — ``B_st`` is
``m × Σ r_i`` — and ``ΔW̄ = s·Σ p_i B_i A_i`` stays exact (the paper's heterogeneous setting).

Communication: up ``LowRank(B_i, A_i)`` + head. Down (option ``downlink``, default ``auto`` →
``factored``; fedgalore.methods.downlink_mixin): a client that holds the model of version ``h``
gets the stacked factors ``(s·B_st, A_st)`` of every round since ``h`` — the paper's broadcast,
which is only correct for a client that holds the previous round's ``W`` (the reference assumes
``frac = 1``: its stacked config's rank is ``r·num_clients``) — and, per matrix, the dense ``W``
when that chain is gone or would be larger (a client that missed many rounds, or a new one);
the head dense. ``downlink: dense`` sends ``Dense(W)`` + head every round, as before. The
server's ``W`` is the same under both (one function applies the update on both sides).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from fedgalore.federated.seeding import mixed_seed
from fedgalore.federated.robust import factored_term
from fedgalore.methods.base import option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.downlink_mixin import DOWNLINK_HELP, FactoredDownlink
from fedgalore.methods.lora_common import LoraMethod, LoraOptions, check_weights, lifted, pair_key, w_key
from fedgalore.protocol.payload import LowRank, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = ["FLoRA"]


@dataclass(frozen=True)
class FLoRAOptions(LoraOptions):
    fresh_init: Literal["per_client", "shared"] = option(
        "per_client", "each round's fresh A: one per client (as the reference) or one shared by all clients")
    downlink: Literal["auto", "dense", "factored"] = option("auto", DOWNLINK_HELP)


@register
class FLoRA(FactoredDownlink, LoraMethod):
    name = "flora"
    summary = "fresh LoRA A,B + head with AdamW each round; server merges s·Σp_iB_iA_i into W (stacking)"
    options_class = FLoRAOptions
    #: stacking uses each upload on its own and takes factors of any rank (module doc); W moves by rank ≤ K·r a round
    traits = MethodTraits(downlink="factored", optimizer="adamw", dp_aggregate="individual", site_ranks=True,
                          exact_low_rank=True)

    #: (seed, every target's fresh A) of the last upload :meth:`release_reference` rebuilt
    _fresh: tuple[int, dict[str, torch.Tensor]] | None = None

    def fresh_seed(self, round_seed: int, client: int) -> int:
        if self.options.fresh_init == "shared":
            return mixed_seed(self.adapter_seed, round_seed)
        return mixed_seed(self.adapter_seed, round_seed, client)

    def release_reference(self, broadcast: Payload | None, key: str, upload: Payload | None = None) -> Any:
        """The untrained value of upload entry ``key``: for an adapter pair ``(B = 0, A₀)`` with
        ``A₀`` the client's fresh ``A`` — :meth:`fresh_a`, as :meth:`init_adapters` drew it, from
        ``fresh_seed(round_seed, client)``, shapes from the upload, the round seed from the
        broadcast's meta, the client from the upload's (public meta: both are released, and
        fixed by the config and the job); else the base rule (the head: the broadcast's)."""
        if upload is None or broadcast is None or "round_seed" not in broadcast.meta or "client" not in upload.meta:
            return super().release_reference(broadcast, key, upload)
        keys = {pair_key(m): m for m in self.targets}
        if key not in keys:
            return super().release_reference(broadcast, key, upload)
        seed = self.fresh_seed(int(broadcast.meta["round_seed"]), int(upload.meta["client"]))
        if self._fresh is None or self._fresh[0] != seed:  # every target's A at once: one draw per upload, not per key
            shapes = {m: tuple(upload[pair_key(m)].right.shape) for m in self.targets}
            if self.site_ranks is not None:  # the client drew at the frame rank and kept the leading rows
                shapes = {m: (self.frame_rank, n) for m, (_, n) in shapes.items()}
            self._fresh = (seed, self.fresh_a(shapes, seed))
        b = upload[key].left
        return LowRank(torch.zeros(b.shape, dtype=torch.float32), self._fresh[1][keys[key]][: b.shape[1]])

    def init_server_state(self, model: nn.Module) -> ServerState:
        params = {w_key(m): self.base_weight(model, m).detach().float().cpu().clone() for m in self.targets}
        params.update(self.server_heads(model))
        return ServerState(params=params, meta={"scaling": self.scaling})

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        msg = self.broadcast_merged(state, ctx)
        msg.meta.update(self.downlink_meta(state))
        return msg

    def downlink_names(self) -> list[str]:
        return [w_key(m) for m in self.targets]

    def downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.merged_downlink_base(model)

    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        self.load_merged(model, broadcast, self.start_matrices(broadcast, ctx.state))
        self.init_adapters(model, self.fresh_seed(ctx.round_seed, ctx.client))

    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        return {**self.pair_entries(model), **self.head_entries(self.head_state(model))}

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``ΔW̄ = s·[B_1…B_K][p_1A_1;…;p_KA_K] = s·Σ p_i B_i A_i``; ``W ← W + ΔW̄``, the
        update kept as the factors ``(s·B_st, A_st)`` (rank K·r; fp32) and applied as the clients
        of the factored downlink apply it (the paper's stacked broadcast, for a client that
        holds the previous W)."""
        p = check_weights(uploads, weights)
        updates = {}
        for m in self.targets:
            pairs = [self.upload_pair(u, m) for u in uploads]
            b_stacked = torch.cat([b.float() for b, _ in pairs], dim=1)
            a_stacked = torch.cat([pi * a.float() for pi, (_, a) in zip(p, pairs)], dim=0)
            updates[w_key(m)] = LowRank(self.scaling * b_stacked, a_stacked)
        delta = self.apply_round_update(state, updates, delta=ctx.diagnostics)
        self.average_heads(state, uploads, p)
        return delta

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s·B_iA_i`` (the adapters started at ``B = 0``)."""
        return {w_key(m): lifted(*self.upload_pair(upload, m), self.scaling) for m in self.targets}

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s·B_iA_i`` as one factored term (federation.robust)."""
        out = {}
        for m in self.targets:
            b, a = self.upload_pair(upload, m)
            out[w_key(m)] = [factored_term(self.scaling * b, a)]
        return out

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.base_weight(model, m), state.params[w_key(m)])
            self.lora_b(model, m).zero_()  # the merged model: no adapter contribution
        self.load_heads(model, {n: state.params[n] for n in self.heads})
