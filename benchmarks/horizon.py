"""Issue 33 (B): FedGaLore against its ablation and the baselines at the paper's horizon, R = 50.

Usage (from the repo root; every stage skips the cells whose result JSON is already there)::

    python benchmarks/horizon.py horizon_probe    # seed 0: each row's rate grid per alpha (+ one widening), the IID reference
    python benchmarks/horizon.py horizon_seeds    # seeds 1-4 at the rates chosen on seed 0's validation split
    python benchmarks/horizon.py horizon_tolerance  # seeds 1-4 at each row's 6-round rate (default: the GaLore rows, alpha 0.1)
    python benchmarks/horizon.py horizon_report   # results/horizon/horizon.{json,md} and the figures, from the cell JSONs
    options: --rows fedgalore_minus,fedavg_full (default: the five must rows)   --alphas 0.1,0.3 (default)
             --workers N (parallel single-threaded `fedgalore compare` processes, default 2)
             --seeds 4,3 (horizon_seeds: these held-out seeds only, in this order: split them between machines)
             --device cuda (run the workers there; a cell is the same cell on any device -- :func:`same_run` --
             and the report names the GPU cells and times the CPU cells alone)
             --dry-run (list the cells a stage would run, run nothing)
             --quick (a tiny budget on the tiny_text task into benchmarks/runs/horizon_quick: every stage in ~1 min)

Budget: ``conf/repro/offline_text_50.yaml`` (MiniLM-L6 x BBC News, M = 50, K = 5, E = 2, rank 8,
64 tokens) with the overrides :data:`HORIZON_OVERRIDES`: R = 50 rounds, evaluation every 2 rounds
and after each of the last 10 (``federation.eval_last``), 10 % of the training pool held out for
validation and the issue-17 partition draws (``min_size 1``, ``max_retries 1000``).

Rows (:data:`ROWS`): must ``fedgalore`` (default options), ``fedgalore_paper`` (``moment_protocol:
paper``), ``fedgalore_minus``, ``fedavg_full``, ``fedit_prox`` (FedIT + FedProx, mu 0.1); optional,
in this order, ``fedavg_full_prox`` (mu 1), ``fedavg_full_scaffold``, ``fedit``.

Rates. Each row's rate is chosen per alpha on seed 0 by the mean *validation* accuracy over the
last 10 rounds (ties: the smaller rate) among :func:`probe_rates`: at alpha 0.1 a grid reaching
10x below the row's 6-round choice (:data:`GRID_01`), widened once by one step (:data:`WIDEN_01`)
when the best rate sits at its edge; at other alphas the 6-round choice and half of it. The
held-out seeds 1-4 then run at the chosen rates; they share partitions and client samples across
rows (the engine derives both from the seed alone; the report checks it per cell). One IID run
of ``fedgalore_minus`` (seed 0, its 6-round rate) measures the IID level behind "rounds to 90 %".
``horizon_tolerance`` runs rows at their 6-round rate on the held-out seeds (by default the GaLore
rows at alpha 0.1, where seed 0 saw the default keep 94.9 % validation at 1e-2 and FedGaLore- 66.9 %):
robustness to a rate tuned on a short horizon; the report gives it its own table and pairs.

Resuming. Each finished cell becomes ``benchmarks/results/horizon/cells/<alpha>/<label>-s<seed>.json``
(:data:`CELL_VERSION`): the resolved config that made it, per round the sampled clients, their
local steps, the diagnostics and (when evaluated) test and validation metrics, bytes per
client-round, wall time and the workers' CPU time. A stage skips a cell whose JSON has this version and the config the
stage would run now (a changed config runs again); the runs themselves go to
``benchmarks/runs/horizon/<alpha>/<label>-s<seed>/`` (ignored; a killed worker resumes there from its
last checkpoint). So a fresh clone with the committed JSONs continues where the study stopped, and
``horizon_report`` needs nothing but the JSONs. The driver never runs git.
"""
# fedgalore-bench: not-in-all (a long study with stages; run it by name)
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from repro_offline_text import ALIGN_OVERRIDES, CONFIG, ROOT, _alpha_dir, compare_argv, worker_env

CELL_VERSION = 1
# ------------------------------------------------------------------------------------- the rows
ROWS: dict[str, dict] = {
    "fedgalore": {"method": "fedgalore"},
    "fedgalore_paper": {"method": "fedgalore", "moment_protocol": "paper"},
    # issue 40: paper mode with the sign-invariant move instead of App. B's linear reprojection (which
    # blows steps up at the epoch schedule's RSVD -> R_k switch): Algorithm 1's sync without that defect
    "fedgalore_paper_sq": {"method": "fedgalore", "moment_protocol": "paper", "moment_transfer": "squared"},
    "fedgalore_minus": {"method": "fedgalore_minus"},
    "fedavg_full": {"method": "fedavg_full"},
    "fedit_prox": {"method": "fedit", "train": {"prox_mu": 0.1}},
    "fedavg_full_prox": {"method": "fedavg_full", "train": {"prox_mu": 1.0}},
    "fedavg_full_scaffold": {"method": "fedavg_full", "train": {"scaffold": True}},
    "fedit": {"method": "fedit"},
}
MUST_ROWS = ["fedgalore", "fedgalore_paper", "fedgalore_minus", "fedavg_full", "fedit_prox"]
# the 6-round rates chosen on validation (results/repro_text/alignment/alignment.json at alpha 0.3
# and 0.5: fedgalore_aligned = today's default, fedgalore_minus, fedavg_full, fedit; the remedies
# of results/repro_text/remedies/remedies.json train at their base's rate). fedgalore_paper's
# 6-round choice (1e-3) was made with the old paper mode, so it starts from the GaLore rows' 1e-2.
SIX_ROUND_RATE = {"fedgalore": 1e-2, "fedgalore_paper": 1e-2, "fedgalore_paper_sq": 1e-2, "fedgalore_minus": 1e-2, "fedavg_full": 5e-4,
                  "fedit_prox": 5e-3, "fedavg_full_prox": 5e-4, "fedavg_full_scaffold": 5e-4, "fedit": 5e-3}
FAMILY = {"fedgalore": "galore", "fedgalore_paper": "galore", "fedgalore_paper_sq": "galore", "fedgalore_minus": "galore", "fedavg_full": "dense",
          "fedit_prox": "lora", "fedavg_full_prox": "dense", "fedavg_full_scaffold": "dense", "fedit": "lora"}
# alpha 0.1: a grid from the 6-round choice to >= 10x below it; one step beyond either edge
GRID_01 = {"galore": [1e-2, 3e-3, 1e-3, 3e-4], "dense": [5e-4, 2e-4, 1e-4, 5e-5], "lora": [5e-3, 2e-3, 1e-3, 5e-4]}
WIDEN_01 = {"galore": (3e-2, 1e-4), "dense": (1e-3, 2e-5), "lora": (1e-2, 2e-4)}  # (up, down)
ALPHA_01 = "dirichlet:0.1"
IID = "iid"
IID_ROW = "fedgalore_minus"  # the IID reference run: this row at its 6-round rate, seed 0
# the paired differences the report gives (a - b), on every metric
PAIRS = [("fedgalore", "fedgalore_minus"), ("fedgalore", "fedavg_full"), ("fedgalore_paper", "fedgalore_minus"),
         ("fedgalore", "fedgalore_paper"), ("fedgalore_paper_sq", "fedgalore_minus"), ("fedgalore_paper", "fedgalore_paper_sq")]
#: issue 40: where the sync can act, per round (round diagnostics; mean over the round's clients)
SYNC_KEYS = ("view_step_share", "upload_kept", "warm_kept", "prior_retained", "warm_clamped", "ajive_fallback")
#: issue 40's report compares these rows with issue 33's cells of the same row (the step schedule)
SCHEDULE_ROWS = ("fedgalore", "fedgalore_paper", "fedgalore_minus")
# drift diagnostics plotted when a cell has them (diagnostics.jsonl keys; part A adds update-ratio
# quantiles: every key with "ratio_max", "ratio_p99" or "update_ratio" in its name is plotted too)
DRIFT_KEYS = ("mismatch_before", "mismatch_after", "drift_mean", "client_update_norm_mean", "update_norm_vs_cold",
              "v_warm_cold_ratio")
DRIFT_PATTERNS = ("ratio_max", "ratio_p99", "update_ratio")
GALORE_METHODS = ("fedgalore", "fedgalore_minus")
# horizon_tolerance: the rows at their 6-round rate on the held-out seeds (by default the GaLore rows
# at alpha 0.1, where seed 0's probe saw the default keep 94.9 % validation at 1e-2 and FedGaLore- 66.9 %)
TOLERANCE_ROWS = ["fedgalore", "fedgalore_minus", "fedgalore_paper"]
TOLERANCE_PAIRS = [("fedgalore", "fedgalore_minus"), ("fedgalore_paper", "fedgalore_minus"), ("fedgalore", "fedgalore_paper")]


def rate_tag(lr: float) -> str:
    """``1e-2``, ``2.5e-4``, ``1.25e-4``: a rate as it appears in labels."""
    mant, exp = f"{lr:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


# ------------------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """One study's budget: base config and overrides, the metric windows, seeds and layout."""

    name: str
    extra: tuple[str, ...]  # overrides on top of the issue-17 ones and the round schedule
    rounds: int
    eval_every: int
    last: int  # the last-rounds window: evaluated every round; the rate choice and "last 10" metric
    stable_from: int  # stability metrics over evaluated rounds >= this
    seeds: tuple[int, ...]  # held-out seeds
    widen_at: tuple[str, ...]  # alphas whose grid is widened once at an edge
    runs: Path
    results: Path
    probe_seed: int = 0
    config: Path = CONFIG
    #: the seed-0 grids where they differ from :func:`probe_rates`' defaults: ((family, alpha), rates)
    grids: tuple = ()
    #: one step beyond those grids' edges: ((family, alpha), (up, down))
    widen: tuple = ()
    #: rows whose rate is not probed here: ((row, alpha), rate) -- a choice made by another study
    fixed: tuple = ()
    #: the budget whose IID reference gives "rounds to 90 %" when this one has none of its own
    iid_from: "Budget | None" = None
    title: str = "Issue 33 B: the study at the paper's horizon"

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*ALIGN_OVERRIDES, f"federation.rounds={self.rounds}", f"federation.eval_every={self.eval_every}",
                f"federation.eval_last={self.last}", *self.extra)


# issue 33's study ran before the epoch schedule existed: its GaLore rows refreshed every tau = 50 steps and
# never reached the seeded phase (the steps schedule, pinned here so its committed cells stay what they were)
FULL = Budget("offline_text_50_r50", ("method.options.projector_schedule=steps",), 50, 2, 10, 10, (1, 2, 3, 4), (ALPHA_01,),
              ROOT / "benchmarks" / "runs" / "horizon", ROOT / "benchmarks" / "results" / "horizon")
#: issue 40: the same study where the sync can act -- the epoch schedule (RSVD in local epoch 1, the round's seeded
#: basis R_k in epoch 2, so every client ends the round on R_k). The GaLore rows' rates are probed again (grids
#: around issue 33's choices, widened once at an edge at both alphas); FedAvg-Full trains without projectors, so
#: issue 33's seed-0 choice stands for it.
EPOCH_ROWS = ["fedgalore", "fedgalore_paper", "fedgalore_minus", "fedavg_full"]
EPOCH = Budget("offline_text_50_r50_epoch", ("method.options.projector_schedule=epoch",), 50, 2, 10, 10, (1, 2, 3, 4),
               (ALPHA_01, "dirichlet:0.3"), ROOT / "benchmarks" / "runs" / "horizon_epoch",
               ROOT / "benchmarks" / "results" / "horizon_epoch",
               grids=((("galore", ALPHA_01), (1e-2, 3e-3, 1e-3)), (("galore", "dirichlet:0.3"), (1e-2, 5e-3, 2.5e-3))),
               widen=((("galore", ALPHA_01), (3e-2, 3e-4)), (("galore", "dirichlet:0.3"), (2e-2, 1.25e-3))),
               fixed=((("fedavg_full", ALPHA_01), 2e-4), (("fedavg_full", "dirichlet:0.3"), 2.5e-4)),
               iid_from=FULL, title="Issue 40: the 50-round study with the epoch schedule (the sync where it can act)")
STUDIES = {"horizon": FULL, "epoch": EPOCH}
#: the study's overrides of conf/repro/offline_text_50.yaml (issue 17's, then R = 50, eval every 2 and the last 10)
HORIZON_OVERRIDES = FULL.overrides
QUICK_ROWS = ["fedgalore_minus", "fedavg_full"]
QUICK_ALPHAS = ["dirichlet:0.3"]
# tiny_text (a random 2-layer BERT), 6 clients, 4 rounds: every stage end to end in about a minute;
# the 2-rate grid at alpha 0.3 is widened there so the widening step runs too
QUICK_EXTRA = ("task.name=tiny_text", "task.options={}", "task.options.n_train=240", "task.options.n_test=64",
               "method.rank=4", "federation.num_clients=6", "federation.clients_per_round=3", "train.local_epochs=3",
               "output.checkpoint_every=1")


def quick_budget(root: Path) -> Budget:
    """The ``--quick`` budget, writing runs and results under ``root``."""
    return Budget("tiny_text_quick", QUICK_EXTRA, 4, 2, 2, 2, (1, 2), tuple(QUICK_ALPHAS), root / "runs", root / "results")


# ------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class CellSpec:
    """One run of the study: a row at one rate, one partition setting, one seed."""

    alpha: str  # "dirichlet:0.1" or "iid"
    row: str
    lr: float
    seed: int

    @property
    def label(self) -> str:
        return f"{self.row}_lr{rate_tag(self.lr)}"

    @property
    def key(self) -> str:
        return f"{_adir(self.alpha)}/{self.label}-s{self.seed}"

    def options(self) -> dict:
        """The compare row (``--method-options`` entry): the row's options at this rate."""
        opts = json.loads(json.dumps(ROWS[self.row]))
        opts["train"] = {**opts.get("train", {}), "lr": self.lr}
        return opts


def _adir(alpha: str) -> str:
    return IID if alpha == IID else _alpha_dir(alpha)


def cell_json(budget: Budget, cell: CellSpec) -> Path:
    return budget.results / "cells" / f"{cell.key}.json"


def cell_out(budget: Budget, cell: CellSpec) -> Path:
    return budget.runs / cell.key


@lru_cache(maxsize=8)
def _base_config(budget: Budget):
    from fedgalore.job.config import load_config

    return load_config(budget.config, budget.overrides)


def portable(cfg: dict) -> dict:
    """A resolved config without where it was written (``output.dir``, ``output.run_name``)."""
    cfg = json.loads(json.dumps(cfg))
    for k in ("dir", "run_name"):
        cfg.get("output", {}).pop(k, None)
    return cfg


def same_run(old: dict, new: dict) -> str | None:
    """The first difference between two portable configs that makes them different runs of the
    study (``config_difference``), the ``device`` aside: a cell run on a GPU (``--device cuda``)
    is the same cell as on the CPU -- same partition, client samples and schedule; only its
    floating-point arithmetic differs. Its device stays in its ``config`` and the report names it."""
    from fedgalore.job.config import config_difference

    return config_difference({**old, "device": "cpu"}, {**new, "device": "cpu"})


def planned_config(budget: Budget, cell: CellSpec) -> dict:
    """The resolved config ``fedgalore compare`` would run for ``cell`` now (portable)."""
    from fedgalore.compare import plan_grid

    (c,) = plan_grid(_base_config(budget), [cell.label], [cell.alpha], [cell.seed], cell_out(budget, cell),
                     {cell.label: cell.options()})
    return portable(c.cfg.to_dict())


def load_cell(budget: Budget, cell: CellSpec, check: bool = True) -> dict | None:
    """The cell's result JSON if it has this version and (``check``) the config the stage would
    run now; None otherwise (a stale one is reported and re-run)."""
    path = cell_json(budget, cell)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    if rec.get("version") != CELL_VERSION:
        _say_once(f"{cell.key}: result version {rec.get('version')} != {CELL_VERSION}: runs again")
        return None
    if check:
        diff = same_run(rec["config"], planned_config(budget, cell))
        if diff:
            _say_once(f"{cell.key}: the config changed since its result ({diff}): runs again, and is not reported")
            return None
    return rec


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        print(text, flush=True)


def mechanism_digest() -> str:
    """SHA-256 (first 16 hex digits) of the sources that define FedGaLore's mechanism (optim, sync,
    protocol, methods/fedgalore.py): provenance, so cells made by different code can be told apart."""
    import fedgalore

    src = Path(fedgalore.__file__).resolve().parent
    h = hashlib.sha256()
    files = sorted([*src.glob("optim/*.py"), *src.glob("sync/*.py"), *src.glob("protocol/*.py"), src / "methods" / "fedgalore.py"])
    for f in files:
        h.update(f.relative_to(src).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _numeric(d: dict, drop: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in drop}


def cell_record(cell: CellSpec, run_dir: Path) -> dict:
    """The result JSON of a finished run (see the module doc)."""
    from omegaconf import OmegaConf

    from fedgalore.jsonl import read_jsonl

    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = portable(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True))
    diags = {d["round"]: _numeric(d, ("round", "time_s")) for d in read_jsonl(run_dir / "diagnostics.jsonl")}
    steps: dict[int, list[int]] = {}
    for c in read_jsonl(run_dir / "clients.jsonl"):
        if "error" not in c and "steps" in c:
            steps.setdefault(c["round"], []).append(int(c["steps"]))
    rounds = []
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        r = {"round": m["round"], "clients": m["clients"], "dropped": m.get("dropped", []), "steps": steps.get(m["round"], []),
             "train_loss": m.get("train_loss"), "diag": diags.get(m["round"], {})}
        test = {k[5:]: v for k, v in m.items() if k.startswith("eval/") and not k.startswith("eval/val_")}
        val = {k[9:]: v for k, v in m.items() if k.startswith("eval/val_")}
        if test:
            r["test"] = test
        if val:
            r["val"] = val
        rounds.append(r)
    partition = (run_dir / "partition.json").read_bytes()
    # written by run_cells at each launch of the cell: the sources that ran it, the workers' CPU time
    source = run_dir.parent.parent / "source.json"
    launched = json.loads(source.read_text()) if source.is_file() else {}
    digests = launched.get("mechanism_digests") or [mechanism_digest()]
    import fedgalore

    return {
        "version": CELL_VERSION, "alpha": cell.alpha, "row": cell.row, "label": cell.label, "lr": cell.lr, "seed": cell.seed,
        "status": summary["status"], "config": cfg,
        "source": {"fedgalore": fedgalore.__version__, "mechanism_digest": "+".join(digests)},
        "partition_digest": hashlib.sha256(partition).hexdigest()[:16],
        "client_sizes": json.loads(partition)["sizes"],
        "bytes_up_per_client_round": summary["bytes_up_per_client_round"],
        "bytes_down_per_client_round": summary["bytes_down_per_client_round"],
        "wall_time_s": summary["wall_time"], "time_per_round_s": summary["time_per_round"],
        # user + system seconds of the compare workers; None for a run the driver did not start or
        # one with a killed launch (its CPU time is not known)
        "cpu_time_s": measured_cpu_s(launched),
        "rounds": rounds,
    }


def _write_json(path: Path, obj: dict) -> None:
    """Atomically (a killed driver leaves the old file or none, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def _run_dir(budget: Budget, cell: CellSpec) -> Path:
    return cell_out(budget, cell) / "runs" / f"{cell.label}-{cell.alpha.replace(':', '')}-s{cell.seed}"


def _harvest(budget: Budget, cell: CellSpec) -> bool:
    """Write the cell's JSON from its run directory if that run is complete with today's config."""
    from fedgalore.compare import cell_status

    run_dir = _run_dir(budget, cell)
    if cell_status(run_dir) != "complete":
        return False
    rec = cell_record(cell, run_dir)
    if same_run(rec["config"], planned_config(budget, cell)):
        return False
    _write_json(cell_json(budget, cell), rec)
    return True


def _prepare(budget: Budget, cell: CellSpec) -> None:
    """Remove the cell's run folder when it ran with another config (compare would refuse it)."""
    from omegaconf import OmegaConf

    out = cell_out(budget, cell)
    saved = out / "configs" / f"{_run_dir(budget, cell).name}.yaml"
    if saved.is_file():
        old = portable(OmegaConf.to_container(OmegaConf.load(saved), resolve=True))
        diff = same_run(old, planned_config(budget, cell))
        if diff:
            print(f"{cell.key}: its run folder ran another config ({diff}); removing {out}", flush=True)
            shutil.rmtree(out)


def _note_source(out: Path, cpu_s: float | None = None) -> None:
    """Add today's mechanism digest to the cell's ``source.json`` (one entry per distinct source
    that ran a part of it: a cell resumed under other code lists both) and count a launch
    (``cpu_s`` None) or a worker's exit with its ``cpu_s`` CPU seconds. A killed launch (a machine
    restart) never reports its CPU time: ``launches`` > ``exits`` then, and :func:`cell_record`
    says the CPU time is unmeasured. A record an older driver wrote has no counts (``None``: not
    known once it is launched again)."""
    path = out / "source.json"
    rec = (json.loads(path.read_text()) if path.is_file()
           else {"mechanism_digests": [], "cpu_s": 0.0, "launches": 0, "exits": 0})
    if mechanism_digest() not in rec["mechanism_digests"]:
        rec["mechanism_digests"].append(mechanism_digest())
    if cpu_s is None:
        if "launches" not in rec:
            rec["launches"] = rec["exits"] = None
        elif rec["launches"] is not None:
            rec["launches"] += 1
    else:
        rec["cpu_s"] += cpu_s
        if rec.get("exits") is not None:
            rec["exits"] += 1
    _write_json(path, rec)


def measured_cpu_s(launched: dict) -> float | None:
    """The cell's CPU seconds from its ``source.json`` record, or None where a launch's are
    missing (a killed launch, or a relaunch of a record whose launches were not counted). A
    record without counts at all (an older driver's, one launch as far as is known) keeps its
    ``cpu_s``."""
    if "launches" in launched and (launched["launches"] is None or launched["launches"] != launched["exits"]):
        return None
    return launched.get("cpu_s")


def _reap(proc: subprocess.Popen) -> float | None:
    """The CPU seconds (user + system) of a worker that has exited, None while it runs."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def worker_argv(budget: Budget, cell: CellSpec, device: str | None = None) -> list[str]:
    """The ``fedgalore compare`` command of the worker that runs ``cell`` (on ``device`` when given)."""
    overrides = (*budget.overrides, *([f"device={device}"] if device else []))
    return [*compare_argv(budget.config, [cell.label], [cell.alpha], [cell.seed], cell_out(budget, cell),
                          {cell.label: cell.options()}, overrides),
            "--no-report"]  # the study's report is horizon_report's


def run_cells(budget: Budget, cells: list[CellSpec], workers: int, dry_run: bool = False,
              followups=lambda: [], device: str | None = None) -> list[str]:
    """Run every cell without a current result JSON, ``workers`` ``fedgalore compare`` processes
    at a time (one cell each), writing each cell's JSON as soon as it finishes; ``followups()`` is
    asked for more cells after each one (the probe's widening). Returns the keys of cells that did
    not finish (a failed worker, or a cell another live process holds). ``device`` (e.g. ``cuda``)
    runs the workers there (override ``device=...``); the cells stay the same cells (:func:`same_run`)."""
    queue: list[CellSpec] = []
    seen: set[CellSpec] = set()

    def enqueue(new: list[CellSpec]) -> None:
        for c in new:
            if c in seen:
                continue
            seen.add(c)
            if load_cell(budget, c) is not None or (not dry_run and _harvest(budget, c)):
                continue
            queue.append(c)

    enqueue(cells)
    if dry_run:
        for c in queue:
            print(f"would run {c.key}")
        print(f"{len(queue)} cell(s) to run")
        return []
    env, failed, running = worker_env(), [], {}
    t0 = time.time()
    while queue or running:
        while queue and len(running) < workers:
            c = queue.pop(0)
            _prepare(budget, c)
            out = cell_out(budget, c)
            argv = worker_argv(budget, c, device)
            _note_source(out)
            log = open(out / "worker.log", "a")
            print(f"[{time.strftime('%H:%M:%S')}] start {c.key} ({len(queue)} queued)", flush=True)
            running[c] = (subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log, time.time())
        time.sleep(1.0)
        for c, (proc, log, t1) in list(running.items()):
            cpu = _reap(proc)
            if cpu is None:
                continue
            _note_source(cell_out(budget, c), cpu)
            log.close()
            del running[c]
            if proc.returncode == 0 and _harvest(budget, c):
                print(f"[{time.strftime('%H:%M:%S')}] done {c.key} in {(time.time() - t1) / 60:.1f} min", flush=True)
                enqueue(followups())
            else:
                failed.append(c.key)
                print(f"{c.key}: did not finish (exit {proc.returncode}); see {cell_out(budget, c)}/worker.log", flush=True)
    print(f"{len(seen) - len(failed)} of {len(seen)} cell(s) have results ({(time.time() - t0) / 60:.1f} min)", flush=True)
    return failed


# ------------------------------------------------------------------------------------- the rate choice
def fixed_rate(budget: Budget, row: str, alpha: str) -> float | None:
    """The rate another study chose for ``row`` at ``alpha`` (``budget.fixed``), or None."""
    return dict(budget.fixed).get((row, alpha))


def probe_rates(row: str, alpha: str, budget: Budget | None = None) -> list[float]:
    """The initial grid of ``row`` at ``alpha`` (largest first): the budget's own grid for the
    row's family when it has one, else issue 33's; empty for a row whose rate is fixed."""
    if budget is not None:
        if fixed_rate(budget, row, alpha) is not None:
            return []
        own = dict(budget.grids).get((FAMILY[row], alpha))
        if own is not None:
            return list(own)
    if alpha == ALPHA_01:
        return list(GRID_01[FAMILY[row]])
    c = SIX_ROUND_RATE[row]
    return [c, c / 2]


def widen_rate(budget: Budget, row: str, alpha: str, best: float) -> float | None:
    """One step beyond the initial grid's edge where ``best`` sits there (alphas ``budget.widen_at``)."""
    rates = probe_rates(row, alpha, budget)
    if alpha not in budget.widen_at or min(rates) < best < max(rates):
        return None
    own = dict(budget.widen).get((FAMILY[row], alpha))
    up, down = own or (WIDEN_01[FAMILY[row]] if alpha == ALPHA_01 else (2 * max(rates), min(rates) / 2))
    return up if best == max(rates) else down


def evaluated(rec: dict, split: str = "test", metric: str = "accuracy") -> dict[int, float]:
    """round -> the split's metric, on the rounds the cell evaluated."""
    return {r["round"]: r[split][metric] for r in rec["rounds"] if split in r and metric in r[split]}


def last_mean(rec: dict, last: int, split: str = "test") -> float:
    """Mean of the split's accuracy over the evaluated rounds among the last ``last``."""
    acc = evaluated(rec, split)
    rounds = max(r["round"] for r in rec["rounds"])
    vals = [a for r, a in acc.items() if r > rounds - last]
    return statistics.mean(vals) if vals else float("nan")


def choose(scores: dict[float, float]) -> float:
    """The rate with the best score; ties go to the smaller rate."""
    return max(scores, key=lambda lr: (scores[lr], -lr))


def probe_state(budget: Budget, row: str, alpha: str) -> dict:
    """Seed-0 probe of ``row`` at ``alpha`` from the cell JSONs: its rates, their scores (mean
    validation accuracy over the last rounds), the widening, the choice (None until complete)."""
    grid = probe_rates(row, alpha, budget)
    recs = {lr: load_cell(budget, CellSpec(alpha, row, lr, budget.probe_seed)) for lr in grid}
    state: dict = {"grid": grid, "scores": {}, "test": {}, "widened": None, "choice": None, "todo": [],
                   "fixed": fixed_rate(budget, row, alpha)}
    if state["fixed"] is not None:
        state["choice"] = state["fixed"]
        return state
    for lr, rec in recs.items():
        if rec is None:
            state["todo"].append(CellSpec(alpha, row, lr, budget.probe_seed))
        else:
            state["scores"][lr], state["test"][lr] = last_mean(rec, budget.last, "val"), last_mean(rec, budget.last)
    if state["todo"]:
        return state
    extra = widen_rate(budget, row, alpha, choose(state["scores"]))
    if extra is not None:
        state["widened"] = extra
        rec = load_cell(budget, CellSpec(alpha, row, extra, budget.probe_seed))
        if rec is None:
            state["todo"].append(CellSpec(alpha, row, extra, budget.probe_seed))
            return state
        state["scores"][extra], state["test"][extra] = last_mean(rec, budget.last, "val"), last_mean(rec, budget.last)
    state["choice"] = choose(state["scores"])
    return state


# ------------------------------------------------------------------------------------- stages
@dataclass
class Plan:
    budget: Budget
    rows: list[str] = field(default_factory=lambda: list(MUST_ROWS))
    alphas: list[str] = field(default_factory=lambda: [ALPHA_01, "dirichlet:0.3"])
    workers: int = 2
    dry_run: bool = False
    seeds: tuple[int, ...] | None = None  # horizon_seeds: these held-out seeds only (default: the budget's)
    device: str | None = None  # run the workers on this device (default: the config's, cpu)


def iid_cell(budget: Budget) -> CellSpec:
    return CellSpec(IID, IID_ROW, SIX_ROUND_RATE[IID_ROW], budget.probe_seed)


def stage_probe(plan: Plan) -> list[str]:
    """Seed 0: every row's initial grid at every alpha and the IID reference; each row's widening
    is queued as soon as its grid has finished."""
    b = plan.budget
    cells = [CellSpec(a, row, lr, b.probe_seed) for row in plan.rows for a in plan.alphas for lr in probe_rates(row, a, b)]

    def widenings() -> list[CellSpec]:
        return [c for row in plan.rows for a in plan.alphas for c in probe_state(b, row, a)["todo"]]

    # widenings() also holds the widening of a grid finished by an earlier, interrupted pass
    own_iid = [iid_cell(b)] if b.iid_from is None else []  # else the other study's IID level serves
    failed = run_cells(b, [*cells, *own_iid, *widenings()], plan.workers, plan.dry_run, widenings, plan.device)
    if plan.dry_run:
        open_ = sum(1 for row in plan.rows for a in plan.alphas
                    if a in b.widen_at and probe_state(b, row, a)["widened"] is None and probe_state(b, row, a)["todo"])
        print(f"plus up to {open_} widening cell(s): one per row and alpha {', '.join(b.widen_at)} whose best rate "
              "sits at its grid's edge")
    else:
        for a in plan.alphas:
            for row in plan.rows:
                st = probe_state(b, row, a)
                shown = ", ".join(f"{rate_tag(lr)}: {100 * v:.1f}" for lr, v in sorted(st["scores"].items()))
                print(f"{_adir(a)} {row}: val last-{b.last} mean {shown} -> "
                      f"{'chosen ' + rate_tag(st['choice']) if st['choice'] else 'incomplete'}", flush=True)
    return failed


def stage_seeds(plan: Plan) -> list[str]:
    """The held-out seeds at each row's chosen rate, seed by seed (an interrupted stage leaves the
    rows paired on the seeds it finished); rows whose probe is incomplete are named."""
    b = plan.budget
    chosen, missing = {}, []
    for row in plan.rows:
        for a in plan.alphas:
            st = probe_state(b, row, a)
            if st["choice"] is None:
                missing.append(f"{_adir(a)}/{row}")
            else:
                chosen[a, row] = st["choice"]
    cells = [CellSpec(a, row, lr, s) for s in (plan.seeds or b.seeds) for (a, row), lr in chosen.items()]
    failed = run_cells(b, cells, plan.workers, plan.dry_run, device=plan.device)
    return failed + [f"{m} (its probe: run horizon_probe first)" for m in missing]


def tolerance_cells(plan: Plan) -> list[CellSpec]:
    """``horizon_tolerance``: each row at its 6-round rate (:data:`SIX_ROUND_RATE`, the rate a
    short-horizon tuner picked) on the held-out seeds: does a row stay robust when its rate was
    chosen on 6 rounds? Where that rate is the chosen one these are the ``horizon_seeds`` cells."""
    return [CellSpec(a, row, SIX_ROUND_RATE[row], s) for s in (plan.seeds or plan.budget.seeds)
            for a in plan.alphas for row in plan.rows]


def stage_tolerance(plan: Plan) -> list[str]:
    """Run :func:`tolerance_cells` (the report's "at the 6-round rate" section)."""
    return run_cells(plan.budget, tolerance_cells(plan), plan.workers, plan.dry_run, device=plan.device)


# ------------------------------------------------------------------------------------- metrics
def iid_level(budget: Budget) -> float | None:
    """The IID level: the IID reference run's mean test accuracy over the last rounds (the
    ``iid_from`` budget's when this one has no IID cell of its own)."""
    rec = load_cell(budget, iid_cell(budget), check=False)
    if rec is None and budget.iid_from is not None:
        return iid_level(budget.iid_from)
    return None if rec is None else last_mean(rec, budget.last)


def cell_metrics(rec: dict, budget: Budget, target: float | None) -> dict:
    """One cell's metrics (accuracies as fractions): ``last`` (mean test accuracy over the last
    rounds), ``val_pick`` (test accuracy at the evaluated round of best validation accuracy, the
    earliest on ties), ``rounds_to_target`` (first evaluated round with test accuracy >= target;
    not reached: R + 1), ``rounds_to_target_stay`` (first evaluated round from which it never falls
    below again; R + 1 if none), ``std_after`` (population std of test accuracy over evaluated rounds
    >= stable_from) and ``worst_after`` (its minimum over evaluated rounds > stable_from)."""
    test, val = evaluated(rec), evaluated(rec, "val")
    rounds = max(r["round"] for r in rec["rounds"])
    out = {"last": last_mean(rec, budget.last)}
    if val:
        best = max(val.values())
        out["val_pick_round"] = min(r for r, v in val.items() if v == best)
        out["val_pick"] = test[out["val_pick_round"]]
    window = [a for r, a in test.items() if r >= budget.stable_from]
    out["std_after"] = statistics.pstdev(window) if window else float("nan")
    after = [a for r, a in test.items() if r > budget.stable_from]
    out["worst_after"] = min(after) if after else float("nan")
    if target is not None:
        hit = [r for r in sorted(test) if test[r] >= target]
        out["rounds_to_target"] = hit[0] if hit else rounds + 1
        stay = rounds + 1
        for r in sorted(test, reverse=True):
            if test[r] < target:
                break
            stay = r
        out["rounds_to_target_stay"] = stay
    return out


METRICS = ("last", "val_pick", "rounds_to_target", "rounds_to_target_stay", "std_after", "worst_after")


def _mean_std(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return {"mean": statistics.mean(xs) if xs else None, "std": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}


def paired(a: dict[int, float], b: dict[int, float], resamples: int = 10000) -> dict | None:
    """Paired difference a - b over the seeds both have: mean, std, 95 % interval by the paired t
    (n - 1 degrees of freedom) and by a percentile bootstrap over seeds (``resamples`` draws,
    numpy generator seed 0; with 4 seeds it has only 35 distinct resamples of the mean: coarse)."""
    import numpy as np
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds]
    if len(d) < 2:
        return {"seeds": seeds, "diff": d, "mean": d[0] if d else None} if d else None
    mean, sd = statistics.mean(d), statistics.stdev(d)
    half = stats.t.ppf(0.975, len(d) - 1) * sd / math.sqrt(len(d))
    arr = np.asarray(d)
    boot = arr[np.random.default_rng(0).integers(0, len(d), (resamples, len(d)))].mean(axis=1)
    return {"seeds": seeds, "diff": d, "mean": mean, "std": sd, "t95": [mean - half, mean + half],
            "bootstrap95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}


def projector_schedule(recs: list[dict]) -> dict | None:
    """Projector refreshes per client-round of GaLore cells, from the local step counts: a refresh
    at local steps 0, tau, 2 tau, ... (``update_proj_gap`` = tau) is ceil(steps / tau) refreshes; with
    ``*_then_random`` and ``adaptive_scope: round`` the first ``adaptive_proj_steps`` of a round are
    data-driven and the rest use seeded random bases. None for other methods."""
    recs = [r for r in recs if r["config"]["method"]["name"] in GALORE_METHODS]
    if not recs:
        return None
    o = recs[0]["config"]["method"]["options"]
    tau, s_data = int(o.get("update_proj_gap", 200)), int(o.get("adaptive_proj_steps", 1))
    out = {"projector": o.get("projector"), "update_proj_gap": tau, "adaptive_proj_steps": s_data,
           "adaptive_scope": o.get("adaptive_scope", "round")}
    steps = [s for r in recs for rnd in r["rounds"] for s in rnd["steps"]]
    refreshes = [-(-s // tau) for s in steps]
    out.update(client_rounds=len(steps), steps_min=min(steps), steps_max=max(steps),
               refreshes_min=min(refreshes), refreshes_max=max(refreshes), refreshes_mean=statistics.mean(refreshes))
    if out["adaptive_scope"] == "round" and str(out["projector"]).endswith("_then_random"):
        seeded = [max(0, q - s_data) for q in refreshes]
        out.update(seeded_refreshes=sum(seeded), client_rounds_with_seeded_basis=sum(1 for x in seeded if x))
    return out


def sync_where_it_acts(recs: list[dict]) -> dict:
    """Issue 40's mechanism numbers of a row: per key of :data:`SYNC_KEYS`, the mean over its
    cells of the per-round means (the round diagnostics average the round's clients), and the
    smallest cell mean; ``view_step_share`` must be ≥ 0.4 and ``upload_kept`` ≈ 1 for the sync to
    act where Algorithm 1 puts it. Empty for cells without these diagnostics (issue 33's)."""
    out = {}
    for key in SYNC_KEYS:
        per_cell = []
        for r in recs:
            vals = [x["diag"][key] for x in r["rounds"] if key in x["diag"]]
            if vals:
                per_cell.append(statistics.mean(vals))
        if per_cell:
            out[key] = {"mean": statistics.mean(per_cell), "min_cell": min(per_cell), "cells": len(per_cell)}
    return out


def pairing_check(cells: list[dict]) -> list[str]:
    """Cells of one (alpha, seed) must share the partition and the clients of every round. The
    partition is compared by its client sizes (the seeded draw decides them; recorded in every
    cell), not by ``partition_digest``, a hash of partition.json's bytes, which a change of that
    file's format alone would break."""
    problems, ref = [], {}
    for rec in cells:
        key = (rec["alpha"], rec["seed"])
        sig = (rec["client_sizes"], [r["clients"] for r in rec["rounds"]])
        if key not in ref:
            ref[key] = (rec["label"], sig)
        elif ref[key][1] != sig:
            what = "partition" if ref[key][1][0] != sig[0] else "client samples"
            problems.append(f"{_adir(rec['alpha'])} seed {rec['seed']}: {rec['label']} differs from {ref[key][0]} in its {what}")
    return problems


# ------------------------------------------------------------------------------------- the report
def _drift_keys(recs: list[dict]) -> list[str]:
    present = {k for r in recs for rnd in r["rounds"] for k in rnd["diag"]}
    return [k for k in DRIFT_KEYS if k in present] + sorted(
        k for k in present if k not in DRIFT_KEYS and any(p in k for p in DRIFT_PATTERNS))


def _per_round_mean(recs: list[dict], get) -> tuple[list[int], list[float], list[float]]:
    """Rounds where every cell has a value, the mean over cells and the (sample) std."""
    rounds = sorted(set.intersection(*[{rnd["round"] for rnd in r["rounds"] if get(rnd) is not None} for r in recs]))
    vals = [[next(get(x) for x in r["rounds"] if x["round"] == k) for r in recs] for k in rounds]
    return rounds, [statistics.mean(v) for v in vals], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]


def row_report(budget: Budget, recs: list[dict], target: float | None) -> dict:
    """Metrics of one row at one alpha over its held-out seeds (``recs``)."""
    per_seed = {r["seed"]: cell_metrics(r, budget, target) for r in recs}
    on_cpu = [r for r in recs if cell_device(r) == "cpu"]  # run times: CPU cells only (a GPU's are another scale)
    measured = [r["cpu_time_s"] for r in on_cpu if r.get("cpu_time_s")]
    rounds, mean, std = _per_round_mean(recs, lambda x: x.get("test", {}).get("accuracy"))
    _, vmean, _ = _per_round_mean(recs, lambda x: x.get("val", {}).get("accuracy"))
    out = {
        "lr": recs[0]["lr"], "seeds": sorted(per_seed), "per_seed": per_seed,
        "summary": {m: _mean_std([per_seed[s].get(m) for s in per_seed]) for m in METRICS},
        "curve": {"round": rounds, "test_mean": mean, "test_std": std, "val_mean": vmean},
        "bytes_up_per_client_round": statistics.mean(r["bytes_up_per_client_round"] for r in recs),
        "bytes_down_per_client_round": statistics.mean(r["bytes_down_per_client_round"] for r in recs),
        "devices": {r["seed"]: cell_device(r) for r in recs},
        "wall_time_min": statistics.mean(r["wall_time_s"] for r in on_cpu) / 60 if on_cpu else None,
        # CPU time: over the CPU cells whose every launch was measured (cpu_time_cells of them)
        "cpu_time_min": statistics.mean(measured) / 60 if measured else None,
        "cpu_time_cells": len(measured),
        "cpu_cells": len(on_cpu),
        "projector": projector_schedule(recs),
        "sync_where_it_acts": sync_where_it_acts(recs),
        "mechanism_digests": sorted({r["source"]["mechanism_digest"] for r in recs}),
        "drift": {},
    }
    for key in _drift_keys(recs):
        rounds_k, m, _ = _per_round_mean(recs, lambda x, key=key: x["diag"].get(key))
        if rounds_k:
            early = [v for k, v in zip(rounds_k, m) if k <= budget.last]
            late = [v for k, v in zip(rounds_k, m) if k > budget.rounds - budget.last]
            out["drift"][key] = {"round": rounds_k, "mean": m,
                                 "first_rounds_mean": statistics.mean(early) if early else None,
                                 "last_rounds_mean": statistics.mean(late) if late else None}
    return out


def cell_device(rec: dict) -> str:
    """The device a cell ran on (its config's ``device``; cpu for cells that predate the option)."""
    return rec["config"].get("device", "cpu")


def _num(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def _pct(x, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def _fmt(metric: str, s: dict) -> str:
    if s.get("mean") is None:
        return "—"
    scale = (lambda v: f"{v:.1f}") if metric.startswith("rounds") else (lambda v: _pct(v))
    return scale(s["mean"]) + ("" if s.get("std") is None else f" ± {scale(s['std'])}")


def report(plan: Plan) -> dict:
    """``horizon.json``, ``horizon.md``, ``accuracy_<alpha>.png`` (and ``accuracy_tolerance_<alpha>.png``)
    and ``drift_<alpha>.png`` in the budget's results folder, from the cell JSONs alone (cells whose
    config is not the one the stages would run now are left out and listed as missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = plan.budget
    dest = b.results
    level = iid_level(b)
    target = None if level is None else 0.9 * level
    result: dict = {"budget": {"name": b.name, "config": str(b.config.relative_to(ROOT)), "overrides": list(b.overrides),
                               "rounds": b.rounds, "last_window": b.last, "stable_from": b.stable_from,
                               "held_out_seeds": list(b.seeds), "probe_seed": b.probe_seed},
                    "iid_reference": {"cell": iid_cell(b).key, "level": level, "target_90": target},
                    "alphas": {}}
    md = [f"# {b.title} (R = {b.rounds})", "",
          f"Budget `{b.name}`: `{result['budget']['config']}` with `{' '.join(b.overrides)}`. "
          f"Accuracies in %, mean ± std over the held-out seeds {list(b.seeds)} (paired across rows); "
          f"rates chosen on seed {b.probe_seed}'s validation split by the mean over the last {b.last} rounds.", "",
          f"IID level (cell `{iid_cell(b).key}`, mean test accuracy over its last {b.last} rounds): {_pct(level)} %; "
          f"90 % of it: {_pct(target)} %. \"Rounds to 90 %\": the first evaluated round at or above it; \"… and stays\": "
          f"the first from which no later evaluated round falls below; not reached counts as {b.rounds + 1}.", ""]
    every = []
    for a in plan.alphas:
        entry: dict = {"probe": {}, "rows": {}, "paired": {}, "missing": [], "not_run": []}
        md += [f"## Dirichlet α = {a.split(':')[1]}", "", f"Probe (seed {b.probe_seed}; validation / test accuracy, "
               f"mean over the last {b.last} rounds):", ""]
        for row in plan.rows:
            st = probe_state(b, row, a)
            if not st["scores"] and st.get("fixed") is None:
                entry["not_run"].append(row)
                continue
            entry["missing"] += [c.key for c in st["todo"]]
            entry["probe"][row] = {"grid": st["grid"], "widened": st["widened"], "choice": st["choice"],
                                   "val_last": {rate_tag(k): v for k, v in sorted(st["scores"].items())},
                                   "test_last": {rate_tag(k): v for k, v in sorted(st["test"].items())}}
            cells = ", ".join(f"{rate_tag(lr)}: {_pct(st['scores'][lr])} / {_pct(st['test'][lr])}" for lr in sorted(st["scores"]))
            if st.get("fixed") is not None:
                cells = "not probed here: issue 33's seed-0 choice (its training does not depend on the projector schedule)"
            note = f"; widened to {rate_tag(st['widened'])}" if st["widened"] else ""
            md.append(f"- {row}: {cells or 'not run'}{note} → "
                      f"{'**' + rate_tag(st['choice']) + '**' if st['choice'] else 'incomplete'}")
            every += [r for lr in st["scores"] if (r := load_cell(b, CellSpec(a, row, lr, b.probe_seed), check=False))]
            if st["choice"] is None:
                continue
            recs = []
            for s in b.seeds:
                c = CellSpec(a, row, st["choice"], s)
                rec = load_cell(b, c)
                (recs.append(rec) if rec else entry["missing"].append(c.key))
            if recs:
                entry["rows"][row] = row_report(b, recs, target)
                every += recs
        md += _rows_table(b, entry["rows"])
        entry["paired"] = _paired_rows(entry["rows"], PAIRS)
        md += _paired_md(entry["paired"])
        for row, rr in entry["rows"].items():
            drift = ", ".join(f"{k} {v['first_rounds_mean']:.3g} → {v['last_rounds_mean']:.3g}"
                              for k, v in rr["drift"].items() if v["first_rounds_mean"] is not None and v["last_rounds_mean"] is not None)
            if drift:
                md.append(f"- drift, {row} (mean over seeds, rounds ≤ {b.last} → last {b.last}): {drift}")
            sw = rr.get("sync_where_it_acts") or {}
            if sw:
                md.append(f"- where the sync acts, {row} (mean over cells of the round means; min cell): "
                          + ", ".join(f"{k} {v['mean']:.3g} ({v['min_cell']:.3g})" for k, v in sw.items()))
            pj = rr["projector"]
            if pj and not sw:
                seeded = ("" if "seeded_refreshes" not in pj else
                          f"; seeded-basis refreshes: {pj['seeded_refreshes']} in {pj['client_rounds_with_seeded_basis']} client-rounds"
                          + (" (the seeded phase is never reached: τ exceeds every client-round's local steps, so each "
                             "client-round keeps its first, data-driven basis)" if pj["seeded_refreshes"] == 0 else ""))
                md.append(f"- projector, {row}: {pj['projector']}, τ = {pj['update_proj_gap']}, S = {pj['adaptive_proj_steps']} "
                          f"({pj['adaptive_scope']}); local steps {pj['steps_min']}–{pj['steps_max']} over {pj['client_rounds']} "
                          f"client-rounds → {pj['refreshes_min']}–{pj['refreshes_max']} refreshes per client-round{seeded}")
            if len(rr["mechanism_digests"]) > 1:
                md.append(f"- WARNING {row}: its seeds were made by different FedGaLore sources {rr['mechanism_digests']}")
        if entry["missing"]:
            md += ["", f"Missing cells ({len(entry['missing'])}): " + ", ".join(entry["missing"])]
        md.append("")
        tol = {}
        for row in plan.rows:
            recs = [r for s in b.seeds if (r := load_cell(b, CellSpec(a, row, SIX_ROUND_RATE[row], s)))]
            if recs:
                tol[row] = row_report(b, recs, target)
                every += recs  # a row whose 6-round rate is its choice repeats cells: counted once below
        same = [row for row in tol if SIX_ROUND_RATE[row] == entry["probe"].get(row, {}).get("choice")]
        # a section only when it is not the main table again (some row's 6-round rate is not its choice)
        if len(same) < len(tol):
            entry["tolerance"] = {"rows": tol, "paired": _paired_rows(tol, TOLERANCE_PAIRS)}
            md += ["### At the 6-round rate (`horizon_tolerance`: each row at the rate chosen on 6 rounds, held-out seeds)", "",
                   "Does a row stay robust when its rate was tuned on 6 rounds? The rates: "
                   + ", ".join(f"{row} {rate_tag(SIX_ROUND_RATE[row])}" for row in tol) + "."
                   + (f" For {', '.join(same)} that is also the 50-round choice, so its row repeats the table above."
                      if same else "")]
            md += _rows_table(b, tol) + _paired_md(entry["tolerance"]["paired"])
        if b is EPOCH:
            entry["step_schedule"] = schedule_comparison(a, entry["rows"], target)
            md += _schedule_md(entry["step_schedule"])
        result["alphas"][a] = entry
        _figures(plt, dest, a, entry, target)
    iid = load_cell(b, iid_cell(b), check=False)
    every = list({_cell_id(r): r for r in every}.values())
    problems = pairing_check(every + ([iid] if iid else []))
    result["pairing"] = {"cells": len(every), "problems": problems}
    md.append(f"Pairing: {len(every)} cells; " + ("every cell of an (α, seed) has the same partition and client samples"
                                                   if not problems else "PROBLEMS: " + "; ".join(problems)))
    _write_json(dest / "horizon.json", result)
    (dest / "horizon.md").write_text("\n".join(md) + "\n")
    return result


def schedule_comparison(alpha: str, rows: dict, target: float | None) -> dict:
    """Issue 40 against issue 33 (the step schedule, :data:`FULL`'s committed cells) for the rows of
    :data:`SCHEDULE_ROWS`: each row at its own study's rate, on the held-out seeds where both cells
    ran on the CPU (one device kind per pair), and the paired difference epoch − steps."""
    out = {}
    for row in SCHEDULE_ROWS:
        st = probe_state(FULL, row, alpha)
        if st["choice"] is None or row not in rows:
            continue
        old = [r for s in FULL.seeds if (r := load_cell(FULL, CellSpec(alpha, row, st["choice"], s)))]
        old = [r for r in old if cell_device(r) == "cpu"]
        if not old:
            continue
        new_cpu = {s for s, d in rows[row]["devices"].items() if d == "cpu"}
        rep = row_report(FULL, old, target)
        both = sorted(new_cpu & set(rep["per_seed"]))
        out[row] = {"steps_lr": st["choice"], "epoch_lr": rows[row]["lr"], "seeds": both,
                    "steps": {m: _mean_std([rep["per_seed"][s].get(m) for s in both]) for m in METRICS},
                    "epoch": {m: _mean_std([rows[row]["per_seed"][s].get(m) for s in both]) for m in METRICS},
                    "paired": {m: paired({s: rows[row]["per_seed"][s][m] for s in both if m in rows[row]["per_seed"][s]},
                                         {s: rep["per_seed"][s][m] for s in both if m in rep["per_seed"][s]}) for m in METRICS}}
    return out


def _schedule_md(comp: dict) -> list[str]:
    if not comp:
        return []
    md = ["### The same rows on issue 33's step schedule (its committed cells; CPU seeds only)", "",
          "| row | rates (epoch / steps) | seeds | last 10: epoch | last 10: steps | epoch − steps (95 % t) | worst after 10: epoch − steps |",
          "|---|---|---|---:|---:|---:|---:|"]
    for row, c in comp.items():
        p, w = c["paired"].get("last"), c["paired"].get("worst_after")
        iv = lambda q: "—" if not q or q.get("std") is None else (  # noqa: E731
            f"{100 * q['mean']:+.1f} [{100 * q['t95'][0]:+.1f}, {100 * q['t95'][1]:+.1f}]")
        md.append(f"| {row} | {rate_tag(c['epoch_lr'])} / {rate_tag(c['steps_lr'])} | {c['seeds']} | "
                  f"{_fmt('last', c['epoch']['last'])} | {_fmt('last', c['steps']['last'])} | {iv(p)} | {iv(w)} |")
    return md + [""]


def _cell_id(rec: dict) -> tuple:
    """A cell's identity in the report: (alpha, label, seed)."""
    return rec["alpha"], rec["label"], rec["seed"]


def _cpu_share(rr: dict) -> str:
    """`` (k of n cells)`` where the CPU time is the mean over fewer cells than the wall time's."""
    k, n = rr["cpu_time_cells"], rr["cpu_cells"]
    return f" ({k} of {n} cells)" if 0 < k < n else ""


def _rows_table(b: Budget, rows: dict) -> list[str]:
    """The markdown table of :func:`row_report` entries (mean ± std over seeds per metric), and the
    list of cells that ran on a GPU."""
    md = ["", f"| row | rate | seeds | last {b.last} | at val pick | rounds to 90 % | … and stays | std r ≥ "
          f"{b.stable_from} | worst r > {b.stable_from} | up / down MiB per client-round | min per CPU run (wall / CPU) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, rr in rows.items():
        s = rr["summary"]
        md.append(f"| {row} | {rate_tag(rr['lr'])} | {len(rr['seeds'])} | " + " | ".join(_fmt(m, s[m]) for m in METRICS)
                  + f" | {rr['bytes_up_per_client_round'] / 2**20:.2f} / {rr['bytes_down_per_client_round'] / 2**20:.2f}"
                  f" | {_num(rr['wall_time_min'])} / {_num(rr['cpu_time_min'])}{_cpu_share(rr)} |")
    md.append("")
    if any(rr["cpu_time_cells"] < rr["cpu_cells"] for rr in rows.values()):
        md += ["CPU minutes: the mean over the CPU cells whose every launch was measured (a worker killed with "
               "the machine reports none, and its cell's resumed run is not the whole cost); — where none was.", ""]
    gpu = [f"{row} s{s} ({d})" for row, rr in rows.items() for s, d in rr["devices"].items() if d != "cpu"]
    if gpu:
        md += [f"Cells run on a GPU ({len(gpu)}; same partition, client samples and schedule as on the CPU, "
               f"other floating-point arithmetic and dropout draws; run times above are the CPU cells'): "
               + ", ".join(gpu), ""]
    return md


def _paired_rows(rows: dict, pairs: list[tuple[str, str]]) -> dict:
    """``{"a-b": {metric: paired(...)}}`` for each pair whose rows are both in ``rows``."""
    out = {}
    for x, y in pairs:
        if x in rows and y in rows:
            px, py = rows[x]["per_seed"], rows[y]["per_seed"]
            dx, dy = rows[x].get("devices", {}), rows[y].get("devices", {})
            cross = sorted(s for s in set(dx) & set(dy) if dx[s] != dy[s])
            out[f"{x}-{y}"] = {m: paired({s: v[m] for s, v in px.items() if m in v},
                                         {s: v[m] for s, v in py.items() if m in v}) for m in METRICS}
            for p in out[f"{x}-{y}"].values():
                if p is not None:  # seeds whose two cells ran on different devices (a device effect enters the difference)
                    p["cross_device"] = [s for s in cross if s in p["seeds"]]
    return out


def _paired_md(pairs: dict) -> list[str]:
    md = []
    for name, by_metric in pairs.items():
        shown = {m: p for m, p in by_metric.items() if p is not None and p.get("std") is not None}
        if not shown:  # fewer than 2 seeds in common: no interval to give
            n = max((len(p["seeds"]) for p in by_metric.values() if p), default=0)
            md += [f"Paired {name.replace('-', ' − ')}: {n} seed(s) in common so far, no interval yet.", ""]
            continue
        cross = sorted({s for p in shown.values() for s in p.get("cross_device", [])})
        md += [f"Paired {name.replace('-', ' − ')} (95 % intervals: paired t; bootstrap)"
               + (f"; seed{'s' * (len(cross) > 1)} {', '.join(map(str, cross))} pair{'s' * (len(cross) == 1)} "
                  "a CPU cell with a GPU cell" if cross else "") + ":", ""]
        for m, p in shown.items():
            pts = (lambda v: f"{v:+.1f}") if m.startswith("rounds") else (lambda v: f"{100 * v:+.1f}")
            md.append(f"- {m}: {pts(p['mean'])} [{pts(p['t95'][0])}, {pts(p['t95'][1])}]; "
                      f"[{pts(p['bootstrap95'][0])}, {pts(p['bootstrap95'][1])}] (seeds {p['seeds']}: "
                      + ", ".join(pts(v) for v in p["diff"]) + ")")
        md.append("")
    return md


def _colour(row: str) -> int:
    """A row's matplotlib colour index, the same in every figure (its place in :data:`ROWS`)."""
    return list(ROWS).index(row) % 10 if row in ROWS else 9


def _accuracy_figure(plt, path: Path, rows: dict, title: str, target: float | None) -> None:
    """Test accuracy per round of each row: mean line, ± std band over its seeds."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row, rr in rows.items():
        i = _colour(row)
        c = rr["curve"]
        lo = [100 * (m - s) for m, s in zip(c["test_mean"], c["test_std"])]
        hi = [100 * (m + s) for m, s in zip(c["test_mean"], c["test_std"])]
        ax.plot(c["round"], [100 * m for m in c["test_mean"]], color=f"C{i}", label=f"{row} (lr {rate_tag(rr['lr'])})")
        ax.fill_between(c["round"], lo, hi, color=f"C{i}", alpha=0.15)
    if target is not None:
        ax.axhline(100 * target, color="grey", ls="--", lw=0.8, label="90 % of the IID level")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _figures(plt, dest: Path, alpha: str, entry: dict, target: float | None) -> None:
    """Test accuracy per round (mean ± std band over seeds; the tolerance stage's rows in their own
    figure, ``accuracy_tolerance_<alpha>.png``) and the drift diagnostics per round."""
    rows = entry["rows"]
    if not rows:
        return
    tag, a = _adir(alpha), alpha.split(':')[1]
    _accuracy_figure(plt, dest / f"accuracy_{tag}.png", rows, f"Dirichlet α = {a}: mean ± std over held-out seeds", target)
    if entry.get("tolerance"):
        _accuracy_figure(plt, dest / f"accuracy_tolerance_{tag}.png", entry["tolerance"]["rows"],
                         f"α = {a}, each row at its 6-round rate: mean ± std over held-out seeds", target)
    keys = list(dict.fromkeys(k for rr in rows.values() for k in rr["drift"]))
    if not keys:
        return
    cols = min(3, len(keys))
    fig, axes = plt.subplots(-(-len(keys) // cols), cols, figsize=(4.2 * cols, 3.2 * -(-len(keys) // cols)), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        values = []
        for row, rr in rows.items():
            i = _colour(row)  # one colour per row in every figure
            if key in rr["drift"]:
                ax.plot(rr["drift"][key]["round"], rr["drift"][key]["mean"], color=f"C{i}", label=row)
                values += [v for v in rr["drift"][key]["mean"] if v is not None and v > 0]
        if values and max(values) / min(values) > 100:  # e.g. v_warm_cold_ratio spans decades
            ax.set_yscale("log")
            key += " (log scale)"
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=8, ncol=len(handles))
    fig.suptitle(f"Drift diagnostics, Dirichlet α = {alpha.split(':')[1]} (mean over held-out seeds)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(dest / f"drift_{tag}.png", dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- CLI
def _alphas(text: str) -> list[str]:
    out = []
    for x in text.split(","):
        try:
            a = float(x)
        except ValueError:
            raise SystemExit(f"--alphas takes Dirichlet concentrations like 0.1,0.3; got {x!r}") from None
        if not a > 0:
            raise SystemExit(f"--alphas: {x} must be > 0")
        out.append(f"dirichlet:{a:g}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["horizon_probe", "horizon_seeds", "horizon_tolerance", "horizon_report"])
    ap.add_argument("--study", choices=sorted(STUDIES), default="horizon",
                    help="horizon: issue 33's study (steps schedule, results/horizon); epoch: issue 40's, with the epoch "
                         "schedule (results/horizon_epoch)")
    ap.add_argument("--rows", help=f"comma-separated rows (default: {','.join(MUST_ROWS)}; --study epoch: "
                                   f"{','.join(EPOCH_ROWS)}; report: every row with results)")
    ap.add_argument("--alphas", help="comma-separated Dirichlet alphas (default: 0.1,0.3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", help="horizon_seeds, horizon_tolerance: comma-separated held-out seeds to run, in this order "
                                     "(default: 1,2,3,4), e.g. to split them between machines")
    ap.add_argument("--device", help="run the workers on this device, e.g. cuda (default: the config's, cpu); "
                                      "a cell is the same cell on any device, and the report names each cell's")
    ap.add_argument("--dry-run", action="store_true", help="list the cells the stage would run, run nothing")
    ap.add_argument("--quick", action="store_true", help="the tiny budget (tiny_text, 4 rounds, 2 rows, 1 alpha, 2 seeds)")
    ap.add_argument("--root", type=Path, help="--quick only: write runs and results under this folder "
                                               "(default benchmarks/runs/horizon_quick)")
    a = ap.parse_args(argv)
    if a.root is not None and not a.quick:
        raise SystemExit("--root is for --quick runs only (the study writes to benchmarks/runs|results/horizon)")
    budget = quick_budget((a.root or ROOT / "benchmarks" / "runs" / "horizon_quick").resolve()) if a.quick else STUDIES[a.study]
    if a.rows:
        rows = a.rows.split(",")
        bad = [r for r in rows if r not in ROWS]
        if bad:
            raise SystemExit(f"unknown row {bad[0]!r}; rows: {', '.join(ROWS)}")
    else:
        rows = list(QUICK_ROWS if a.quick else TOLERANCE_ROWS if a.stage == "horizon_tolerance"
                    else EPOCH_ROWS if budget is EPOCH else MUST_ROWS if a.stage != "horizon_report" else ROWS)
    alphas = _alphas(a.alphas) if a.alphas else list(QUICK_ALPHAS if a.quick else [ALPHA_01] if a.stage == "horizon_tolerance"
                                                     else [ALPHA_01, "dirichlet:0.3"])
    if a.workers < 1:
        raise SystemExit("--workers must be >= 1")
    seeds = None
    if a.seeds:
        try:
            seeds = tuple(int(x) for x in a.seeds.split(","))
        except ValueError:
            raise SystemExit(f"--seeds takes integers like 3,4; got {a.seeds!r}") from None
        bad = [x for x in seeds if x not in budget.seeds]
        if bad:
            raise SystemExit(f"--seeds: {bad[0]} is not a held-out seed of this budget ({','.join(map(str, budget.seeds))})")
    from fedgalore.job.config import device_error

    if a.device and (why := device_error(a.device)):
        raise SystemExit(f"--device {a.device!r} {why}")
    plan = Plan(budget, rows, alphas, a.workers, a.dry_run, seeds, a.device)
    if a.stage == "horizon_report":
        report(plan)
        print(f"wrote {budget.results / 'horizon.md'}")
        return 0
    failed = {"horizon_probe": stage_probe, "horizon_seeds": stage_seeds, "horizon_tolerance": stage_tolerance}[a.stage](plan)
    if failed:
        print(f"not finished: {', '.join(failed)}; run the stage again to continue", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
