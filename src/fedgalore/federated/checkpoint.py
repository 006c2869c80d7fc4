"""Crash-safe checkpoints of the server state: safetensors + JSON, written atomically.

Layout: ``<run>/checkpoints/round_0007/{state.safetensors, state.json}`` (params ``p/``, extras
``x/``, synchronised moments ``m/`` with their entry specs in ``state.json``), plus
``<run>/checkpoints/LATEST`` naming the newest complete checkpoint. A checkpoint directory is
written under a temporary name, fsynced and renamed (rename is atomic on POSIX), and only then
``LATEST`` is replaced (temp file + ``os.replace``). ``state.json`` holds the SHA-256 of the
tensor file, so a truncated or corrupted checkpoint is detected on load and the previous one is
used. Nothing is pickled: tensors load with ``safetensors`` only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedgalore.protocol.payload import flatten_entries, unflatten_entries
from fedgalore.protocol.state import ServerState

__all__ = ["save_checkpoint", "load_latest_checkpoint", "CheckpointError", "atomic_write_text"]


class CheckpointError(RuntimeError):
    """No valid checkpoint could be loaded."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_checkpoint(run_dir: Path, round_done: int, state: ServerState, meta: dict[str, Any], keep: int = 2) -> Path:
    """Write the state after ``round_done`` completed rounds; keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round_{round_done:04d}"
    tmp = root / f".tmp_round_{round_done:04d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {f"p/{k}": v.detach().contiguous().cpu() for k, v in state.params.items()}
    tensors.update({f"x/{k}": v.detach().contiguous().cpu() for k, v in state.extras.items()})
    moment_specs, moment_tensors = flatten_entries(state.moments)
    tensors.update({f"m/{k}": v for k, v in moment_tensors.items()})
    blob = st_save(tensors)
    with open(tmp / "state.safetensors", "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    info = {"round": round_done, "sha256": hashlib.sha256(blob).hexdigest(), "server_meta": state.meta,
            "moments": moment_specs, **meta}
    with open(tmp / "state.json", "w") as fh:
        json.dump(info, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / "LATEST", final.name + "\n")
    ckpts = sorted(p for p in root.glob("round_*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _load_one(path: Path) -> tuple[ServerState, dict[str, Any]]:
    info = json.loads((path / "state.json").read_text())
    blob = (path / "state.safetensors").read_bytes()
    if hashlib.sha256(blob).hexdigest() != info.get("sha256"):
        raise CheckpointError(f"checksum mismatch in {path}")
    tensors = st_load(blob)
    state = ServerState(
        params={k[2:]: v for k, v in tensors.items() if k.startswith("p/")},
        extras={k[2:]: v for k, v in tensors.items() if k.startswith("x/")},
        meta=info.get("server_meta", {}),
        moments=unflatten_entries(info.get("moments", {}), {k[2:]: v for k, v in tensors.items() if k.startswith("m/")}),
    )
    return state, info


def load_latest_checkpoint(run_dir: Path, log=None) -> tuple[ServerState, dict[str, Any]] | None:
    """The newest checkpoint that verifies; corrupted ones are skipped (with a log line).

    Returns None when the run has no checkpoint yet (resume starts from round 0).
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.glob("round_*") if p.is_dir()), reverse=True)
    errors = []
    for path in candidates:
        try:
            return _load_one(path)
        except (OSError, ValueError, KeyError, CheckpointError, Exception) as exc:  # noqa: B014
            errors.append(f"{path.name}: {exc}")
            if log is not None:
                log(f"checkpoint {path.name} is unreadable ({exc}); trying an older one")
    if candidates:
        raise CheckpointError("no valid checkpoint: " + "; ".join(errors))
    return None
