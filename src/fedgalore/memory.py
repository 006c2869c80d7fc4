"""Peak resident memory per phase of a run, and exact tensor accounting (benchmarks/RESULTS.md §9.3).

:class:`PeakTracker` measures, for every call of a wrapped function, the process's resident set
before and after and its **peak during the call**: Linux keeps the high-water mark ``VmHWM`` in
``/proc/self/status`` and resets it to the current RSS when ``5`` is written to
``/proc/self/clear_refs``. Nested phases are handled with a stack (an inner reset folds the peak
seen so far into every open phase first). On a CPU run this is the accelerator's memory too.

RSS is live memory only when the allocator returns freed buffers to the system: run measured
processes with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc: every buffer ≥ 64 KiB is its own
mapping, unmapped on free; otherwise freed heap memory stays resident and later phases look
smaller than they are). ``benchmarks/memory_scaling.py`` does.

:func:`tensor_bytes` counts the bytes of every tensor inside nested containers and dataclasses,
each storage once (the exact size of a component: a server state, an optimizer state).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["PeakTracker", "rss_bytes", "tensor_bytes", "peak_tracking_available"]

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), flags=re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return int(m.group(1))


def rss_bytes() -> int:
    """Current resident set size of this process (bytes)."""
    return _status_kib("VmRSS") * 1024


def _hwm_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def _reset_hwm() -> None:
    _CLEAR.write_text("5")


def peak_tracking_available() -> bool:
    """Whether the peak-RSS reset works here (Linux with a writable ``/proc/self/clear_refs``)."""
    try:
        _hwm_bytes()
        _reset_hwm()
        return True
    except (OSError, RuntimeError):
        return False


def tensor_bytes(obj: Any, _seen: set | None = None) -> int:
    """Bytes of every tensor in ``obj`` (dicts, lists, tuples, dataclasses), each storage once."""
    seen = set() if _seen is None else _seen
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.device.type) if obj.numel() else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() if obj.numel() else 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


class PeakTracker:
    """Per-call peak RSS of wrapped functions; ``records`` holds one dict per call:
    ``name``, ``rss_before``, ``rss_after``, ``peak`` (absolute bytes) and ``depth``."""

    def __init__(self) -> None:
        if not peak_tracking_available():
            raise RuntimeError("peak tracking needs Linux /proc/self/clear_refs (VmHWM reset)")
        self.records: list[dict[str, Any]] = []
        self._stack: list[dict[str, Any]] = []

    def _fold(self) -> int:
        h = _hwm_bytes()
        for frame in self._stack:
            frame["peak"] = max(frame["peak"], h)
        return h

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._fold()
        _reset_hwm()
        rss = rss_bytes()
        frame = {"name": name, "rss_before": rss, "peak": rss, "depth": len(self._stack)}
        self._stack.append(frame)
        try:
            yield
        finally:
            self._fold()
            self._stack.pop()
            frame["rss_after"] = rss_bytes()
            for outer in self._stack:
                outer["peak"] = max(outer["peak"], frame["peak"])
            _reset_hwm()
            self.records.append(frame)

    def wrap(self, owner: Any, attr: str, name: str | None = None) -> None:
        """Replace ``owner.attr`` (a function or bound method) by a tracked version."""
        fn: Callable = getattr(owner, attr)
        label = name or attr

        @functools.wraps(fn)
        def tracked(*args, **kwargs):
            with self.phase(label):
                return fn(*args, **kwargs)

        setattr(owner, attr, tracked)

    def peaks(self, baseline: int = 0) -> dict[str, int]:
        """Largest peak per phase name, minus ``baseline``."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r["name"]] = max(out.get(r["name"], 0), r["peak"] - baseline)
        return out
