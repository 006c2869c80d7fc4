"""The report's privacy line: what each method's runs protected, from their ``privacy.json``.

A run with record-level DP (``privacy.record``) states ε (the largest over its sites), δ, C, σ
and the accountant; one with client-level DP (``privacy.client``) ε of the federation, δ, C, σ and
the noise — and, under ``privacy.reproducible``, that it is NOT protected against whoever holds the
config; a run with σ = 0 that it was clipping only (not protected); a run without DP says that
nothing was protected; a run from before
``privacy.json`` says it was not recorded (docs/privacy.md).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from fedgalore.engine.stages.privacy_ledger import read_privacy
from fedgalore.privacy.statement import CLIPPING_ONLY, NOT_PROTECTED_REPRODUCIBLE
from fedgalore.report import RunRecord, method_display_name

__all__ = ["privacy_line"]


def _method_text(docs: list[dict[str, Any] | None]) -> str:
    if any(d is None for d in docs):
        return "not recorded (run(s) from before privacy.json)"
    if not any(d.get("protected") for d in docs):
        if all(d.get("mechanism") or d.get("client") for d in docs):  # DP on, σ = 0
            return CLIPPING_ONLY
        return "none — nothing was protected"
    if not all(d.get("protected") for d in docs):
        return "mixed — some runs without DP (or with σ = 0)"
    parts = []
    if all(d.get("mechanism") for d in docs):
        parts.append(_record_text(docs))
    if all(d.get("client") for d in docs):
        parts.append(_client_text(docs))
    text = "; ".join(parts) if parts else "mixed — record-level and client-level DP in different runs"
    if any(d.get("reproducible") for d in docs):  # seeded draws: whoever holds the config regenerates the noise
        text += f"; {NOT_PROTECTED_REPRODUCIBLE}" if all(d.get("reproducible") for d in docs) else (
            f"; some runs {NOT_PROTECTED_REPRODUCIBLE}")
    return text


def _client_text(docs: list[dict[str, Any]]) -> str:
    """Client-level DP-FedAvg: ε of the federation (the largest over the runs), δ, C, σ, the noise."""
    client = [d["client"] for d in docs]
    eps = [float(c["epsilon"]) if isinstance(c.get("epsilon"), (int, float)) else math.inf for c in client]
    e = max(eps)
    mech = [c.get("mechanism") or {} for c in client]
    sig = sorted({float(c.get("noise_multiplier") or 0) for c in client})
    sigma = "σ " + (f"{sig[0]:.3g}" if len(sig) == 1 else f"{sig[0]:.3g}–{sig[-1]:.3g}")
    return (f"client-level DP-FedAvg ({'/'.join(sorted({str(m.get('noise')) for m in mech}))} noise), ε ≤ "
            f"{'∞' if not math.isfinite(e) else f'{e:.3g}'} for the federation at δ = "
            f"{'/'.join(f'{x:g}' for x in sorted({float(c['delta']) for c in client}))} "
            f"(C {'/'.join(f'{x:g}' for x in sorted({float(m['clip']) for m in mech}))}, {sigma})")


def _record_text(docs: list[dict[str, Any]]) -> str:
    """Record-level DP-SGD: ε (the largest over the sites of the runs), δ, C, σ, the accountant."""
    mech = [d.get("mechanism") or {} for d in docs]
    eps = [float(d.get("epsilon_max", math.nan)) for d in docs]
    e = max(eps)
    sigmas = sorted({float(s["noise_multiplier"]) for d in docs for s in (d.get("sites") or {}).values()
                     if s.get("noise_multiplier") is not None})
    sigma = ("σ " + (f"{sigmas[0]:.3g}" if len(sigmas) == 1 else f"{sigmas[0]:.3g}–{sigmas[-1]:.3g}")) if sigmas else "σ –"
    deltas = sorted({m.get("delta") for m in mech})
    clips = sorted({m.get("max_grad_norm") for m in mech})
    acc = sorted({str(m.get("accountant", "?")).split(" (")[0] for m in mech})
    return (f"record-level DP-SGD, ε ≤ {'∞' if not math.isfinite(e) else f'{e:.3g}'} per site at δ = "
            f"{'/'.join(f'{x:g}' for x in deltas)} (C {'/'.join(f'{x:g}' for x in clips)}, {sigma}, {'/'.join(acc)})")


def privacy_line(runs: Sequence[RunRecord], methods: Sequence[str]) -> str | None:
    """One line: per method, what its runs protected (module doc); None without runs or when
    no run recorded a ``privacy.json``."""
    if not runs:
        return None
    docs = {r.path: read_privacy(r.path) for r in runs}
    if all(d is None for d in docs.values()):  # runs from before privacy.json: nothing to say
        return None
    by_method: dict[str, list[dict[str, Any] | None]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(docs[r.path])
    texts = {m: _method_text(by_method[m]) for m in list(methods) + [m for m in by_method if m not in methods] if m in by_method}
    if len(set(texts.values())) == 1:
        return f"Privacy (every method): {next(iter(texts.values()))}."
    return "Privacy: " + "; ".join(f"{method_display_name(m)}: {t}" for m, t in texts.items()) + "."
