"""What a run's defences did, in reports (``federation.robust``, ``federation.secure_aggregation``).

:func:`exclusions_markdown` lists, per run, every upload ``federation.robust`` excluded (round,
client, reason — the ``robust_excluded`` entries of ``clients.jsonl``) and a count per client, so a
hostile site shows up as the client excluded every round (``excluded.md`` of a report);
:func:`exclusion_counts` gives the counts for ``comparison.json``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from fedgalore.jsonl import read_jsonl
from fedgalore.report import RunRecord
from fedgalore.report.client_eval import run_title

__all__ = ["exclusions", "exclusion_counts", "exclusions_markdown"]


def exclusions(r: RunRecord) -> list[dict[str, Any]]:
    """The run's client records with a ``robust_excluded`` reason (clients.jsonl)."""
    path = r.path / "clients.jsonl"
    if not path.is_file():
        return []
    return [c for c in read_jsonl(path) if c.get("robust_excluded")]


def exclusion_counts(runs: Sequence[RunRecord]) -> dict[str, dict[str, int]]:
    """run directory name → {client: rounds excluded}, for the runs that excluded any."""
    out = {}
    for r in runs:
        ex = exclusions(r)
        if ex:
            out[r.path.name] = {str(k): v for k, v in sorted(Counter(c.get("client_name", c["client"]) for c in ex).items(),
                                                             key=lambda kv: str(kv[0]))}
    return out


def exclusions_markdown(runs: Sequence[RunRecord]) -> str | None:
    """Per run: the excluded uploads (round, client, reason) and the count per client; None when no
    run excluded any."""
    out: list[str] = []
    for r in runs:
        ex = exclusions(r)
        if not ex:
            continue
        counts = Counter(c.get("client_name", c["client"]) for c in ex)
        rounds = len({c["round"] for c in read_jsonl(r.path / "clients.jsonl")})
        out += [f"### {run_title(r)}", "",
                "Excluded by federation.robust: " + ", ".join(f"client {k} in {v} of {rounds} rounds" for k, v in
                                                             sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))), "",
                "| round | client | reason |", "|---:|---|---|"]
        out += [f"| {c['round']} | {c.get('client_name', c['client'])} | {c['robust_excluded']} |" for c in ex]
        out.append("")
    return "\n".join(out).rstrip() if out else None
