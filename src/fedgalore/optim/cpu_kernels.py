"""AVX2/FMA kernels for the rank-``r`` GEMMs of a GaLore step on one CPU core (benchmarks/RESULTS.md §1.1).

A normal GaLore step (:func:`fedgalore.optim.functional.galore_group_step`) spends nearly all of its
time in two skinny GEMMs over the ``m × n`` matrix: the projection ``R = G Pᵀ`` (right) /
``Pᵀ G`` (left) and the decay + back-projection ``W ← d W + c U P`` / ``d W + c P U``. At
``r = 8`` they are compute-bound on a core like this box's (``2 r = 16`` flops per weight each,
≈ the flops a core can do in the time it streams one fp32 weight), and MKL and oneDNN run them at
13–34 % of the core's FMA peak; the kernels in ``kernels/rank_r_avx2.c`` — register-blocked for
exactly these shapes, no packing — at 36–44 % (``benchmarks/step_roofline.py``,
benchmarks/RESULTS.md §1.1). No library we may depend on ships such kernels, hence C of our own.

How they are used (:func:`available`): on x86-64 Linux/macOS with AVX2 and FMA, a C compiler
(``$CC``, ``cc`` or ``gcc``) builds the shared library once per machine into
``$FEDGALORE_CACHE/kernels`` (default ``~/.cache/fedgalore/kernels``; written under a temporary
name and renamed, so concurrent processes are safe), ``ctypes`` loads it, and a probe checks
every kernel against torch (to fp32 rounding) and that NaN/Inf propagate. Any failure — no
compiler, no AVX2, a failed probe — leaves :func:`available` ``False`` with :func:`reason` saying
why, and the optimizer uses torch. ``FEDGALORE_CPU_KERNELS=0`` turns them off.

The optimizer calls them only where they were measured faster: fp32, contiguous, on CPU, rank a
multiple of 8 and at most :data:`MAX_RANK`, at least ``ONEDNN_MIN_NUMEL`` entries, and with one
intra-op thread (``torch.get_num_threads() == 1``; they are single-threaded, MKL and oneDNN use
every thread torch is given); ``cpu_kernels.ENABLED = False`` turns them off in a process. Results agree with torch's to fp32 rounding, not bit for bit.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch

__all__ = ["available", "reason", "usable", "moments_usable", "disabled", "project", "decay_back_project", "adam_moments",
           "ENABLED", "MAX_RANK", "SOURCE"]

SOURCE = Path(__file__).resolve().parent / "kernels" / "rank_r_avx2.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC"]
#: Set to ``False`` to make the optimizer use torch in this process (as FEDGALORE_CPU_KERNELS=0).
ENABLED = True
#: Largest rank the kernels are used at: at r = 32 MKL/oneDNN reach 45-65 % of peak and win.
MAX_RANK = 16
#: Row-chunk height of the left projection (8-column panels over ``H`` rows; 8 was fastest).
PANEL_ROWS = 8

_state: dict[str, object] = {}
_lock = threading.Lock()


def _cache_root() -> Path:
    # the same folder as fedgalore.tasks.assets.cache_dir (this layer may not import tasks)
    return Path(os.environ.get("FEDGALORE_CACHE") or Path.home() / ".cache" / "fedgalore").expanduser()


def _supported() -> Optional[str]:
    """Why this process cannot use the kernels, or ``None``."""
    if os.environ.get("FEDGALORE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by FEDGALORE_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith(("linux", "darwin")):
        return f"x86-64 Linux/macOS only (this is {platform.machine()} {sys.platform})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return None


def _build() -> Path:
    """The compiled library (built once per source, flags and compiler; cached)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    out_dir = _cache_root() / "kernels"
    lib = out_dir / f"rank_r_avx2-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:300]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, n, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.rank_update.argtypes = [p, p, p, n, n, n, f, f]
    lib.project_rows.argtypes = [p, p, p, n, n, n]
    lib.project_cols.argtypes = [p, p, p, n, n, n, n]
    for fn in (lib.rank_update, lib.project_rows, lib.project_cols):
        fn.restype = None
    lib.adam_moments.argtypes = [p, p, p, p, p, p, n, n, ctypes.c_int, f, f, f, f, f]
    lib.adam_moments.restype = ctypes.c_int
    return lib


def _probe(lib: ctypes.CDLL) -> Optional[str]:
    """Every kernel against torch at shapes with ragged edges, and NaN/Inf propagation."""
    gen = torch.Generator().manual_seed(0)
    for m, n, r in ((37, 45, 8), (50, 29, 16), (13, 70, 8)):
        g = torch.randn(m, n, generator=gen)
        for side in ("right", "left"):
            basis = torch.randn(r, n, generator=gen) if side == "right" else torch.randn(m, r, generator=gen)
            ref = g @ basis.T if side == "right" else basis.T @ g
            got = _project(lib, g, basis, basis.T.contiguous() if side == "right" else None, side)
            if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
                return f"project ({side}, {m}x{n}, r={r}) disagrees with torch"
            u = torch.randn(m, r, generator=gen) if side == "right" else torch.randn(r, n, generator=gen)
            w = torch.randn(m, n, generator=gen)
            ref_w = 0.9 * w + 0.1 * (u @ basis if side == "right" else basis @ u)
            _back(lib, w, u, basis, side, 0.9, 0.1)
            if not torch.allclose(w, ref_w, rtol=1e-4, atol=1e-4):
                return f"decay_back_project ({side}, {m}x{n}, r={r}) disagrees with torch"
            for bad in (float("nan"), float("inf")):
                gb = g.clone()
                gb[-1, -1] = bad
                zero = torch.zeros_like(basis)  # NaN·0 and Inf·0 must still be NaN
                if bool(torch.isfinite(_project(lib, gb, zero, zero.T.contiguous() if side == "right" else None, side)).all()):
                    return f"project ({side}) does not propagate {bad}"
    for rows, cols, per_row in ((37, 8, 0), (8, 45, 1), (5, 3, 0)):
        r_ = torch.randn(rows, cols, generator=gen)
        m0, v0 = torch.randn(rows, cols, generator=gen), torch.rand(rows, cols, generator=gen)
        w0 = torch.rand(rows if per_row else cols, generator=gen) + 0.1
        for b1 in (0.9, 0.3):
            m, v, cv, evidence, u = m0.clone(), v0.clone(), v0.clone(), w0.clone(), torch.empty(rows, cols)
            ok = _moments(lib, r_, m, v, cv, evidence, u, per_row, b1, 0.99, 1e-3)
            wb = (w0 * 0.99 + 0.01)[:, None] if per_row else (w0 * 0.99 + 0.01)[None, :]
            v_ref = v0 * 0.99 + 0.01 * r_ * r_
            m_ref = torch.lerp(m0, r_, 1.0 - b1)
            u_ref = m_ref / ((v_ref / wb).sqrt() + 1e-3)
            if not (ok and torch.allclose(m, m_ref, rtol=2e-6, atol=1e-7) and torch.allclose(v, v_ref, rtol=2e-6, atol=0)
                    and torch.equal(v, cv) and torch.allclose(u, u_ref, rtol=1e-4, atol=1e-6)):
                return f"adam_moments ({rows}x{cols}, b1={b1}) disagrees with torch"
            # the cold cap: S = max(V / c, CV / (1 - b2^s)), here with a cold shadow 3x the warm V
            m, v, evidence, u = m0.clone(), v0.clone(), w0.clone(), torch.empty(rows, cols)
            cv = 3.0 * v0
            ok = _moments(lib, r_, m, v, cv, evidence, u, per_row, b1, 0.99, 1e-3, cap=1.0 / 0.5)
            s_ref = torch.maximum(v_ref / wb, (3.0 * v0 * 0.99 + 0.01 * r_ * r_) / 0.5)
            if not (ok and torch.allclose(u, m_ref / (s_ref.sqrt() + 1e-3), rtol=1e-4, atol=1e-6)):
                return f"adam_moments with the cold cap ({rows}x{cols}, b1={b1}) disagrees with torch"
        for bad in (float("nan"), float("inf")):
            rb = r_.clone()
            rb[-1, -1] = bad
            m = m0.clone()
            if _moments(lib, rb, m, v0.clone(), None, None, torch.empty(rows, cols), 0, 0.9, 0.99, 1e-3) or not torch.equal(m, m0):
                return f"adam_moments accepts {bad}"
    return None


def available() -> bool:
    """Whether the kernels are built, loaded and passed their probe in this process (once)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = None, _supported()
                if why is None:
                    try:
                        lib = _bind(_build())
                        why = _probe(lib)
                    except Exception as exc:  # no compiler, failed build or load: torch is used
                        why = f"{type(exc).__name__}: {exc}"
                    if why is not None:
                        lib = None
                _state["reason"] = why
                _state["lib"] = lib
    return _state["lib"] is not None


def reason() -> Optional[str]:
    """Why the kernels are not used in this process (``None`` when they are)."""
    available()
    return _state["reason"]  # type: ignore[return-value]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block the optimizer takes its torch path (:data:`ENABLED` off, then restored);
    as a decorator, ``disabled()(fn)``, for every call of ``fn``."""
    global ENABLED
    prev, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = prev


def usable(g: torch.Tensor, basis: torch.Tensor) -> bool:
    """Whether :func:`project` / :func:`decay_back_project` run for these operands (module doc:
    fp32 contiguous CPU tensors, rank a multiple of 8 up to :data:`MAX_RANK`, one thread)."""
    r = basis.shape[0] if basis.shape[0] < basis.shape[1] else basis.shape[1]
    return (
        g.device.type == "cpu" and g.dtype == torch.float32 and basis.dtype == torch.float32
        and r % 8 == 0 and 0 < r <= MAX_RANK and g.is_contiguous() and basis.is_contiguous()
        and ENABLED and torch.get_num_threads() == 1 and available()
    )


def _project(lib: ctypes.CDLL, g: torch.Tensor, basis: torch.Tensor, basis_t: Optional[torch.Tensor], side: str) -> torch.Tensor:
    m, n = g.shape
    if side == "right":
        r = basis.shape[0]
        out = torch.empty(m, r, dtype=torch.float32)
        lib.project_rows(out.data_ptr(), g.data_ptr(), basis_t.data_ptr(), m, n, r)  # type: ignore[union-attr]
    else:
        r = basis.shape[1]
        out = torch.empty(r, n, dtype=torch.float32)
        lib.project_cols(out.data_ptr(), basis.data_ptr(), g.data_ptr(), m, n, r, PANEL_ROWS)
    return out


def _back(lib: ctypes.CDLL, w: torch.Tensor, u: torch.Tensor, basis: torch.Tensor, side: str, decay: float, coef: float) -> None:
    a, b = (u, basis) if side == "right" else (basis, u)  # W = d W + c a b
    a, b = a.contiguous(), b.contiguous()
    lib.rank_update(w.data_ptr(), a.data_ptr(), b.data_ptr(), w.shape[0], w.shape[1], a.shape[1], decay, coef)


def _moments(lib: ctypes.CDLL, r: torch.Tensor, m: torch.Tensor, v: torch.Tensor, cv: Optional[torch.Tensor],
             evidence: Optional[torch.Tensor], u: torch.Tensor, per_row: int, b1: float, b2: float, eps: float,
             cap: float = 0.0) -> bool:
    ptr = (lambda t: None if t is None else t.data_ptr())
    # 1 - beta in double, then rounded to fp32: as torch's ``lerp_(r, 1 - b1)`` / ``value=1 - b2``
    # (an fp32 1 - 0.999 is off by 1.3e-5 relative)
    return bool(lib.adam_moments(r.data_ptr(), m.data_ptr(), v.data_ptr(), ptr(cv), ptr(evidence), u.data_ptr(),
                                 r.shape[0], r.shape[1], per_row, 1.0 - b1, b2, 1.0 - b2, eps, cap))


def moments_usable(r: torch.Tensor, *state: Optional[torch.Tensor]) -> bool:
    """Whether :func:`adam_moments` runs for the projected gradient ``r`` and these state tensors
    (``None`` entries skipped): all fp32, contiguous, on CPU, kernels available and enabled."""
    return (
        ENABLED and r.device.type == "cpu" and r.dim() == 2 and r.is_contiguous() and r.dtype == torch.float32
        and all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()) for t in state)
        and available()
    )


def adam_moments(r: torch.Tensor, m: torch.Tensor, v: torch.Tensor, b1: float, b2: float, eps: float,
                 cold_v: Optional[torch.Tensor] = None, v_weight: Optional[torch.Tensor] = None,
                 cold_cap: float = 0.0) -> Optional[torch.Tensor]:
    """Adam's moments on the projected gradient ``R`` in place, all or nothing (paper Alg. 1 line
    8's optimizer state; the rule of :func:`fedgalore.optim.bucket.adam_moments`):
    ``M ← lerp(M, R, 1−β₁)``, ``V ← β₂V + (1−β₂)R∘R`` (and the shadow ``cold_v`` alike),
    ``c ← β₂c + (1−β₂)`` for ``v_weight`` ``c`` (shape ``(1, cols)`` or ``(rows, 1)``), and
    returns ``U = M / (√(V/c) + eps)`` (``M / (√V + eps)`` without ``c``); with ``cold_cap > 0``
    (and ``cold_v``) the denominator is ``√max(V/c, cold_cap · cold_v) + eps`` — the aligned
    protocol's cap at the cold start, ``cold_cap = 1/(1 − β₂^s)``. Returns ``None`` and changes
    nothing when ``R`` has a NaN/Inf entry. Callers check :func:`moments_usable` first."""
    rows, cols = r.shape
    for name, t in (("exp_avg", m), ("exp_avg_sq", v), ("cold_v", cold_v)):
        if t is not None and tuple(t.shape) != (rows, cols):
            raise ValueError(f"adam_moments: {name} {tuple(t.shape)} does not match R {(rows, cols)}")
    per_row = 0
    if v_weight is not None:
        if tuple(v_weight.shape) == (rows, 1):  # left side: one weight per row of R
            per_row = 1
        elif tuple(v_weight.shape) != (1, cols):
            raise ValueError(f"adam_moments: v_weight {tuple(v_weight.shape)} must be (1, {cols}) or ({rows}, 1)")
    u = torch.empty(rows, cols, dtype=torch.float32)
    ok = _moments(_state["lib"], r, m, v, cold_v, v_weight, u, per_row, float(b1), float(b2), float(eps),  # type: ignore[arg-type]
                  float(cold_cap))
    return u if ok else None


def project(g: torch.Tensor, basis: torch.Tensor, side: str, basis_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``R = G Pᵀ`` (right, ``P`` ``r × n``; ``basis_t`` = ``Pᵀ`` contiguous, made when not given)
    / ``Pᵀ G`` (left, ``P`` ``m × r``) — :func:`fedgalore.optim.projector.project` — by the AVX2
    kernels. Callers check :func:`usable` first."""
    if (g.dim() != 2 or basis.dim() != 2 or g.dtype != torch.float32 or not g.is_contiguous()
            or basis.shape != ((basis.shape[0], g.shape[1]) if side == "right" else (g.shape[0], basis.shape[1]))):
        raise ValueError(f"basis {tuple(basis.shape)} does not fit a {tuple(g.shape)} {side}-side gradient (contiguous fp32)")
    basis = basis.contiguous()
    if side == "right" and (basis_t is None or basis_t.shape != (basis.shape[1], basis.shape[0]) or not basis_t.is_contiguous()):
        basis_t = basis.T.contiguous()
    return _project(_state["lib"], g, basis, basis_t, side)  # type: ignore[arg-type]


def decay_back_project(w: torch.Tensor, u: torch.Tensor, basis: torch.Tensor, side: str, decay: float, coef: float) -> None:
    """``W ← decay·W + coef·U P`` (right) / ``decay·W + coef·P U`` (left), in place, one read and
    one write of ``W`` (:func:`fedgalore.optim.galore_adamw._decay_back_project`'s rule; the
    products ``coef·u_ij`` are formed first). Callers check :func:`usable` first."""
    m, n = w.shape
    r = basis.shape[0] if side == "right" else basis.shape[1]
    want_u = (m, r) if side == "right" else (r, n)
    if tuple(u.shape) != want_u or not w.is_contiguous() or w.dtype != torch.float32 or u.dtype != torch.float32:
        raise ValueError(f"decay_back_project: W {tuple(w.shape)} (contiguous fp32) needs U of shape {want_u}")
    _back(_state["lib"], w, u, basis, side, float(decay), float(coef))  # type: ignore[arg-type]
