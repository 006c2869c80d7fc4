"""Confirmation of ``fedgalore tune``'s choices on seeds the search did not see.

Candidates (:func:`candidates`): each row's best finished trial and, when a runner-up's search value
lies within ``close`` of it (metric units), the runner-up too — a search on one seed does not tell
two such configurations apart. Each candidate runs at its values on every held-out seed at every
confirmation horizon (``--confirm-rounds``; default: the config's rounds), a run per cell
(:func:`run_cells`), and its cell JSON (``<out>/cells/<name>.json``) records the config, the seed,
the test metrics, the bytes per client-round, the wall time, ε under privacy, and the hashes of the
model and data files the run read. Every number of the report's verdict comes from these cells.

A held-out seed draws another partition, other client samples and other round seeds; the task's
own data seed is the config's, so every cell of a seed trains on the same examples and the cells
pair by seed. Held-out seeds that are also the search's seed are refused.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fedgalore.compare import cell_status, claim_cell
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.tune.search import Row, TuneSpec, config_hash, open_study, storage_url, trial_config

__all__ = ["Candidate", "ConfirmCell", "candidates", "confirm_cells", "run_cells", "load_cells"]


@dataclass
class Candidate:
    """A configuration to confirm: its row, its values, its search value and trial."""

    row: Row
    params: dict[str, Any]
    value: float
    trial: int
    role: str  # "best" | "runner-up"

    @property
    def name(self) -> str:
        return f"{self.row.label}-{config_hash(trial_config(self.row, self.params))}"


@dataclass
class ConfirmCell:
    candidate: Candidate
    seed: int
    rounds: int

    @property
    def name(self) -> str:
        return f"{self.candidate.name}-s{self.seed}-r{self.rounds}"


def candidates(spec: TuneSpec, rows: Sequence[Row]) -> list[Candidate]:
    """Each row's best finished trial and its close runner-up (module doc)."""
    from optuna.trial import TrialState

    url = storage_url(spec)
    out = []
    for row in rows:
        study = open_study(spec, row, url, check=False)
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
        if not done:
            continue
        higher = study.direction.name == "MAXIMIZE"
        done.sort(key=lambda t: (-t.value if higher else t.value, t.number))
        out.append(Candidate(row, dict(done[0].params), float(done[0].value), done[0].number, "best"))
        for t in done[1:]:
            same = trial_config(row, t.params) == trial_config(row, done[0].params)
            if not same and abs(t.value - done[0].value) <= spec.close:
                out.append(Candidate(row, dict(t.params), float(t.value), t.number, "runner-up"))
                break
    return out


def confirm_cells(spec: TuneSpec, cands: Sequence[Candidate]) -> list[ConfirmCell]:
    """Every candidate × held-out seed × confirmation horizon."""
    if spec.base.seed in spec.heldout_seeds:
        raise ConfigError(f"--heldout-seeds {','.join(map(str, spec.heldout_seeds))} includes the search's seed {spec.base.seed}: "
                          "a confirmation on it would not be held out (give other seeds, or another config seed)")
    rounds = spec.confirm_rounds or [spec.base.federation.rounds]
    return [ConfirmCell(c, s, r) for r in rounds for c in cands for s in spec.heldout_seeds]


def _cell_path(spec: TuneSpec, cell: ConfirmCell) -> Path:
    return spec.out / "cells" / f"{cell.name}.json"


def load_cells(spec: TuneSpec, cells: Sequence[ConfirmCell]) -> list[dict[str, Any]]:
    """The finished cells' JSON (missing ones are skipped)."""
    out = []
    for cell in cells:
        path = _cell_path(spec, cell)
        if path.is_file():
            out.append(json.loads(path.read_text()))
    return out


def _cell_record(cell: ConfirmCell, d: dict[str, Any], run_dir: Path, summary: dict[str, Any], history: list[dict[str, Any]],
                 seconds: float) -> dict[str, Any]:
    try:
        ident = json.loads((run_dir / "identity.json").read_text())
    except (OSError, ValueError):
        ident = {}
    eps = [h["dp_epsilon"] for h in history if isinstance(h.get("dp_epsilon"), (int, float))]
    evals = {h["round"]: {k[5:]: v for k, v in h.items() if k.startswith("eval/")} for h in history if any(k.startswith("eval/") for k in h)}
    return {
        "version": 1, "name": cell.name, "label": cell.candidate.row.label, "method": cell.candidate.row.method,
        "role": cell.candidate.role, "params": cell.candidate.params, "search_value": cell.candidate.value,
        "search_trial": cell.candidate.trial, "seed": cell.seed, "rounds": cell.rounds, "config": d,
        "primary_metric": summary.get("primary_metric"), "higher_is_better": summary.get("higher_is_better"),
        "final": summary.get("final", {}), "final_validation": summary.get("final_validation", {}),
        "bytes_up_per_client_round": summary.get("bytes_up_per_client_round"),
        "bytes_down_per_client_round": summary.get("bytes_down_per_client_round"),
        "wall_s": round(float(summary.get("wall_time") or seconds), 2),
        "dp_epsilon": float(eps[-1]) if eps else None, "evals": evals,
        "inputs": ident.get("inputs"), "status": summary.get("status"),
    }


def run_cells(spec: TuneSpec, cells: Sequence[ConfirmCell], say: Callable[[str], None]) -> None:
    """Run the cells that have no JSON yet (claimed, so workers on one folder share them; an
    unfinished run resumes from its checkpoint)."""
    import fedgalore
    from fedgalore.jsonl import read_jsonl

    for i, cell in enumerate(cells, 1):
        path = _cell_path(spec, cell)
        if path.is_file():
            continue
        claim = claim_cell(spec.out / "confirm", cell.name)
        if claim is None:
            say(f"[confirm {i}/{len(cells)}] {cell.name}: claimed by another worker")
            continue
        try:
            if path.is_file():
                continue
            d = trial_config(cell.candidate.row, cell.candidate.params, cell.seed, cell.rounds)
            d["output"]["dir"] = str(spec.out / "confirm")
            d["output"]["run_name"] = cell.name
            d["output"]["progress"] = "quiet"
            run_dir = spec.out / "confirm" / cell.name
            status = cell_status(run_dir)
            say(f"[confirm {i}/{len(cells)}] {cell.candidate.row.label} ({cell.candidate.role}) seed {cell.seed}, "
                f"{cell.rounds} rounds: {'resuming' if status == 'running' else 'running'} -> {run_dir}")
            t0 = time.perf_counter()
            if status == "complete":
                summary = json.loads((run_dir / "summary.json").read_text())
            else:
                res = fedgalore.run(FederatedConfig.from_dict(d), resume=run_dir if status == "running" else None)
                summary = res.summary
            history = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
            rec = _cell_record(cell, d, run_dir, summary, history, time.perf_counter() - t0)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
            tmp.replace(path)
        finally:
            claim.unlink(missing_ok=True)


def check_one_setup(records: Sequence[dict[str, Any]]) -> None:
    """Refuse cells that ran on different model or data files (a study must not mix backbones)."""
    seen: dict[str, tuple[str, Any]] = {}
    for rec in records:
        for name, entry in (rec.get("inputs") or {}).items():
            if name in seen and seen[name][1] != entry:
                raise ConfigError(f"cells {seen[name][0]} and {rec['name']} ran on different {name!r} files (another "
                                  "backbone or data set): re-run one of them on this machine's inputs (delete its cell JSON)")
            seen.setdefault(name, (rec["name"], entry))


def t975(n: int) -> float:
    """Student's t quantile 0.975 with ``n - 1`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) if n >= 2 else math.nan


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Mean of a − b over paired seeds with its 95 % t interval."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n if n else math.nan
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": n}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t975(n) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}
