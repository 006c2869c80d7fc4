"""Typed payloads for client uploads and server broadcasts, their wire format, and the ledger.

Every message that crosses the client/server boundary is a :class:`Payload`: named entries of
explicit types (docs/design.md §2 "Payloads are explicit types") plus JSON metadata. The wire format
is a single safetensors blob whose header metadata holds the JSON description of the entries, so
nothing is ever pickled; its floats are written in a fixed width (:func:`dump_header_json`), so a
message's size does not depend on the last digits of the floats in its metadata. Communication
is counted from the serialised bytes (:class:`Ledger`), never estimated.

Entry types and the matrix each one stands for:

* :class:`Dense` — ``X`` itself.
* :class:`LowRank` — ``X = L @ R`` with ``L`` (m×r), ``R`` (r×n).
* :class:`SeededLowRank` — GaLore coefficients on a seeded basis: ``X = C @ P`` (right side,
  ``C`` m×r, ``P`` r×n) or ``X = P @ C`` (left side, ``P`` m×r, ``C`` r×n), where ``P`` is
  rebuilt from the integer seed by :func:`fedgalore.protocol.bases.seeded_basis`; only ``C``
  and the seed travel.
* :class:`GaLoreUpdate` — the exact low-rank update record of one GaLore matrix,
  ``ΔW = decay · W0 + Σ_q term_q`` (each term a ``LowRank`` or ``SeededLowRank``).
* :class:`MomentView` — a projected second moment ``v`` in the coordinates of a basis ``P`` (a
  matrix, or an integer seed when it is a seeded basis), with the prior weight of each
  coordinate; its full-space view is ``V = v @ P`` (right) or ``P @ v`` (left) (paper eq.
  "matrix view", §5). Clients upload one per GaLore matrix; the server's synchronised state
  ``v̄`` is one too (docs/design.md §3.2).
* :class:`Factored` — ``X = left @ core @ right.T`` (AJIVE's factored views).

The wire format stores a tensor that several entries share (the same tensor object, e.g. a
data-driven basis used by both an update term and a moment view) once; the ledger counts it once.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, Union

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedgalore.protocol.bases import seeded_basis

__all__ = [
    "Dense",
    "LowRank",
    "SeededLowRank",
    "GaLoreUpdate",
    "MomentView",
    "Factored",
    "Entry",
    "Payload",
    "encode",
    "decode",
    "encoded_size",
    "dump_header_json",
    "transfer",
    "flatten_entries",
    "unflatten_entries",
    "Ledger",
    "PayloadError",
]


class PayloadError(ValueError):
    """A payload could not be decoded or is malformed."""


@dataclass(frozen=True)
class Dense:
    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def materialize(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True)
class LowRank:
    left: torch.Tensor  # (m, r)
    right: torch.Tensor  # (r, n)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[0], self.right.shape[1])

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, R)`` in fp32 with the entry ``= L R``."""
        return self.left.float(), self.right.float()

    def materialize(self) -> torch.Tensor:
        left, right = self.factors()
        return left @ right


@dataclass(frozen=True)
class SeededLowRank:
    coef: torch.Tensor  # (m, r) for side="right"; (r, n) for side="left"
    seed: int
    side: str  # "right" | "left"
    shape: tuple[int, int]  # (m, n) of the full matrix
    #: the rank of the seeded frame whose leading vectors are this term's basis (sites at different
    #: ranks: :func:`fedgalore.protocol.bases.seeded_basis`); None: the term's own rank
    frame: int | None = None

    @property
    def rank(self) -> int:
        return int(self.coef.shape[1] if self.side == "right" else self.coef.shape[0])

    def basis(self) -> torch.Tensor:
        m, n = self.shape
        return seeded_basis(self.seed, m, n, self.rank, self.side, self.frame)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, R)`` in fp32 with the entry ``= L R``: ``(C, P)`` right side, ``(P, C)`` left."""
        p = self.basis()
        return (self.coef.float(), p) if self.side == "right" else (p, self.coef.float())

    def materialize(self) -> torch.Tensor:
        left, right = self.factors()
        return left @ right


@dataclass(frozen=True)
class GaLoreUpdate:
    decay: float  # ΔW = decay * W0 + Σ terms
    terms: tuple[Union[LowRank, SeededLowRank], ...]
    shape: tuple[int, int]

    def materialize(self, w0: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.zeros(self.shape, dtype=torch.float32)
        for t in self.terms:
            out += t.materialize()
        if self.decay != 0.0:
            if w0 is None:
                raise PayloadError("GaLoreUpdate with weight decay needs W0 to materialise")
            out += self.decay * w0.float()
        return out


@dataclass(frozen=True)
class MomentView:
    """A projected second moment ``v`` in the coordinates of a rank-``r`` basis ``P``.

    ``moment``: ``(m, r)`` (right side, ``P`` is ``(r, n)``) or ``(r, n)`` (left side, ``P`` is
    ``(m, r)``). With ``weight`` it is an estimate of ``E[g̃²]`` (the EMA over its evidence, the
    aligned protocol); without, it is used as it is — in FedGaLore's paper mode that is the raw
    projected buffer ``ṽ`` (an EMA that is *not* bias-corrected: Algorithm 1 line 10 uploads the
    buffer, and line 3 warm-starts the next round's buffer from the synchronised one). ``basis`` is
    the matrix ``P``, or ``None`` when ``P`` is the seeded basis ``seeded_basis(seed, m, n, r, side)``.
    ``weight`` (``(r,)``, optional): the prior weight of each basis coordinate — the mass
    ``1 − β2^t`` an Adam EMA of that coordinate has accumulated, moved through basis changes
    (``GaLoreAdamW`` ``bias_correction="weight"``).
    """

    moment: torch.Tensor  # projected second moment: (m, r) right side, (r, n) left side
    side: str  # "right" | "left"
    shape: tuple[int, int]  # (m, n)
    basis: torch.Tensor | None = None  # (r, n) right / (m, r) left; None when seeded
    seed: int | None = None
    weight: torch.Tensor | None = None  # (r,) prior weight per basis coordinate
    #: seeded views: the rank of the seeded frame whose leading vectors are the basis (sites at
    #: different ranks); None: the view's own rank
    frame: int | None = None

    @property
    def rank(self) -> int:
        return int(self.moment.shape[1] if self.side == "right" else self.moment.shape[0])

    def basis_matrix(self) -> torch.Tensor:
        if self.basis is not None:
            return self.basis.float()
        if self.seed is None:
            raise PayloadError("MomentView needs either a basis or a seed")
        m, n = self.shape
        return seeded_basis(self.seed, m, n, self.rank, self.side, self.frame)

    def materialize(self) -> torch.Tensor:
        p = self.basis_matrix()
        v = self.moment.float()
        return v @ p if self.side == "right" else p @ v


@dataclass(frozen=True)
class Factored:
    left: torch.Tensor  # (m, a)
    core: torch.Tensor  # (a, b)
    right: torch.Tensor  # (n, b)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[0], self.right.shape[0])

    def materialize(self) -> torch.Tensor:
        return self.left.float() @ self.core.float() @ self.right.float().T


Entry = Union[Dense, LowRank, SeededLowRank, GaLoreUpdate, MomentView, Factored]
_KINDS = {
    Dense: "dense",
    LowRank: "lowrank",
    SeededLowRank: "seeded",
    GaLoreUpdate: "galore_update",
    MomentView: "moment_view",
    Factored: "factored",
}


@dataclass
class Payload:
    """Named entries plus JSON-serialisable metadata (client id, example count, round, ...)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Entry:
        return self.entries[key]

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def nbytes(self) -> int:
        return encoded_size(self)


# ----------------------------------------------------------------------------- wire format
def _identity(t: torch.Tensor) -> tuple:
    """Identity of a tensor's contents while it is alive (same storage, offset and layout)."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def _flatten(name: str, entry: Entry, tensors: dict[str, torch.Tensor], seen: dict[tuple, str] | None = None,
             materialize: bool = True) -> dict[str, Any]:
    """Header spec of ``entry``; its tensors go into ``tensors``. ``seen`` maps tensor identities
    already stored (by any entry) to their key, so a shared tensor is written once.
    ``materialize=False`` stores the tensors as they are (no contiguous CPU copy): for sizing."""
    kind = _KINDS.get(type(entry))
    if kind is None:
        raise PayloadError(f"unsupported payload entry type {type(entry).__name__} for {name!r}")

    def put(suffix: str, t: torch.Tensor) -> str:
        if seen is not None and t.numel() > 0:
            ident = _identity(t)
            if ident in seen:
                return seen[ident]
        key = f"{name}/{suffix}"
        tensors[key] = t.detach().contiguous().cpu() if materialize else t
        if seen is not None and t.numel() > 0:
            seen[_identity(t)] = key
        return key

    if isinstance(entry, Dense):
        return {"kind": kind, "tensor": put("t", entry.tensor)}
    if isinstance(entry, LowRank):
        return {"kind": kind, "left": put("l", entry.left), "right": put("r", entry.right)}
    if isinstance(entry, SeededLowRank):
        return {
            "kind": kind,
            "coef": put("c", entry.coef),
            "seed": int(entry.seed),
            "side": entry.side,
            "shape": list(entry.shape),
            **({} if entry.frame is None else {"frame": int(entry.frame)}),
        }
    if isinstance(entry, GaLoreUpdate):
        terms = [_flatten(f"{name}/term{q}", t, tensors, seen, materialize) for q, t in enumerate(entry.terms)]
        return {"kind": kind, "decay": float(entry.decay), "terms": terms, "shape": list(entry.shape)}
    if isinstance(entry, MomentView):
        spec = {"kind": kind, "moment": put("v", entry.moment), "side": entry.side, "shape": list(entry.shape)}
        if entry.basis is not None:
            spec["basis"] = put("p", entry.basis)
        if entry.seed is not None:
            spec["seed"] = int(entry.seed)
        if entry.weight is not None:
            spec["weight"] = put("w", entry.weight)
        if entry.frame is not None:
            spec["frame"] = int(entry.frame)
        return spec
    assert isinstance(entry, Factored)
    return {"kind": kind, "left": put("l", entry.left), "core": put("c", entry.core), "right": put("r", entry.right)}


def _unflatten(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Entry:
    def get(key: str) -> torch.Tensor:
        try:
            return tensors[spec[key]]
        except KeyError as exc:
            raise PayloadError(f"payload entry refers to missing tensor {exc}") from None

    kind = spec.get("kind")
    if kind == "dense":
        return Dense(get("tensor"))
    if kind == "lowrank":
        return LowRank(get("left"), get("right"))
    if kind == "seeded":
        return SeededLowRank(get("coef"), int(spec["seed"]), str(spec["side"]), tuple(spec["shape"]),
                             int(spec["frame"]) if "frame" in spec else None)
    if kind == "galore_update":
        terms = tuple(_unflatten(t, tensors) for t in spec["terms"])
        return GaLoreUpdate(float(spec["decay"]), terms, tuple(spec["shape"]))  # type: ignore[arg-type]
    if kind == "moment_view":
        return MomentView(
            get("moment"),
            str(spec["side"]),
            tuple(spec["shape"]),
            tensors[spec["basis"]] if "basis" in spec else None,
            int(spec["seed"]) if "seed" in spec else None,
            tensors[spec["weight"]] if "weight" in spec else None,
            int(spec["frame"]) if "frame" in spec else None,
        )
    if kind == "factored":
        return Factored(get("left"), get("core"), get("right"))
    raise PayloadError(f"unknown payload entry kind {kind!r}")


def flatten_entries(entries: dict[str, Entry], materialize: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(specs, tensors)`` for named entries: JSON specs and the tensors they refer to (a tensor
    shared by several entries is stored once). Inverse: :func:`unflatten_entries`.
    ``materialize=False``: the tensors as the entries hold them (no contiguous CPU copies)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    specs = {name: _flatten(name, e, tensors, seen, materialize) for name, e in entries.items()}
    if materialize:  # the writer refuses tensors that share memory (views of one another): copy those
        storages: set[int] = set()
        for key, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and (ptr in storages or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
                tensors[key] = t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
    return specs, tensors


def unflatten_entries(specs: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Entry]:
    """Entries from :func:`flatten_entries` output (raises :class:`PayloadError` when malformed)."""
    try:
        return {str(name): _unflatten(s, tensors) for name, s in specs.items()}
    except PayloadError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PayloadError(f"malformed payload header: {type(exc).__name__}: {exc}") from None


#: Characters a float takes in a payload header (:func:`dump_header_json`): the widest
#: ``format(x, ".16e")``, ``-1.2345678901234567e-308``.
FLOAT_WIDTH = 24


def _fixed_float(x: float) -> str:
    if x != x:
        text = "NaN"
    elif x in (math.inf, -math.inf):
        text = "Infinity" if x > 0 else "-Infinity"
    else:
        text = format(x, ".16e")
    return text.rjust(FLOAT_WIDTH)


def dump_header_json(obj: Any) -> str:
    """``json.dumps(obj, sort_keys=True)`` except that every float is written in a fixed width:
    ``format(x, ".16e")`` (17 significant digits, so it reads back as the same double) padded
    on the left with spaces to :data:`FLOAT_WIDTH` characters (JSON allows whitespace before a
    value; ``NaN``/``Infinity`` as :mod:`json` writes them, padded the same way).

    Why (byte counts equal on every machine): the header carries floats computed by the client (its losses, diagnostics),
    whose shortest ``repr`` takes 3 to 24 characters. Their last digits depend on the CPU's
    vector width and BLAS kernels, so with ``repr`` a message's byte count — and the ledger's
    totals — differed by a few bytes between machines. Fixed width makes the byte count depend
    only on the message's structure (entries, shapes, which keys the metadata has). The price:
    a float takes 24 bytes instead of ~18, and the header is written in Python (~3 ms for the
    ~400 entries of a 210-matrix upload, against ~1 ms for ``json.dumps``)."""
    out: list[str] = []
    _dump(obj, out)
    return "".join(out)


def _dump(obj: Any, out: list[str]) -> None:
    if isinstance(obj, str):
        out.append(_json_str(obj))
    elif obj is None or isinstance(obj, bool):
        out.append("null" if obj is None else "true" if obj else "false")
    elif isinstance(obj, int):
        out.append(int.__repr__(obj))
    elif isinstance(obj, float):
        out.append(_fixed_float(obj))
    elif isinstance(obj, dict):
        out.append("{")
        for i, (k, v) in enumerate(sorted(obj.items())):  # json.dumps' order (TypeError on mixed key types, as it)
            if not isinstance(k, str):
                if not isinstance(k, (int, float)) and k is not None:
                    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
                k = json.dumps(k)  # json's key conversion: 1 -> "1", True -> "true", None -> "null"
            out.append(f"{', ' if i else ''}{_json_str(k)}: ")
            _dump(v, out)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(", ")
            _dump(v, out)
        out.append("]")
    else:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _header_json(specs: dict[str, Any], meta: dict[str, Any]) -> str:
    return dump_header_json({"entries": specs, "meta": meta})


def encode(payload: Payload) -> bytes:
    """Serialise to one safetensors blob; entry specs and ``meta`` go in the header as JSON."""
    specs, tensors = flatten_entries(payload.entries)
    return st_save(tensors, metadata={"fedgalore": _header_json(specs, payload.meta)})


def transfer(payload: Payload) -> Payload:
    """What the receiver of ``encode(payload)`` decodes, without the bytes: the same entries and
    metadata (through JSON, as on the wire) on contiguous CPU copies of the tensors — the
    receiver can change its copy without touching the sender's (``decode(encode(p))``,
    one memory copy instead of a serialisation and a parse). For messages handed over inside
    one process (the sequential backend); the ledger counts them with :func:`encoded_size`."""
    specs, tensors = flatten_entries(payload.entries, materialize=False)
    header = json.loads(_header_json(specs, payload.meta))
    copies = {k: t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True) for k, t in tensors.items()}
    meta = header.get("meta", {})
    return Payload(unflatten_entries(header["entries"], copies), meta)


#: safetensors' dtype names in the order its writer sorts tensors (descending: larger alignment
#: first, then by name) — the order decides the data offsets written in the header
_ST_DTYPES = [
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"), (torch.int16, "I16"), (torch.uint16, "U16"), (torch.float16, "F16"),
    (torch.bfloat16, "BF16"), (torch.int32, "I32"), (torch.uint32, "U32"), (torch.float32, "F32"),
    (torch.float64, "F64"), (torch.int64, "I64"), (torch.uint64, "U64"),
]
_ST_NAME = {dt: (rank, name) for rank, (dt, name) in enumerate(_ST_DTYPES)}


def dump_safetensors_header(header: dict[str, Any]) -> bytes:
    """A safetensors JSON header as the writer emits it: compact serde_json (``"``, ``\\`` and
    control characters escaped, other text as UTF-8), padded with spaces to a multiple of 8."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return raw + b" " * ((8 - len(raw) % 8) % 8)


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]] | None:
    """The first bytes of ``safetensors.torch.save(tensors, metadata)`` — the 8-byte length and
    the JSON header padded with spaces to a multiple of 8 — and the tensor names in the order
    their data follow it; ``None`` for a dtype :data:`_ST_DTYPES` does not know. The writer
    sorts the tensors by dtype (descending) then name and lists them in that order after
    ``__metadata__``; its JSON is compact serde_json (``"``, ``\\`` and control characters
    escaped, other text as UTF-8). Checked byte for byte against the real writer in
    tests/protocol/test_payload_size.py."""
    order = []
    for name, t in tensors.items():
        if t.dtype not in _ST_NAME:
            return None
        rank, dname = _ST_NAME[t.dtype]
        order.append((-rank, name, dname, list(t.shape), t.numel() * t.element_size()))
    order.sort()
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for _, name, dname, shape, nbytes in order:
        header[name] = {"dtype": dname, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = dump_safetensors_header(header)
    return struct.pack("<Q", len(raw)) + raw, [o[1] for o in order]


def safetensors_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int | None:
    """The exact length of ``safetensors.torch.save(tensors, metadata)`` without writing it.

    The file is ``8`` (header length) ``+`` the JSON header padded with spaces to a multiple of 8
    ``+`` the tensor bytes; the header lists ``__metadata__`` and, per tensor in the writer's
    order (dtype descending, then name), ``{"dtype", "shape", "data_offsets"}`` as compact JSON
    (serde_json: only ``"``, ``\\`` and control characters escaped, other text as UTF-8).
    ``None`` for a dtype this table does not know (the caller then encodes).
    Checked against the real writer in tests/protocol/test_payload_size.py."""
    head = safetensors_header(tensors, metadata)
    if head is None:
        return None
    return len(head[0]) + sum(t.numel() * t.element_size() for t in tensors.values())


def write_safetensors(fh, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, chunk: int = 1 << 26) -> int:
    """Stream ``safetensors.torch.save(tensors, metadata)`` into the binary file ``fh``, byte for
    byte, without building the blob: the header, then each tensor's memory (an accelerator
    tensor is copied to the host one at a time, in chunks of ``chunk`` bytes). Returns the bytes
    written. Peak extra memory: one chunk, instead of the whole state twice (``save`` builds a
    bytes copy of every tensor, then the blob)."""
    head = safetensors_header(tensors, metadata)
    if head is None:  # a dtype the header table does not know: the library writes it
        blob = st_save(tensors, metadata=metadata)
        fh.write(blob)
        return len(blob)
    header, order = head
    fh.write(header)
    n = len(header)
    for name in order:
        flat = tensors[name].detach().reshape(-1)
        if flat.numel() == 0:
            continue
        per = max(chunk // flat.element_size(), 1)
        for i in range(0, flat.numel(), per):
            part = flat[i : i + per].cpu().contiguous().view(torch.uint8)
            fh.write(memoryview(part.numpy()))
            n += part.numel()
    return n


def encoded_size(payload: Payload) -> int:
    """``len(encode(payload))``, computed from shapes and dtypes without serialising a tensor.

    What the ledger counts for a message handed over in process (the sequential backend): the
    bytes the wire format would carry, exactly (tests/protocol/test_payload_size.py checks the equality)."""
    size = _measure(payload)[0]
    return len(encode(payload)) if size is None else size


def _read_header(blob: bytes) -> dict[str, Any]:
    if len(blob) < 8:
        raise PayloadError("payload too short")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise PayloadError("payload header length exceeds payload size")
    try:
        header = json.loads(blob[8 : 8 + n])
        return json.loads(header["__metadata__"]["fedgalore"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PayloadError(f"payload header is not a fedgalore header: {exc}") from None


def decode(blob: bytes) -> Payload:
    """Inverse of :func:`encode`. Raises :class:`PayloadError` on anything malformed."""
    spec = _read_header(blob)
    if not isinstance(spec, dict):
        raise PayloadError("payload header is not a mapping")
    try:
        tensors = st_load(blob)
    except Exception as exc:  # safetensors raises its own error types
        raise PayloadError(f"payload tensors could not be read: {exc}") from None
    specs = spec.get("entries", {})
    meta = spec.get("meta", {})
    if not isinstance(specs, dict) or not isinstance(meta, dict):
        raise PayloadError("malformed payload header: entries and meta must be mappings")
    return Payload(unflatten_entries(specs, tensors), meta)


def _measure(payload: Payload) -> tuple[int | None, dict[str, int]]:
    """One pass over the entries: ``(len(encode(payload))`` or None when a dtype is unknown,
    raw tensor bytes per entry kind)``."""
    by_kind: dict[str, int] = {}
    specs: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for name, entry in payload.entries.items():
        own: dict[str, torch.Tensor] = {}  # the tensors this entry stores first (shared ones: once)
        specs[name] = _flatten(name, entry, own, seen, materialize=False)
        kind = _KINDS[type(entry)]
        by_kind[kind] = by_kind.get(kind, 0) + sum(t.numel() * t.element_size() for t in own.values())
        tensors.update(own)
    return safetensors_size(tensors, {"fedgalore": _header_json(specs, payload.meta)}), by_kind


def tensor_bytes_by_kind(payload: Payload) -> dict[str, int]:
    """Raw tensor bytes per entry kind (the header is the remainder of the blob size); a tensor
    shared by several entries counts once, for the first entry that stores it."""
    return _measure(payload)[1]


# ----------------------------------------------------------------------------- ledger
@dataclass
class Ledger:
    """Communication ledger: one record per message, bytes from the serialised form."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, round_idx: int, client: int, direction: str, payload: Payload, blob: bytes | int | None = None) -> int:
        """Count one message: ``blob`` is its serialised form or its length; ``None``: the
        length :func:`encoded_size` computes (exactly what :func:`encode` would write)."""
        if direction not in ("up", "down"):
            raise ValueError("direction must be 'up' or 'down'")
        exact, by_kind = _measure(payload)
        if blob is not None:
            size = blob if isinstance(blob, int) else len(blob)
        else:
            size = exact if exact is not None else len(encode(payload))
        rec = {
            "round": int(round_idx),
            "client": int(client),
            "direction": direction,
            "bytes": size,
            "tensor_bytes": by_kind,
            "header_bytes": size - sum(by_kind.values()),
        }
        self.records.append(rec)
        return size

    def total(self, direction: str, round_idx: int | None = None) -> int:
        return sum(
            r["bytes"]
            for r in self.records
            if r["direction"] == direction and (round_idx is None or r["round"] == round_idx)
        )
