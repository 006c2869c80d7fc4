"""Reports: paper-style tables (Markdown, LaTeX) and plots from run directories.

Everything here reads only the files a run writes (``summary.json``, ``metrics.jsonl``,
``diagnostics.jsonl``, ``partition.json``, ``config.yaml``), never the engine, so a report can be
rebuilt at any time — also while a comparison is still running.

* :func:`load_run` / :func:`find_runs` — read one run directory / every run under a folder;
* :func:`build_report` — tables (:mod:`fedgalore.report.tables`) and plots
  (:mod:`fedgalore.report.plots`) for a run directory or a comparison directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgalore.records.liveness import is_finished
from fedgalore.jsonl import read_jsonl

__all__ = ["RunRecord", "ReportError", "load_run", "find_runs", "build_report", "method_display_name"]


class ReportError(ValueError):
    """Nothing to report (no run directory found) or an unreadable run directory."""


#: the paper's row order and names (Tables 2-4); unknown methods follow in their given order
METHOD_ORDER = ["fedavg_full", "fedit", "ffa_lora", "flora", "lora_fair", "fr_lora", "fedgalore_minus", "fedgalore_mean", "fedgalore"]
_DISPLAY = {
    "fedavg_full": "FedAvg-Full",
    "fedit": "FedIT",
    "ffa_lora": "FFA-LoRA",
    "flora": "FLoRA",
    "lora_fair": "LoRA-FAIR",
    "fr_lora": "FR-LoRA",
    "fedgalore": "FedGaLore",
    "fedgalore_minus": "FedGaLore⁻",
    "fedgalore_mean": "FedGaLore (mean sync)",
}


#: display names whose LaTeX form is not the plain one escaped
_LATEX_DISPLAY = {"fedgalore_minus": "FedGaLore$^-$"}


def method_display_name(name: str, latex: bool = False) -> str:
    if latex and name in _LATEX_DISPLAY:
        return _LATEX_DISPLAY[name]
    out = _DISPLAY.get(name, name)
    return out.replace("_", r"\_") if latex else out


@dataclass
class RunRecord:
    """The files of one run directory, parsed."""

    path: Path
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    diagnostics: list[dict[str, Any]] = field(default_factory=list)  # diagnostics.jsonl
    partition: dict[str, Any] | None = None  # partition.json
    label: str | None = None  # row label (comparison grids may alias a method, e.g. fedgalore_minus)
    config: dict[str, Any] | None = None  # config.yaml (what ran: budget, learning rates)

    @property
    def method(self) -> str:
        return self.label or str(self.summary.get("method", "?"))

    @property
    def task(self) -> str:
        return str(self.summary.get("task", "?"))

    @property
    def setting(self) -> str:
        return str(self.summary.get("setting", "?"))

    @property
    def seed(self) -> int:
        return int(self.summary.get("seed", 0))

    @property
    def complete(self) -> bool:
        return is_finished(self.summary.get("status"))

    @property
    def primary_metric(self) -> str:
        return str(self.summary.get("primary_metric", "accuracy"))

    @property
    def higher_is_better(self) -> bool:
        return bool(self.summary.get("higher_is_better", True))

    def metric(self, name: str | None = None, which: str = "final") -> float | None:
        """``summary[which][name]`` (``which``: final | best), falling back to the last history
        record that holds ``eval/<name>``. A run without a pooled test set — a Flower deployment
        whose sites hold all the data (``partition.kind: nodes``) — gives the sites' example-weighted
        mean, ``client_mean_<name>``, instead."""
        name = name or self.primary_metric
        table = self.summary.get(which) or {}
        names = (name,) if name.startswith("client_") else (name, f"client_mean_{name}")
        for n in names:
            for key in (n, f"eval/{n}"):
                if isinstance(table.get(key), (int, float)):
                    return float(table[key])
            values = [r[f"eval/{n}"] for r in self.history if isinstance(r.get(f"eval/{n}"), (int, float))]
            if values:
                break
        if not values:
            return None
        if which == "best":
            return max(values) if self.higher_is_better else min(values)
        return float(values[-1])




def load_run(path: str | Path, label: str | None = None) -> RunRecord:
    """Read a run directory (it must hold ``summary.json``)."""
    p = Path(path)
    summary_path = p / "summary.json"
    if not summary_path.is_file():
        raise ReportError(f"{p} is not a run directory (no summary.json); pass a run or comparison directory")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{summary_path} is not valid JSON ({exc.msg}); is the run still being written?") from None
    partition = None
    if (p / "partition.json").is_file():
        try:
            partition = json.loads((p / "partition.json").read_text())
        except json.JSONDecodeError:
            partition = None
    config = None
    if (p / "config.yaml").is_file():
        try:
            from omegaconf import OmegaConf

            loaded = OmegaConf.to_container(OmegaConf.load(p / "config.yaml"), resolve=True)
            config = loaded if isinstance(loaded, dict) else None
        except Exception:  # noqa: BLE001 - an unreadable config only loses the budget line
            config = None
    return RunRecord(
        path=p,
        summary=summary,
        history=sorted(read_jsonl(p / "metrics.jsonl"), key=lambda r: r.get("round", 0)),
        diagnostics=sorted(read_jsonl(p / "diagnostics.jsonl"), key=lambda r: r.get("round", 0)),
        partition=partition,
        label=label,
        config=config,
    )


def _grid_labels(root: Path) -> dict[Path, str]:
    """run dir -> row label, from a comparison directory's ``grid.json`` (if any)."""
    grid = root / "grid.json"
    if not grid.is_file():
        return {}
    try:
        cells = json.loads(grid.read_text()).get("cells", [])
    except (json.JSONDecodeError, AttributeError):
        return {}
    return {(root / c["run_dir"]).resolve(): c["label"] for c in cells if "run_dir" in c and "label" in c}


def grid_method_order(root: Path) -> list[str]:
    grid = Path(root) / "grid.json"
    if grid.is_file():
        try:
            return list(json.loads(grid.read_text()).get("methods", []))
        except (json.JSONDecodeError, AttributeError):
            return []
    return []


def find_runs(root: str | Path, max_depth: int = 4) -> list[RunRecord]:
    """Every run directory (a folder holding ``summary.json``) at or below ``root``, except those
    inside ``checkpoints`` or a hidden folder (a comparison's ``.superseded`` old runs)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; pass a run directory or a comparison directory")
    if (root / "summary.json").is_file():
        return [load_run(root)]
    labels = _grid_labels(root)
    runs = []
    for summary in sorted(root.rglob("summary.json")):
        rel = summary.parent.relative_to(root)
        if len(rel.parts) > max_depth or "checkpoints" in rel.parts or any(p.startswith(".") for p in rel.parts):
            continue
        runs.append(load_run(summary.parent, labels.get(summary.parent.resolve())))
    if not runs:
        raise ReportError(f"no run directories (with summary.json) under {root}")
    return runs


def build_report(
    path: str | Path,
    out_dir: str | Path | None = None,
    which: str = "final",
    plots: bool = True,
) -> dict[str, Any]:
    """Write the tables and plots for a run or comparison directory.

    Returns ``{"out": Path, "files": [Path, ...], "comparison": dict}``; the files are
    ``comparison.json``, ``table.md``, ``table.tex``, ``client_eval.md`` (runs with
    ``federation.client_eval``), ``excluded.md`` (runs whose ``federation.robust`` excluded uploads)
    and ``plots/*.png|pdf`` under ``out_dir`` (default: ``path`` itself).
    """
    from fedgalore.report import client_eval, privacy, tables

    root = Path(path)
    runs = find_runs(root)
    single = (root / "summary.json").is_file()
    out = Path(out_dir) if out_dir is not None else root
    out.mkdir(parents=True, exist_ok=True)
    order = grid_method_order(root)
    comp = tables.aggregate(runs, which=which, method_order=order, include_incomplete=single)
    comp["privacy"] = privacy.privacy_line(runs, comp["methods"])  # what the runs protected (privacy.json)
    for row in comp["runs"]:  # run folders relative to the report, so a copied report stays valid
        try:
            row["run_dir"] = Path(row["run_dir"]).resolve().relative_to(out.resolve()).as_posix()
        except ValueError:
            pass
    from fedgalore.report import guards

    comp["robust_excluded"] = guards.exclusion_counts(runs)  # federation.robust: which client, how many rounds
    files = tables.write_tables(comp, out)
    excluded = guards.exclusions_markdown(runs)
    if excluded is not None:
        (out / "excluded.md").write_text(excluded + "\n")
        files.append(out / "excluded.md")
    per_client = client_eval.client_eval_markdown(runs)
    if per_client is not None:  # runs with federation.client_eval
        (out / "client_eval.md").write_text(per_client + "\n")
        files.append(out / "client_eval.md")
    if plots:
        from fedgalore.report import plots as _plots

        files += _plots.plot_all(runs, out / "plots", comp)
    return {"out": out, "files": files, "comparison": comp}
