"""Carrying fedgalore payloads in Flower records, bf16 included.

Our payloads are already one safetensors blob (``fedgalore.protocol.payload.encode``), so the
default codec puts that blob, untouched, into a single Flower :class:`~flwr.app.Array` with an
explicit ``stype`` — no numpy round trip, so dtypes numpy lacks (bfloat16, float8) survive
bit-exactly and the bytes Flower ships are exactly the bytes the ledger counts.

For users who want one Flower Array per tensor (e.g. to inspect records with Flower tools),
:func:`tensors_to_record` / :func:`record_to_tensors` store each tensor as its raw little-endian
bytes with the torch dtype name; bf16 is carried as its 2-byte pattern, never upcast.
"""
from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

__all__ = [
    "STYPE", "blob_to_record", "record_to_blob", "tensors_to_record", "record_to_tensors",
]

STYPE = "fedgalore.safetensors"  # one Array = one serialised fedgalore Payload
_RAW = "fedgalore.raw"  # one Array = one tensor's raw bytes; dtype = torch dtype name
_KEY = "payload"


def blob_to_record(blob: bytes) -> ArrayRecord:
    """A serialised Payload as an ArrayRecord holding one opaque byte Array."""
    rec = ArrayRecord()
    rec[_KEY] = Array(dtype="uint8", shape=(len(blob),), stype=STYPE, data=bytes(blob))
    return rec


def record_to_blob(record: ArrayRecord) -> bytes:
    arr = record[_KEY]
    if arr.stype != STYPE:
        raise ValueError(f"expected a {STYPE} Array, got stype {arr.stype!r}")
    return bytes(arr.data)


def tensors_to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """One Array per tensor, raw bytes + torch dtype name (bf16/fp8 safe)."""
    rec = ArrayRecord()
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8) if t.element_size() > 0 and t.numel() else t.to(torch.uint8)
        rec[name] = Array(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(int(s) for s in t.shape),
                          stype=_RAW, data=raw.numpy().tobytes())
    return rec


def record_to_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    out = {}
    for name, arr in record.items():
        if arr.stype != _RAW:
            raise ValueError(f"{name}: expected a {_RAW} Array, got stype {arr.stype!r}")
        dtype = getattr(torch, arr.dtype)
        buf = torch.from_numpy(np.frombuffer(bytearray(arr.data), dtype=np.uint8))
        out[name] = buf.view(dtype).reshape(arr.shape) if buf.numel() else torch.empty(arr.shape, dtype=dtype)
    return out
