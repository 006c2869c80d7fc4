"""Crash-safe checkpoints of the server state: safetensors + JSON, written atomically.

Layout: ``<run>/checkpoints/round_0007/{state.safetensors, state.json}`` (params ``p/``, extras
``x/``, synchronised moments ``m/`` with their entry specs in ``state.json``), plus
``<run>/checkpoints/LATEST`` naming the newest complete checkpoint. A checkpoint directory is
written under a temporary name, fsynced and renamed (rename is atomic on POSIX), and only then
``LATEST`` is replaced (temp file + ``os.replace``). ``state.json`` holds the SHA-256 of the
tensor file, so a truncated or corrupted checkpoint is detected on load and the previous one is
used. Nothing is pickled: tensors load with ``safetensors`` only. The tensors are streamed to
disk (no in-memory blob) and the durable part can run beside the next round
(:class:`CheckpointWriter`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from fedgalore.protocol.payload import flatten_entries, unflatten_entries, write_safetensors
from fedgalore.protocol.state import ServerState

__all__ = ["save_checkpoint", "CheckpointWriter", "load_latest_checkpoint", "load_checkpoint", "kept_rounds",
           "CheckpointError", "atomic_write_text"]


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


class CheckpointWriter:
    """Writes the server state after a round, streaming and half in the background.

    In the caller's thread the tensors are streamed into ``.tmp_round_NNNN/state.safetensors``
    (:func:`fedgalore.protocol.payload.write_safetensors`: the bytes ``safetensors`` would write,
    without building them in memory first) and the metadata is snapshotted; after that the
    caller may change the state. The durable part — fsync, the SHA-256 of the file (read back),
    ``state.json``, the atomic rename, ``LATEST``, pruning to the newest ``keep`` — runs in a
    background thread beside the next round (``background=True``) or inline. A checkpoint is
    only ever visible complete: a crash before the rename leaves the previous one as the
    newest. :meth:`wait` finishes the pending one (and raises what went wrong there); the next
    :meth:`save` waits for it first. With ``save(..., defer_tensors=True)`` the streaming moves to
    the background thread too (the round loop's choice: its thread then spends milliseconds per
    checkpoint, and waits, if at all, before the next aggregation changes the state)."""

    #: seconds :meth:`wait` gives a thread whose ``start()`` was interrupted to report it started
    START_GRACE_S = 5.0

    def __init__(self, run_dir: Path, keep: int = 2, background: bool = True) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = int(keep)
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, round_done: int, state: ServerState, meta: dict[str, Any], defer_tensors: bool = False) -> Path:
        """Start the checkpoint after ``round_done`` completed rounds; returns its final path.

        ``defer_tensors=True`` (with ``background``): the tensors are streamed in the background
        thread as well, from the state's own tensors (no copy), so the caller's thread only
        snapshots the metadata. The caller then must not change any state tensor in place before
        :meth:`wait` (the round loop waits before its aggregation, the first in-place change;
        rebinding entries is fine)."""
        self.wait()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"round_{round_done:04d}"
        tmp = self.root / f".tmp_round_{round_done:04d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        tensors = {f"p/{k}": v.detach() for k, v in state.params.items()}
        tensors.update({f"x/{k}": v.detach() for k, v in state.extras.items()})
        moment_specs, moment_tensors = flatten_entries(state.moments, materialize=False)
        tensors.update({f"m/{k}": v for k, v in moment_tensors.items()})
        deferred = defer_tensors and self.background
        if not deferred:
            self._write(tmp, tensors)
        # a snapshot of the metadata (the state moves on while the rest is written)
        info = json.loads(json.dumps({"round": round_done, "server_meta": state.meta, "moments": moment_specs, **meta}))
        if self.background:
            args = (tmp, final, info, tensors if deferred else None)
            self._thread = threading.Thread(target=self._finish_safely, args=args, name="fedgalore-checkpoint")
            self._thread.start()
        else:
            self._finish(tmp, final, info)
        return final

    @staticmethod
    def _write(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
        with open(tmp / "state.safetensors", "wb") as fh:
            write_safetensors(fh, tensors)

    def wait(self) -> None:
        """Block until the pending checkpoint is durable; raise its error, if any.

        A ``KeyboardInterrupt`` can arrive inside ``Thread.start()`` itself, before the new thread
        says it started; ``join`` then refuses. The thread is given a few seconds to start (it
        then finishes the checkpoint); one that never started wrote nothing, and the previous
        checkpoint stays the newest."""
        if self._thread is not None:
            deadline = time.monotonic() + self.START_GRACE_S
            while True:
                try:
                    self._thread.join()
                    break
                except RuntimeError:  # "cannot join thread before it is started"
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in {self.root} failed: {err}") from err

    def _finish_safely(self, tmp: Path, final: Path, info: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        try:
            if tensors is not None:
                self._write(tmp, tensors)
            self._finish(tmp, final, info)
        except BaseException as exc:  # reported by wait()
            self._error = exc

    def _finish(self, tmp: Path, final: Path, info: dict[str, Any]) -> None:
        digest = hashlib.sha256()
        with open(tmp / "state.safetensors", "rb+") as fh:
            os.fsync(fh.fileno())
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
        info = {**info, "sha256": digest.hexdigest()}
        with open(tmp / "state.json", "w") as fh:
            json.dump(info, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        atomic_write_text(self.root / "LATEST", final.name + "\n")
        ckpts = sorted(p for p in self.root.glob("round_*") if p.is_dir())
        for old in ckpts[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir: Path, round_done: int, state: ServerState, meta: dict[str, Any], keep: int = 2) -> Path:
    """Write the state after ``round_done`` completed rounds; keep the newest ``keep`` (all of
    it before returning: :class:`CheckpointWriter` inline)."""
    return CheckpointWriter(run_dir, keep, background=False).save(round_done, state, meta)


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


def kept_rounds(run_dir: Path) -> list[int]:
    """The rounds whose checkpoint ``run_dir`` keeps (``checkpoints/round_NNNN``), ascending; the
    newest ``output.keep_checkpoints`` of those the run wrote. Not verified here: loading one
    (:func:`load_checkpoint`) checks its hash."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    rounds = []
    for p in root.glob("round_*"):
        suffix = p.name[len("round_"):]
        if p.is_dir() and suffix.isdigit() and (p / "state.json").is_file():
            rounds.append(int(suffix))
    return sorted(rounds)


def load_checkpoint(run_dir: Path, round_done: int) -> tuple[ServerState, dict[str, Any]]:
    """The server state after ``round_done`` completed rounds and its ``state.json`` metadata;
    :class:`CheckpointError` when that checkpoint is absent or does not verify."""
    path = Path(run_dir) / "checkpoints" / f"round_{int(round_done):04d}"
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{Path(run_dir)} keeps no checkpoint of round {round_done}")
    try:
        return _load_one(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or malformed file of any kind
        raise CheckpointError(f"checkpoint {path} is unreadable ({exc})") from None
