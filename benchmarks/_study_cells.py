"""What the staged study drivers share: one run per cell, resumed from its committed JSON, sharded
over processes, and paired intervals over seeds (not a benchmark itself: ``fedgalore bench``
lists no file whose name starts with ``_``).

A cell is one ``fedgalore.run`` of a config dict. Its JSON (``path``) holds ``version``, the
config it ran and what the study's ``summarize`` took from the result; :func:`run_cell` returns it
without running when it is there with the same version and config, so a driver resumes from the
repository (commit the cells, never the run directories). A run that diverges
(``FloatingPointError``, ``RuntimeError``) is a result too: its cell records the error.

What a cell ran on: ``inputs`` — the run identity's fingerprints of the model and data files the
task read (:func:`fedgalore.records.identity.run_identity`; label → ``kind``, ``sha256`` and, for a
small folder, ``listing``: file → short sha256), without the machine's paths; and ``backbone`` —
``{"label", "weights_sha256", "numerics"}``, the sha256 of the ``model.safetensors`` the task
fine-tuned (its ``pretrain.json``'s ``numerics`` for the offline tiny ViT). The weights hash, not
the folder's, names the backbone: the folder also holds ``pretrain.json`` with its build's
timings. :func:`check_one_backbone` refuses a study whose cells ran on two backbones; a study's
``report`` calls it over its cells (:func:`load_cells`), and :func:`run_cell` over the cells
beside a cell it has just written, so a resumed stage stops at its first cell on another
backbone. Cells written before this was recorded have no ``backbone``: a study whose cells all
lack it is accepted as it was (its backbone is unknown, as the historical studies' is); one that
mixes such cells with recorded ones is refused, since nothing says the backbones agree.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_cell", "shard", "t975", "paired", "machine", "inputs_of", "check_one_backbone", "load_cells",
           "BackboneMismatch"]


def machine() -> dict[str, Any]:
    """The CPU, torch's thread count and the 1-minute load: recorded beside every timing."""
    import torch

    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "loadavg_1m": os.getloadavg()[0]}


class BackboneMismatch(RuntimeError):
    """A study's cells ran on two backbones (or some on an unrecorded one): :func:`check_one_backbone`."""


def inputs_of(cfg) -> tuple[dict[str, dict], dict | None]:
    """``(inputs, backbone)`` of the run ``cfg`` (a ``FederatedConfig``): the run identity's input
    fingerprints without their paths, and the weights hash of the one input folder that holds a
    ``model.safetensors`` (``None`` when none does) with its ``pretrain.json``'s ``numerics``."""
    from fedgalore.records.identity import run_identity
    from fedgalore.tasks.pretrain_vit import weights_sha256

    inputs, backbone = {}, None
    for label, fp in (run_identity(cfg).inputs or {}).items():
        inputs[label] = {k: v for k, v in fp.items() if k != "path"}
        folder = Path(fp["path"])
        if fp.get("kind") == "folder" and (folder / "model.safetensors").is_file():
            if backbone is not None:
                raise BackboneMismatch(f"the run reads two model folders ({backbone['label']}, {label}): which is the backbone is not defined")
            meta = folder / "pretrain.json"
            numerics = json.loads(meta.read_text()).get("numerics") if meta.is_file() else None
            backbone = {"label": label, "weights_sha256": weights_sha256(folder), "numerics": numerics}
    return inputs, backbone


def load_cells(paths) -> dict[str, dict]:
    """The cell JSONs at ``paths`` (a folder: its ``*.json``), by file stem, sorted."""
    paths = sorted(Path(paths).glob("*.json")) if isinstance(paths, (str, Path)) else sorted(Path(p) for p in paths)
    return {p.stem: json.loads(p.read_text()) for p in paths}


def check_one_backbone(cells) -> str | None:
    """The one ``weights_sha256`` the ``cells`` (name → cell, or what :func:`load_cells` takes) ran
    on, ``None`` when none recorded one (cells from before it was recorded; module doc). A
    :class:`BackboneMismatch` naming two cells when they ran on different backbones, or when some
    recorded one and some did not. Cells that failed (``error``) count like the others."""
    if not isinstance(cells, dict):
        cells = load_cells(cells)
    known = {n: (c.get("backbone") or {}).get("weights_sha256") for n, c in cells.items()}
    first = {}
    for name, h in known.items():
        first.setdefault(h, name)
    if len(first) <= 1:
        return next(iter(first), None)
    hashes = list(first)
    a, b = hashes[0], hashes[1]
    if None in (a, b):
        unknown, recorded = (first[a], first[b]) if a is None else (first[b], first[a])
        raise BackboneMismatch(f"cells {unknown} (backbone not recorded: run before backbones were) and {recorded} "
                               f"(backbone {known[recorded][:12]}) may differ in backbone; re-run the older cells or keep the study apart")
    raise BackboneMismatch(f"cells {first[a]} and {first[b]} ran on different backbones ({a[:12]} vs {b[:12]}); "
                           "a study's cells must share one: re-run the cells of one of them")


def run_cell(path: Path, cfg_d: dict, base: dict, run_dir: Path,
             summarize: Callable[[Any, float, float], dict], version: int, *, flush_denormal: bool = True) -> dict:
    """Run the config ``cfg_d`` (single-threaded, run directory ``run_dir``, replaced) and write
    ``{version, config, **base, **summarize(result, wall_s, cpu_s)}`` to ``path``; or return the
    JSON already at ``path`` when its ``version`` and ``config`` are these. ``flush_denormal``:
    ``torch.set_flush_denormal(True)`` first (tiny gradients as denormals triple a CPU backward;
    a study whose committed cells ran without it keeps it off, so new cells are comparable)."""
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("version") == version and old.get("config") == cfg_d:
            return old
    import torch

    import fedgalore
    from fedgalore.job.config import FederatedConfig

    torch.set_num_threads(1)
    if flush_denormal:
        torch.set_flush_denormal(True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = FederatedConfig.from_dict({**cfg_d, "output": {**cfg_d.get("output", {}), "dir": str(run_dir)}})
    head = {"version": version, "config": cfg_d, **base}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = fedgalore.run(cfg)
    except (FloatingPointError, RuntimeError) as exc:  # a rate that diverges is a result
        cell = {**head, "error": f"{type(exc).__name__}: {exc}"[:500], "rounds": [], "test_last": float("nan"),
                "val_last": float("nan"), "wall_s": time.perf_counter() - t0}
        _write(path, cell, cfg)
        print(f"failed {path.stem}: {cell['error']}", flush=True)
        return cell
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cell = {**head, **summarize(res, wall, cpu), "wall_s": wall, "cpu_s": cpu, "machine": machine()}
    _write(path, cell, cfg)
    print(f"done {path.stem}: test {cell.get('test_last', float('nan')):.3f} val {cell.get('val_last', float('nan')):.3f} "
          f"({wall:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return cell


def _write(path: Path, cell: dict, cfg) -> None:
    """Write ``cell`` with what it ran on (``inputs``, ``backbone``: module doc), then check that the
    cells beside it share its backbone (:func:`check_one_backbone`)."""
    cell["inputs"], cell["backbone"] = inputs_of(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell, indent=1))
    check_one_backbone(path.parent.glob("*.json"))


def shard(cells: list, spec: str | None) -> list:
    """``spec`` ``"i/n"``: every n-th cell from the i-th (two processes share a stage); None: all."""
    if not spec:
        return cells
    i, n = (int(x) for x in spec.split("/"))
    return cells[i::n]


def t975(n: int) -> float:
    """Student's t quantile 0.975 with n − 1 degrees of freedom (NaN for n < 2)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1)) if n > 1 else float("nan")


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of the paired differences ``a − b`` with its 95 % t interval, mean ± t₀.₉₇₅ · sd / √n."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = statistics.fmean(d) if d else float("nan")
    half = t975(n) * statistics.stdev(d) / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "lo": mean - half, "hi": mean + half, "diffs": d}
