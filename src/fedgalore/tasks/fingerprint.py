"""Fingerprints of what a run reads: files, folders and in-memory examples (a run's identity,
:mod:`fedgalore.records.identity`).

Cheap by design — a model folder of several GB is fingerprinted by reading a few MB:

* a file of at most :data:`FULL_HASH_MAX` bytes (configs, tokenizers, data files, small
  checkpoints) is hashed whole (SHA-256 of its bytes);
* a larger file is *sampled*: SHA-256 of its size, its first :data:`HEAD_BYTES` (which hold a
  safetensors or GGUF header: tensor names, dtypes, shapes, offsets) and :data:`SAMPLE_BLOCKS`
  blocks of :data:`SAMPLE_BYTES` spread evenly over the file. A fine-tuned or re-initialised
  checkpoint differs in every block; an edit confined to bytes no block covers is not seen;
* a folder is the sorted list of its files (relative name, size, and the hash above) — hidden
  entries (``.git``, ``.cache``) and ``__pycache__`` are skipped. At most :data:`FOLDER_READ_BUDGET`
  bytes are read per folder: files beyond that budget (in name order) count by name and size only,
  and at most :data:`FOLDER_MAX_FILES` files are listed (the fingerprint says how many were left).

Modification times never count: a copied folder has the fingerprint of its source. Hashes of a
file are remembered per process while its size and modification time stay the same.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

__all__ = ["fingerprint_path", "fingerprint_files", "data_fingerprint", "FULL_HASH_MAX"]

FULL_HASH_MAX = 32 << 20  # files up to 32 MiB are hashed whole
HEAD_BYTES = 1 << 20  # a sampled file: its first MiB (the weights header) ...
SAMPLE_BYTES = 1 << 16  # ... and blocks of 64 KiB
SAMPLE_BLOCKS = 16  # ... spread over the file
FOLDER_READ_BUDGET = 256 << 20  # bytes read per folder; beyond it, files count by name and size
FOLDER_MAX_FILES = 100_000  # files listed per folder
LISTING_MAX = 256  # a folder's per-file hashes are kept (to name what changed) up to this many files

_memo: dict[tuple[str, int, int, int], dict[str, Any]] = {}


def _file_hash(path: Path, st: os.stat_result) -> dict[str, Any]:
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _memo:
        return _memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if st.st_size <= FULL_HASH_MAX:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
            how = "full"
        else:
            h.update(str(st.st_size).encode())
            h.update(fh.read(HEAD_BYTES))
            step = (st.st_size - SAMPLE_BYTES) / (SAMPLE_BLOCKS - 1)
            for i in range(SAMPLE_BLOCKS):
                fh.seek(int(i * step))
                h.update(fh.read(SAMPLE_BYTES))
            how = "sampled"
    out = {"size": st.st_size, "sha256": h.hexdigest()[:32], "hash": how}
    _memo[key] = out
    return out


def _walk(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def fingerprint_path(path: str | os.PathLike) -> dict[str, Any] | None:
    """The fingerprint of a file or folder (module doc), ``None`` when ``path`` does not exist.

    A file: ``{"kind": "file", "size", "sha256", "hash": "full" | "sampled"}``. A folder:
    ``{"kind": "folder", "files", "bytes", "sha256"}`` — the digest of its listing — plus
    ``"listing"`` (relative name → short hash) for folders of at most :data:`LISTING_MAX` files,
    ``"unhashed"`` (files counted by name and size only) and ``"unlisted"`` when a limit was hit.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return {"kind": "file", **_file_hash(p, p.stat())}
    if not p.is_dir():
        return None
    entries: list[tuple[str, dict[str, Any]]] = []
    read = unhashed = unlisted = 0
    for f in _walk(p):
        if len(entries) >= FOLDER_MAX_FILES:
            unlisted += 1
            continue
        try:
            st = f.stat()
        except OSError:  # a dangling link
            continue
        cost = st.st_size if st.st_size <= FULL_HASH_MAX else HEAD_BYTES + SAMPLE_BLOCKS * SAMPLE_BYTES
        if read + cost <= FOLDER_READ_BUDGET:
            read += cost
            fp = _file_hash(f, st)
        else:
            unhashed += 1
            fp = {"size": st.st_size}
        entries.append((f.relative_to(p).as_posix(), fp))
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:32]
    out: dict[str, Any] = {"kind": "folder", "files": len(entries), "bytes": sum(e["size"] for _, e in entries),
                           "sha256": digest}
    if len(entries) <= LISTING_MAX:
        out["listing"] = {name: e.get("sha256", f"size {e['size']}") for name, e in entries}
    if unhashed:
        out["unhashed"] = unhashed
    if unlisted:
        out["unlisted"] = unlisted
    return out


def fingerprint_files(paths: Sequence[Path]) -> str:
    """One short digest of the contents of ``paths`` (each fingerprinted as in :func:`fingerprint_path`,
    with its parent folder's and its own name): a cache key that changes when a file's bytes do."""
    h = hashlib.sha256()
    for p in paths:
        h.update(f"{p.parent.name}/{p.name}:{json.dumps(fingerprint_path(p), sort_keys=True)};".encode())
    return h.hexdigest()[:16]


def data_fingerprint(obj: Any) -> str:
    """SHA-256 (32 hex digits) of in-memory examples: tensors and arrays by dtype, shape and bytes;
    strings, numbers and paths by value; mappings, sequences and dataclasses (a task's datasets)
    element by element; any other object (a tokenizer held by a dataset) by its type name only."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()[:32]


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            _feed(h, obj.tolist())
        else:
            h.update(f"array{obj.dtype}{obj.shape}".encode())
            h.update(np.ascontiguousarray(obj).tobytes())
    elif obj is None or isinstance(obj, (str, bool, int, float, np.generic)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, os.PathLike):
        h.update(f"path:{os.fspath(obj)};".encode())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            _feed(h, str(k))
            _feed(h, obj[k])
        h.update(b"}")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(type(obj).__name__.encode())
        _feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())
