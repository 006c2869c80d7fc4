"""What the staged study drivers share: one run per cell, resumed from its committed JSON, sharded
over processes, and paired intervals over seeds (not a benchmark itself: ``fedgalore bench``
lists no file whose name starts with ``_``).

A cell is one ``fedgalore.run`` of a config dict. Its JSON (``path``) holds ``version``, the
config it ran and what the study's ``summarize`` took from the result; :func:`run_cell` returns it
without running when it is there with the same version and config, so a driver resumes from the
repository (commit the cells, never the run directories). A run that diverges
(``FloatingPointError``, ``RuntimeError``) is a result too: its cell records the error.
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

__all__ = ["run_cell", "shard", "t975", "paired", "machine"]


def machine() -> dict[str, Any]:
    """The CPU, torch's thread count and the 1-minute load: recorded beside every timing."""
    import torch

    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "loadavg_1m": os.getloadavg()[0]}


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
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cell, indent=1))
        print(f"failed {path.stem}: {cell['error']}", flush=True)
        return cell
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cell = {**head, **summarize(res, wall, cpu), "wall_s": wall, "cpu_s": cpu, "machine": machine()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell, indent=1))
    print(f"done {path.stem}: test {cell.get('test_last', float('nan')):.3f} val {cell.get('val_last', float('nan')):.3f} "
          f"({wall:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return cell


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
