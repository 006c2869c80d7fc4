"""Per-client evaluation in reports (runs with ``federation.client_eval: true``).

Reads the ``client_eval`` entries of ``metrics.jsonl`` (:mod:`fedgalore.engine.client_eval`):

* :func:`client_eval_markdown` — per run, the last evaluated round's table: every client's
  held-out examples and metrics, then the example-weighted mean, the worst client, the spread
  (std, max − min) of the primary metric (``client_eval.md`` of a report);
* :func:`fedgalore.report.plots.plot_client_eval` draws the per-client curves.
"""
from __future__ import annotations

from typing import Any, Sequence

from fedgalore.report import RunRecord, method_display_name

__all__ = ["client_eval_markdown", "evaluated_rounds", "run_title"]


def evaluated_rounds(r: RunRecord) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl`` records that hold a per-client evaluation."""
    return [h for h in r.history if isinstance(h.get("client_eval"), dict)]


def run_title(r: RunRecord) -> str:
    """``method — task — setting — seed`` (headings and panel titles)."""
    return f"{method_display_name(r.method)} — {r.task} — {r.setting} — seed {r.seed}"


def client_eval_markdown(runs: Sequence[RunRecord]) -> str | None:
    """The per-client tables (module doc); None when no run evaluated its clients."""
    out = []
    for r in runs:
        hist = evaluated_rounds(r)
        if not hist:
            continue
        last, p = hist[-1], r.primary_metric
        per = last["client_eval"]["clients"]
        metrics = [p] + sorted(k for k in next(iter(per.values())) if k not in ("n", p))
        out += [f"### {run_title(r)} (round {last['round']})", "",
                "| client | held-out examples | " + " | ".join(metrics) + " |",
                "|---|---:|" + "---:|" * len(metrics)]
        for name, rec in per.items():
            out.append(f"| {name} | {rec['n']} | " + " | ".join(f"{rec.get(m, float('nan')):.4f}" for m in metrics) + " |")
        mean = [last.get(f"eval/client_mean_{m}") for m in metrics]
        out.append(f"| **weighted mean** | {sum(c['n'] for c in per.values())} | "
                   + " | ".join("" if v is None else f"{v:.4f}" for v in mean) + " |")
        out += ["", f"worst client: **{last['client_eval']['worst_client']}** ({p} "
                f"{last.get(f'eval/client_worst_{p}', float('nan')):.4f}); spread of {p} across clients: "
                f"std {last.get(f'eval/client_std_{p}', float('nan')):.4f}, max − min "
                f"{last.get(f'eval/client_range_{p}', float('nan')):.4f}", ""]
    return "\n".join(out) if out else None
