"""Comparison grids: methods × partition settings × seeds under one identical budget.

:func:`run_grid` takes a base :class:`~fedgalore.job.config.FederatedConfig` and changes
only the method, the partition setting and the seed per cell — rounds, local steps, rank, lr,
clients, evaluation and everything else stay those of the base config, so every method gets the
same training budget (docs/design.md §4). Cells run one after another; each cell's resolved config is
saved before it runs, and a restart skips the finished cells (``summary.json`` says
``status: finished``; ``complete`` in runs from before 2026-11-28) and resumes an unfinished one from its last checkpoint — only when the
cell's run is this cell's: the same identity (:mod:`fedgalore.records.identity`: the resolved
config with every option's default filled in, and the model and data files it read). A cell that
ran with another config or inputs is refused before any cell runs, naming what differs;
``rerun_changed=True`` (``--rerun-changed``) re-runs it instead, after moving its old run
directory to ``.superseded/<cell>-<n>`` (kept, never reported). At the end the comparison table
and plots are written (:func:`fedgalore.report.build_report`).

Method options. The base config's ``method.options`` is a pool: every cell's method takes the
options it accepts (FedGaLore's GaLore/AJIVE knobs go to the fedgalore family, ``lora_alpha`` to
the LoRA baselines, ``trainable`` to FedAvg-Full; :func:`fedgalore.methods.base.split_options`).
``method_options`` gives per-row options on top (entries for rows that are not in this grid are
ignored, so one options file serves any subset of methods)::

    {"fedit": {"lora_alpha": 16},
     "fedgalore_minus": {"method": "fedgalore", "sync": "none"}}   # an alias row (ablation)

An entry with a ``method`` key defines a *row label* that runs that registered method with those
options, e.g. the paper's FedGaLore⁻ ablation as ``fedgalore`` with ``sync: none``. Labels are
what ``methods`` lists and what the table rows show.

An entry's ``train`` mapping overrides the base config's ``train`` section for that row only
(e.g. ``{"fedit": {"train": {"lr": 1e-3}}}`` — a per-method learning rate); the row's cells
record it in their configs and the budget (rounds, local epochs, batch size) stays shared unless
a row changes it explicitly. So the heterogeneity remedies are rows too (docs/remedies.md):
``{"fedit_prox": {"method": "fedit", "train": {"prox_mu": 0.01}}}``, ``train: {scaffold: true}``,
and an entry's ``server_optimizer`` mapping replaces ``federation.server_optimizer`` for that row
(``{"fedit_adam": {"method": "fedit", "server_optimizer": {"name": "fedadam", "lr": 1e-3}}}``).

Parallel workers. Before running a cell a process claims it (``.claims/<cell>`` in
``out_dir``, created atomically, holding the process id); a cell claimed by another live process
is skipped, a claim left by a dead process is taken over. So several ``run_grid`` processes on one ``out_dir`` share
the cells without running any twice, and whichever finds every cell complete writes the report.
``shard=(i, n)`` additionally restricts a process to cells whose index (in grid order) is ``i``
modulo ``n``.

Layout of ``out_dir``::

    grid.json               the grid: methods, settings, seeds, options, base config, cells
    configs/<cell>.yaml     each cell's resolved config (what ran)
    runs/<cell>/            each cell's run directory (<label>-<setting>-s<seed>)
    .superseded/<cell>-<n>/ old runs of cells re-run with another config or inputs (--rerun-changed)
    comparison.json, table.md, table.tex, plots/   the report
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.events import ProgressSink
from fedgalore.records.identity import Difference, RunIdentity, compare_with_saved, run_identity, summarize
from fedgalore.records.liveness import is_finished, pid_alive
from fedgalore.federated.partition import PartitionConfig, parse_setting
from fedgalore.methods.base import MethodError, available_methods, parse_options, split_options

__all__ = ["Cell", "plan_grid", "row_config", "check_rows", "run_grid", "cell_status", "claim_cell"]

log = logging.getLogger("fedgalore")


@dataclass
class Cell:
    """One run of the grid."""

    label: str  # row label (usually the method name)
    method: str  # registered method name
    setting: str  # canonical partition setting ("iid", "dirichlet:0.5", "natural:site", ...)
    seed: int
    name: str  # run name = directory under out_dir/runs
    cfg: FederatedConfig


def _setting(s: str | PartitionConfig) -> PartitionConfig:
    return s if isinstance(s, PartitionConfig) else parse_setting(s)


def _slug(setting: str) -> str:
    return setting.replace(":", "")


def check_rows(labels: Sequence[str], method_options: Mapping[str, Mapping[str, Any]]) -> None:
    if not labels:
        raise ConfigError("no methods given; pass e.g. --methods fedgalore,fedit")
    names = available_methods()
    # entries for rows outside this grid are fine (one options file serves any subset of methods);
    # an entry that can never be a row (no registered method of that name, no `method` key) is a typo
    for label, opts in method_options.items():
        if label not in labels and label not in names and "method" not in opts:
            raise ConfigError(f"method options given for {label!r}, which is neither a registered method "
                              f"({', '.join(names)}) nor a row alias (an entry with a `method` key)")
    for label in labels:
        target = str(method_options.get(label, {}).get("method", label))
        if target not in names:
            hint = "" if label == target else f" (row {label!r})"
            raise MethodError(f"unknown method {target!r}{hint}; available: {', '.join(names)}")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"methods list has duplicates: {', '.join(labels)}")


def row_config(base_cfg: FederatedConfig, label: str, method_options: Mapping[str, Mapping[str, Any]] | None = None
               ) -> tuple[str, dict[str, Any]]:
    """The config (a plain dict) of row ``label``: the base config with the row's method, its
    options (the base pool's that the method accepts, then the row's own), its ``train`` overrides
    and its ``server_optimizer`` (module doc, "Method options"); returns ``(method, config)``.
    A bad option or key is a :class:`ConfigError` / :class:`MethodError` naming the row."""
    opts = dict((method_options or {}).get(label, {}))
    method = str(opts.pop("method", label))
    base = base_cfg.to_dict()
    train_over = opts.pop("train", None) or {}
    if not isinstance(train_over, Mapping):
        raise ConfigError(f"row {label!r}: train must be a mapping of train.* overrides, e.g. {{lr: 1.0e-3}}, got {train_over!r}")
    unknown = sorted(set(train_over) - set(base["train"]))
    if unknown:
        raise ConfigError(f"row {label!r}: unknown train key {unknown[0]!r}; valid: {', '.join(sorted(base['train']))}")
    server_opt = opts.pop("server_optimizer", None)
    if server_opt is not None and not isinstance(server_opt, Mapping):
        raise ConfigError(f"row {label!r}: server_optimizer must be a mapping like {{name: fedadam, lr: 1.0e-3}}, got {server_opt!r}")
    options, _ = split_options(method, dict(base["method"]["options"]))
    options.update(opts)
    try:  # a bad option fails before any cell runs
        parse_options(method, options, base_cfg.method.rank)
    except MethodError as exc:
        raise MethodError(f"row {label!r}: {exc}") from None
    base["method"]["name"] = method
    base["method"]["options"] = options
    base["train"].update(json.loads(json.dumps(dict(train_over))))
    if server_opt is not None:  # the row's own server optimizer replaces the base config's
        base["federation"]["server_optimizer"] = json.loads(json.dumps(dict(server_opt)))
    return method, base


def plan_grid(
    base_cfg: FederatedConfig,
    methods: Sequence[str],
    settings: Sequence[str | PartitionConfig],
    seeds: Sequence[int] | None,
    out_dir: str | Path,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Cell]:
    """The grid's cells (method-major, then setting, then seed), each with its own config."""
    method_options = {k: dict(v) for k, v in (method_options or {}).items()}
    check_rows(list(methods), method_options)
    parts = [_setting(s) for s in settings]
    if not parts:
        raise ConfigError("no partition settings given; pass e.g. --settings iid,dirichlet:0.5")
    seeds = list(seeds) if seeds else [base_cfg.seed]
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigError(f"seeds must be integers, got {s!r}")
    out = Path(out_dir)
    cells = []
    for label in methods:
        method, row = row_config(base_cfg, label, method_options)
        for part in parts:
            setting = part.label()
            for seed in seeds:
                d = json.loads(json.dumps(row))  # deep copy
                d["federation"]["partition"].update(part.setting_fields())  # the rest: the base config's
                if part.kind == "natural":  # one client per value: the data decides how many
                    d["federation"]["num_clients"] = None
                d["seed"] = int(seed)
                name = f"{label}-{_slug(setting)}-s{seed}"
                d["output"]["dir"] = str(out / "runs")
                d["output"]["run_name"] = name
                cells.append(Cell(label, method, setting, int(seed), name, FederatedConfig.from_dict(d)))
    return cells


def claim_cell(out: Path, name: str) -> Path | None:
    """Atomically claim cell ``name`` for this process; ``None`` if a live process holds it."""
    d = out / ".claims"
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = int(path.read_text().strip() or "0")
            except (OSError, ValueError):
                holder = 0
            if holder == os.getpid():
                return path
            if holder and pid_alive(holder):
                return None
            path.unlink(missing_ok=True)  # stale claim of a dead process
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    return None


def cell_status(run_dir: Path) -> str:
    """``complete`` | ``running`` (started, resumable) | ``new``."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return "new"
    try:
        status = json.loads(summary.read_text()).get("status")
    except (json.JSONDecodeError, OSError):
        return "running"
    return "complete" if is_finished(status) else "running"


def _save_cell_config(cell: Cell, out: Path) -> None:
    """Write ``configs/<cell>.yaml`` (the cell's config)."""
    from omegaconf import OmegaConf

    path = out / "configs" / f"{cell.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cell.cfg.to_dict())))


def _changed(run_dir: Path, identity: RunIdentity) -> tuple[list[Difference], str | None]:
    """How the run in a started cell's ``run_dir`` differs from the cell's ``identity`` ([] for a
    new cell or the same run), and what was unknown about it (:func:`compare_with_saved`)."""
    if cell_status(run_dir) == "new":
        return [], None
    return compare_with_saved(run_dir, identity)


def _check_changed(cells: Sequence[Cell], identities: Mapping[str, RunIdentity], out: Path, rerun: bool,
                   say: Callable[[str], None]) -> set[str]:
    """The started cells that ran with another config or inputs: refused (unless ``rerun``) with
    the cells and what differs; says once when cells were judged without recorded inputs."""
    changed, unknown = {}, 0
    for cell in cells:
        diffs, note = _changed(out / "runs" / cell.name, identities[cell.name])
        unknown += note is not None and not diffs
        if diffs:
            changed[cell.name] = f"{cell.name} ({summarize(diffs, 2)})"
    if unknown:
        say(f"note: {unknown} finished or started cell(s) in {out} were written before run identities (no identity.json): "
            "they count as this grid's when their config.yaml matches with this version's defaults; the model and data "
            "files they read were not recorded")
    if changed and not rerun:
        more = f"; and {len(changed) - 2} more cell(s)" if len(changed) > 2 else ""
        raise ConfigError(f"{len(changed)} cell(s) in {out} already ran with a different config or inputs: "
                          f"{'; '.join(list(changed.values())[:2])}{more}; re-run them with --rerun-changed (their old "
                          f"runs move to {out / '.superseded'}), or use another output directory (--out)")
    return set(changed)


def _supersede(run_dir: Path, out: Path) -> Path:
    """Move a cell's old run directory to ``<out>/.superseded/<cell>-<n>`` (the first free n)."""
    n = 1
    while (dest := out / ".superseded" / f"{run_dir.name}-{n}").exists():
        n += 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    run_dir.rename(dest)
    return dest


def _write_grid(out: Path, base_cfg: FederatedConfig, labels: Sequence[str], cells: Sequence[Cell],
                method_options: Mapping[str, Any]) -> None:
    grid_path = out / "grid.json"
    old_cells: list[dict[str, Any]] = []
    if grid_path.is_file():
        try:
            old_cells = json.loads(grid_path.read_text()).get("cells", [])
        except json.JSONDecodeError:
            old_cells = []
    entries = {c["run_name"]: c for c in old_cells if "run_name" in c}
    for c in cells:
        entries[c.name] = {"label": c.label, "method": c.method, "setting": c.setting, "seed": c.seed, "run_name": c.name,
                           "run_dir": f"runs/{c.name}", "config": f"configs/{c.name}.yaml"}
    grid = {
        "methods": list(labels),
        "settings": list(dict.fromkeys(c.setting for c in cells)),
        "seeds": list(dict.fromkeys(c.seed for c in cells)),
        "method_options": {k: dict(v) for k, v in method_options.items()},
        "base_config": base_cfg.to_dict(),
        "cells": list(entries.values()),
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = grid_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(grid, indent=1, default=str) + "\n")
    tmp.replace(grid_path)


class _GridEta:
    """Time left for the whole grid: the mean wall time of the cells this process has run so
    far times the cells still to run (shown once one cell has finished)."""

    def __init__(self, todo: int) -> None:
        self.todo, self.done, self.spent, self._t0 = todo, 0, 0.0, 0.0

    def begin(self) -> None:
        self._t0 = time.perf_counter()

    def end(self) -> None:
        self.done += 1
        self.spent += time.perf_counter() - self._t0

    def text(self) -> str:
        left = self.todo - self.done
        if self.done == 0:
            return f" ({left} cell(s) to run)"
        secs = int(self.spent / self.done * left)
        return f" ({left} cell(s) to run, grid eta {secs // 60}:{secs % 60:02d} at {self.spent / self.done / 60:.1f} min a cell)"


def run_grid(
    base_cfg: FederatedConfig,
    methods: Sequence[str],
    settings: Sequence[str | PartitionConfig],
    seeds: Sequence[int] | None,
    out_dir: str | Path,
    progress: ProgressSink | None = None,
    *,
    method_options: Mapping[str, Mapping[str, Any]] | None = None,
    report: bool = True,
    on_cell: Callable[[str], None] | None = None,
    shard: tuple[int, int] | None = None,
    rerun_changed: bool = False,
) -> Path:
    """Run every cell of the grid that has not finished yet; write the report; return ``out_dir``.

    ``progress`` is passed to each run; ``on_cell`` receives one line per cell (default: the
    ``fedgalore`` logger at INFO level). ``shard=(i, n)`` runs only cells ``i, i+n, i+2n, ...``
    (parallel workers on one ``out_dir``); the report is written once every cell is complete.
    A started cell whose run has another identity than the cell (a changed option, model or data
    file) is a :class:`ConfigError` naming it, before any cell runs; ``rerun_changed`` re-runs
    such cells instead (module doc).
    """
    from fedgalore.engine.api import run as run_one
    from fedgalore.job.resolve import check_device

    check_device(base_cfg.device)
    out = Path(out_dir)
    if shard is not None:
        i, n = shard
        if not (isinstance(n, int) and isinstance(i, int) and n >= 1 and 0 <= i < n):
            raise ConfigError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    method_options = dict(method_options or {})
    cells = plan_grid(base_cfg, methods, settings, seeds, out, method_options)
    say = on_cell or log.info
    identities = {c.name: run_identity(c.cfg) for c in cells}
    stale = _check_changed(cells, identities, out, rerun_changed, say)  # every cell before running any: fails fast
    for cell in cells:
        _save_cell_config(cell, out)
    _write_grid(out, base_cfg, methods, cells, method_options)
    mine = [i for i in range(1, len(cells) + 1) if shard is None or (i - 1) % shard[1] == shard[0]]
    todo = sum(1 for i in mine if cell_status(out / "runs" / cells[i - 1].name) != "complete" or cells[i - 1].name in stale)
    eta = _GridEta(todo)
    for i, cell in enumerate(cells, 1):
        run_dir = out / "runs" / cell.name
        status = cell_status(run_dir)
        head = f"[cell {i}/{len(cells)}] {cell.label} {cell.setting} seed={cell.seed}"
        if i not in mine:
            continue
        if status == "complete" and cell.name not in stale:
            say(f"{head}: complete, skipped ({run_dir})")
            continue
        claim = claim_cell(out, cell.name)
        if claim is None:
            say(f"{head}: claimed by another worker, skipped")
            continue
        try:
            diffs, _ = _changed(run_dir, identities[cell.name])  # checked again under the claim: another
            if diffs:  # worker may have re-run it meanwhile
                say(f"{head}: ran with another config or inputs ({summarize(diffs)}); old run moved to "
                    f"{_supersede(run_dir, out)}")
            status = cell_status(run_dir)  # another worker may have finished it meanwhile
            if status == "complete":
                say(f"{head}: complete, skipped ({run_dir})")
                continue
            say(f"{head}: {'resuming' if status == 'running' else 'running'} -> {run_dir}{eta.text()}")
            eta.begin()
            if status == "running":
                run_one(cell.cfg, resume=run_dir, progress=progress)
            else:
                run_one(cell.cfg, progress=progress)
            eta.end()
        finally:
            claim.unlink(missing_ok=True)
    if report:
        pending = [c.name for c in cells if cell_status(out / "runs" / c.name) != "complete"]
        if pending:
            say(f"report not written yet: {len(pending)} cell(s) of other shards still running (e.g. {pending[0]}); "
                f"the last shard to finish writes it, or run: fedgalore report {out}")
            return out
        from fedgalore.report import build_report

        build_report(out)
    return out

