"""The factored downlink (benchmarks/RESULTS.md §9.4): a round's aggregate update instead of the dense model.

Algorithm 1 of the paper broadcasts the global weights ``W_k`` every round (line 5). For a
GaLore matrix the round's aggregate update is low rank (paper §5, eq. of operator A):

    ΔW_k = Σ_i p_i ΔW_i = a_k W_k + Σ_i p_i Σ_q L_iq R_iq,     a_k = Σ_i p_i decay_i

(``a_k``: the decoupled weight decay, one scalar; data-driven terms ``L R`` of rank r per client;
terms on a shared seeded basis merge in coefficient space, ``(Σ_i p_i C_iq) P_q``). A client
that holds ``W_h`` reaches ``W_k`` by applying the updates ``h+1..k`` in order,

    W_v = W_{v-1} + ΔW_v(W_{v-1})        (ΔW_v is "scale × W_{v-1} + low rank")

so only the factors and scalars travel. The server applies the *same* function
(:func:`apply_update`) to its own state, so a client's reconstruction is the server's
``W_k`` up to the float arithmetic of the machine it runs on (bit-identical on the same kernels).

Versions: ``W_0`` is the initial (public, pretrained) model every process builds identically;
``W_v`` the model after the v-th aggregation. The server keeps, per matrix, the chain of the last
updates whose tensor bytes together stay **below the dense matrix's** (:func:`record_update`):
a client whose held version is older than that chain (or that holds nothing) gets the matrix
dense — the dense send is never more bytes than the chain it replaces, so the rule is "per
matrix, whichever is smaller". Plain (non-factored) parameters always go dense: their aggregate
is a dense delta of the parameter's own size, so a delta never saves bytes.

Wire layout of a client's broadcast (a plain :class:`~fedgalore.protocol.payload.Payload`):
a dense matrix under its own name (as the dense downlink), a chain entry under
``downlink/{v}/{name}`` (a :class:`GaLoreUpdate` with the weights folded into its factors), and
``meta["downlink"] = {"from": h, "to": k}``. The client checks that it holds version ``h`` for
every chained matrix (:func:`reconstruct`) and refuses otherwise (never a silent mismatch).
Each chained matrix also travels with the server's fingerprint of ``W_k`` under
``downlink_check/{name}`` (:func:`fingerprint`: four random bilinear probes and the norm, fixed
size), and the client checks its rebuilt matrix against it: a chain that does not rebuild the
server's model — a stale cache, a server that changed ``W`` after recording the update (a server
optimizer under the factored downlink) — is refused, not trained on.

Deviation from the paper: Algorithm 1 broadcasts ``W``; this sends the same ``W`` as a chain of
exact updates. Nothing about training changes except float rounding of ``W_k`` (the server's
``W_k`` is computed by :func:`apply_update` instead of one dense sum).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fedgalore.protocol.bases import frame_of, padded_sum
from fedgalore.protocol.payload import (
    Dense,
    Entry,
    GaLoreUpdate,
    LowRank,
    Payload,
    PayloadError,
    SeededLowRank,
    encoded_size,
    flatten_entries,
)
from fedgalore.protocol.state import ServerState

__all__ = [
    "CHAIN_PREFIX",
    "DownlinkError",
    "ClientCache",
    "weighted_update",
    "apply_update",
    "tensor_bytes",
    "dense_bytes",
    "version",
    "record_update",
    "chain_versions",
    "held_versions",
    "mark_sent",
    "client_payload",
    "reconstruct",
    "fingerprint",
    "CHECK_PREFIX",
]

#: key prefix of the chain entries, in a broadcast and in ``ServerState.moments``
CHAIN_PREFIX = "downlink/"
#: key prefix of the server's fingerprints of the chained matrices, in a broadcast
CHECK_PREFIX = "downlink_check/"
#: random probes per fingerprint, and the tolerance of the check (module doc, :func:`fingerprint`)
CHECK_PROBES = 4
CHECK_TOL = 1e-5
_META = "downlink_version"
_HELD = "downlink_held"


class DownlinkError(PayloadError):
    """A factored broadcast that this client cannot apply (it does not hold the chain's base)."""


def weighted_update(updates: Sequence[GaLoreUpdate], weights: Sequence[float]) -> GaLoreUpdate:
    """``Σ_i p_i ΔW_i`` as one factored record (operator A of Algorithm 1, line 11, kept factored).

    ``decay = Σ_i p_i decay_i``; each data-driven term ``L R`` becomes ``(p_i L) R``; seeded terms
    with the same (seed, side, frame) merge as ``(Σ_i p_i C_i) P`` (the order of
    :func:`fedgalore.methods.fedgalore.aggregate_galore_updates`: data-driven terms as met, then
    the merged seeded ones). fp32 factors. No truncation: the rank is the sum of the terms'.

    Sites at different ranks (nested seeded bases, :func:`fedgalore.protocol.bases.seeded_basis`):
    a rank-``r_i`` term on the leading ``r_i`` vectors of the rank-``F`` frame of seed ``s`` is the
    rank-``r_max`` term whose coefficients ``C_i`` are zero-padded to ``r_max`` columns (right) /
    rows (left), so ``Σ_i p_i C_i P_i = (Σ_i p_i pad(C_i)) P_{r_max}`` exactly: the merged term has
    the largest rank present. Terms of one seed drawn at different ranks without a common frame
    are different bases and stay separate terms (still exact).
    """
    if not updates:
        raise ValueError("weighted_update needs at least one update")
    shape = tuple(updates[0].shape)
    terms: list[LowRank | SeededLowRank] = []
    seeded: dict[tuple[int, str, int], SeededLowRank] = {}
    decay = 0.0
    for upd, p in zip(updates, weights):
        if tuple(upd.shape) != shape:
            raise ValueError(f"update shapes differ: {tuple(upd.shape)} vs {shape}")
        p = float(p)
        decay += p * upd.decay
        for t in upd.terms:
            if isinstance(t, SeededLowRank):
                frame = t.rank if t.frame is None else int(t.frame)
                key = (t.seed, t.side, frame)
                coef = t.coef.float() * p
                acc = seeded.get(key)
                if acc is not None:
                    coef = padded_sum(acc.coef, coef, t.side)
                rank = coef.shape[1] if t.side == "right" else coef.shape[0]
                seeded[key] = SeededLowRank(coef, t.seed, t.side, t.shape, frame_of(rank, frame))
            else:
                terms.append(LowRank(t.left.float() * p, t.right.float()))
    return GaLoreUpdate(decay, tuple(terms) + tuple(seeded.values()), shape)  # type: ignore[arg-type]


@torch.no_grad()
def apply_update(w: torch.Tensor, update: Entry, return_delta: bool = True) -> torch.Tensor | None:
    """``W ← W + ΔW(W)`` in place (fp32 ``w``); returns ``ΔW`` as an ``m × n`` matrix when
    ``return_delta`` (computed on the side, for the diagnostics), else ``None``. The one function
    both the server (its state) and every client (its held copy) use, so both compute the same
    bits; ``return_delta`` does not change them.

    ``GaLoreUpdate``: ``ΔW = decay·W + Σ_q L_q R_q`` with ``W`` the model the round started from,
    computed as ``W ← W + decay·W`` then ``W ← W + [L_1 … L_Q][R_1; …; R_Q]`` — one GEMM of the
    stacked factors into ``W`` (``addmm_``), two passes over ``W`` and no ``m × n`` temporary
    (the dense sum of per-term products took about ten, 0.3 s a round at SmolLM2's 210
    matrices). ``Dense``: ``ΔW`` itself; other low-rank entries: their factors' product."""
    shape = tuple(update.shape)
    if shape != tuple(w.shape):
        raise DownlinkError(f"update of shape {shape} for a matrix of shape {tuple(w.shape)}")
    delta = None
    if return_delta:  # the update as an m × n matrix (for the diagnostics), from W before it moves
        delta = update.tensor.float() if isinstance(update, Dense) else (
            update.materialize(w) if isinstance(update, GaLoreUpdate) else update.materialize())
    if isinstance(update, GaLoreUpdate):
        if update.decay != 0.0:
            w.add_(w, alpha=float(update.decay))
        _add_products(w, [t.factors() for t in update.terms])
    elif isinstance(update, Dense):
        w.add_(update.tensor.float())
    elif isinstance(update, (LowRank, SeededLowRank)):
        _add_products(w, [update.factors()])
    else:
        w.add_(update.materialize())
    return delta


def _add_products(w: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``W += Σ_q L_q R_q`` as one GEMM of the stacked factors."""
    pairs = [(a, b) for a, b in pairs if a.shape[1] > 0]
    if not pairs:
        return
    if len(pairs) == 1:
        left, right = pairs[0]
    else:
        left = torch.cat([a for a, _ in pairs], 1)
        right = torch.cat([b for _, b in pairs], 0)
    w.addmm_(left.to(w.dtype), right.to(w.dtype))


def tensor_bytes(entry: Entry) -> int:
    """Bytes of the tensors ``entry`` puts on the wire (seeded bases count as their seed: 0).
    Remembered per entry object while it lives (a kept chain entry is measured once, not every
    round: payload entries are immutable)."""
    key = id(entry)
    n = _TENSOR_BYTES.get(key)
    if n is None:
        _, tensors = flatten_entries({"x": entry}, materialize=False)
        n = sum(t.numel() * t.element_size() for t in tensors.values())
        _TENSOR_BYTES[key] = n
        weakref.finalize(entry, _TENSOR_BYTES.pop, key, None)
    return n


_TENSOR_BYTES: dict[int, int] = {}


def dense_bytes(w: torch.Tensor) -> int:
    return w.numel() * w.element_size()


# ----------------------------------------------------------------------------- server side
def version(state: ServerState) -> int:
    """Aggregations applied to the server's model so far (``W_version`` is the current model)."""
    return int(state.meta.get(_META, 0))


def _key(v: int, name: str) -> str:
    return f"{CHAIN_PREFIX}{v}/{name}"


def chain_versions(state: ServerState, name: str) -> list[int]:
    """The versions whose update of ``name`` the server keeps, ascending."""
    return _chain_index(state).get(name, [])


def _chain_index(state: ServerState) -> dict[str, list[int]]:
    """Every chained matrix's kept versions, ascending, from one pass over ``state.moments``
    (per-name scans were quadratic: 210 matrices × their chains at SmolLM2, 0.2 s a round)."""
    pre = CHAIN_PREFIX
    out: dict[str, list[int]] = {}
    for k in state.moments:
        if k.startswith(pre):
            v, _, n = k[len(pre):].partition("/")
            out.setdefault(n, []).append(int(v))
    for vs in out.values():
        vs.sort()
    return out


def record_update(state: ServerState, updates: Mapping[str, Entry], new_version: int | None = None) -> None:
    """Keep this aggregation's factored updates (one per matrix name) as version ``v+1`` and
    drop, per matrix, the oldest ones until the chain's tensor bytes are below the dense matrix's
    (a client behind that chain gets the matrix dense: never more bytes). Stored in
    ``state.moments`` under ``downlink/{v}/{name}`` (checkpointed with the payload codec); the
    version counter in ``state.meta``."""
    v = version(state) + 1 if new_version is None else int(new_version)
    index = _chain_index(state)
    for name, entry in updates.items():
        state.moments[_key(v, name)] = entry
        limit = dense_bytes(state.params[name])
        kept = sorted(set(index.get(name, [])) | {v})
        sizes = {u: tensor_bytes(state.moments[_key(u, name)]) for u in kept}
        total = sum(sizes.values())
        while kept and total >= limit:
            u = kept.pop(0)
            total -= sizes[u]
            del state.moments[_key(u, name)]
    state.meta[_META] = v


def held_versions(state: ServerState, clients: Sequence[int]) -> dict[int, int]:
    """The model version the server last sent each client (``0`` for a client never sent one: it
    holds the public pretrained ``W_0``). This is the server's record of what a client that keeps
    its last global model holds — what the ledger's factored downlink is counted from in a
    simulation, and what a deployed server tracks. Kept in ``state.meta`` (checkpointed), so a
    resumed run sends, and counts, the same bytes as an uninterrupted one."""
    table = state.meta.get(_HELD, {})
    return {int(c): int(table.get(str(int(c)), 0)) for c in clients}


def mark_sent(state: ServerState, clients: Sequence[int]) -> None:
    """Record that ``clients`` were sent the current model version (:func:`held_versions`)."""
    table = dict(state.meta.get(_HELD, {}))
    cur = version(state)
    for c in clients:
        table[str(int(c))] = cur
    state.meta[_HELD] = table


def client_payload(state: ServerState, dense: Payload, names: Sequence[str], held: int | None) -> Payload:
    """The broadcast for a client that holds version ``held`` of ``names`` (``None``: nothing).

    Starts from the dense broadcast ``dense`` (every parameter dense + the rest of the round's
    message) and replaces each matrix of ``names`` by its chain ``held+1..current`` when the
    server keeps all of it and its encoded entries (tensors and their header) take fewer bytes
    than the dense matrix's tensor: per matrix, the message never grows."""
    cur = version(state)
    if held is None or held > cur:
        return dense
    entries: dict[str, Any] = dict(dense.entries)
    chained = False
    empty = encoded_size(Payload({}))
    index = _chain_index(state)
    need = list(range(held + 1, cur + 1))
    for n in names:
        have = set(index.get(n, ()))
        if all(v in have for v in need):
            chain: dict[str, Any] = {_key(v, n): state.moments[_key(v, n)] for v in need}
            if chain:
                chain[CHECK_PREFIX + n] = Dense(_server_fingerprints(state, [n])[n].float())
            # on the wire, headers included, below the dense matrix's tensor bytes alone (small
            # matrices: the chain's per-tensor headers can outweigh its savings)
            if chain and encoded_size(Payload(chain)) - empty >= dense_bytes(state.params[n]):
                continue
            del entries[n]
            entries.update(chain)
            chained = True
    if not chained:
        return dense
    return Payload(entries, {**dense.meta, "downlink": {"from": int(held), "to": cur}})


def fingerprint(w: torch.Tensor) -> torch.Tensor:
    """A fixed-size fingerprint of a matrix ``W (m × n)`` that survives float rounding but not a
    wrong matrix: ``y_j = a_jᵀ W x_j`` for ``j < 4`` with Gaussian ``a_j / √m``, ``x_j / √n``
    drawn from a generator seeded by the shape only (every process draws the same), followed by
    ``‖W‖_F``; float64, ``(5,)``. For a difference ``E`` between two matrices each probe is about
    ``‖E‖_F / √(mn)`` times a standard normal, so :func:`fingerprints_match`'s tolerance
    ``1e-5 ‖W‖_F / √(mn)`` per probe refuses a matrix off by more than about ``1e-4 ‖W‖_F``
    (four probes: missing it needs all four below a tenth of their scale) and accepts the
    differences of float rounding (``~1e-6 ‖W‖_F`` after a chain, across CPU kernels). One pass
    over ``W`` (an ``m × n × 4`` product)."""
    m, n = int(w.shape[0]), int(w.shape[1])
    g = torch.Generator().manual_seed(0x5EED_C0DE ^ (m * 1_000_003 + n))
    a = torch.randn(m, CHECK_PROBES, generator=g, dtype=torch.float64) / m**0.5
    x = torch.randn(n, CHECK_PROBES, generator=g, dtype=torch.float64) / n**0.5
    wf = w.detach()
    wx = (wf.float() @ x.to(device=wf.device, dtype=torch.float32)).double().cpu()  # m × 4
    y = (a * wx).sum(dim=0)
    return torch.cat([y, torch.linalg.vector_norm(wf.float()).double().cpu().reshape(1)])


def fingerprints_match(mine: torch.Tensor, server: torch.Tensor, shape: Sequence[int]) -> bool:
    """Whether a rebuilt matrix's :func:`fingerprint` ``mine`` is the server's ``server`` up to
    float rounding: every probe within ``1e-5 ‖W‖_F / √(mn)`` (the server's norm)."""
    m, n = int(shape[0]), int(shape[1])
    tol = CHECK_TOL * float(server[-1]) / (m * n) ** 0.5
    return bool((mine[:-1].double() - server[:-1].double()).abs().max() <= tol) if tol > 0 else bool(torch.equal(mine[:-1], server[:-1]))


def _server_fingerprints(state: ServerState, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """:func:`fingerprint` of the current ``W`` of ``names``, computed once per model version
    (cached on the state object; a pure function of ``state.params``, so never checkpointed)."""
    cur = version(state)
    cache = getattr(state, "_downlink_fingerprints", None)
    if cache is None or cache[0] != cur:
        cache = (cur, {})
        object.__setattr__(state, "_downlink_fingerprints", cache)
    fps = cache[1]
    for n in names:
        if n not in fps:
            fps[n] = fingerprint(state.params[n])
    return {n: fps[n] for n in names}


# ----------------------------------------------------------------------------- client side
@dataclass
class ClientCache:
    """What a stateful client keeps between rounds: the version it holds and those matrices (fp32).
    ``owned``: the tensors are this client's alone (it may apply the next chain to them in place);
    False for a store shared with others (the simulation's public ``W_0``)."""

    version: int
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    owned: bool = False


def reconstruct(payload: Payload, names: Sequence[str], cache: ClientCache | None, in_place: bool = False) -> dict[str, torch.Tensor]:
    """The matrices ``names`` of the broadcast's model: dense entries as sent, chained ones by
    applying ``downlink/{v}/{name}`` for ``v = from+1..to`` to the cache's copy (fp32). By default
    new tensors (the cache is not modified); ``in_place`` applies the chain to the cache's own
    tensors (when it ``owned`` them) and returns them (a client that keeps its model: no copy of
    every matrix, twice, per round) — only after every chained matrix is checked, so a refused
    broadcast leaves the cache as it was. Raises :class:`DownlinkError` when the cache does not hold the chain's base version
    or a chain entry is missing, and when a rebuilt matrix does not match the server's
    :func:`fingerprint` sent with it (``downlink_check/{name}``): the chain does not rebuild the
    server's model. A cache updated in place is then marked invalid (version -1: the next
    broadcast must be dense)."""
    info = payload.meta.get("downlink")
    out: dict[str, torch.Tensor] = {}
    chained = []
    for n in names:
        if n in payload.entries:
            continue
        if not isinstance(info, dict):
            raise DownlinkError(f"broadcast has neither {n!r} nor a downlink chain")
        start, stop = int(info["from"]), int(info["to"])
        if cache is None or cache.version != start or n not in cache.params:
            held = None if cache is None else cache.version
            raise DownlinkError(f"{n}: the broadcast's chain starts at version {start}, this client holds {held}")
        for v in range(start + 1, stop + 1):
            if _key(v, n) not in payload.entries:
                raise DownlinkError(f"{n}: chain entry of version {v} missing")
        chained.append(n)
    for n in names:
        if n in payload.entries:
            out[n] = payload.entries[n].materialize()
            continue
        w = cache.params[n]  # type: ignore[union-attr]
        if not (in_place and cache.owned and w.dtype == torch.float32 and w.is_contiguous()):  # type: ignore[union-attr]
            w = w.detach().float().clone()
        for v in range(int(info["from"]) + 1, int(info["to"]) + 1):  # type: ignore[index]
            apply_update(w, payload.entries[_key(v, n)], return_delta=False)
        check = payload.entries.get(CHECK_PREFIX + n)
        if check is not None and not fingerprints_match(fingerprint(w), check.materialize(), tuple(w.shape)):
            if w is cache.params[n]:  # type: ignore[union-attr]
                cache.version = -1  # type: ignore[union-attr]
            raise DownlinkError(
                f"{n}: the matrix rebuilt from the chain {info['from']}->{info['to']} is not the server's (fingerprint "  # type: ignore[index]
                "mismatch): the server's model changed after it recorded the update (a server optimizer with the "
                "factored downlink?) or this client's copy is stale; use method.options.downlink=dense")
        out[n] = w
    return out
