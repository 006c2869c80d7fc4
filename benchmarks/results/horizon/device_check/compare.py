"""Device check for issue 33 B: each CPU twin here against the study's GPU cell, and FedGaLore (and
paper mode) - FedGaLore-minus at alpha 0.1 with every cell on the CPU (the GPU minus cells of seeds
2-4 replaced by their twins). From the repo root: ``.venv/bin/python benchmarks/results/horizon/device_check/compare.py``"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # benchmarks/
import horizon as h  # noqa: E402

CELLS = h.FULL.results / "cells"
TARGET = 0.9 * h.iid_level(h.FULL)


def metrics(path: Path) -> dict:
    return {k: 100 * v for k, v in h.cell_metrics(json.loads(path.read_text()), h.FULL, TARGET).items()
            if k in ("last", "worst_after", "std_after")}


def cell(adir: str, label: str, seed: int, cpu: bool) -> Path:
    twin = HERE / f"{adir}-{label}-s{seed}-cpu.json"
    return twin if cpu and twin.is_file() else CELLS / adir / f"{label}-s{seed}.json"


print("twin: GPU cell / CPU twin (same clients and local steps every round)")
for twin in sorted(HERE.glob("*-cpu.json")):
    adir, rest = twin.name[:-len("-cpu.json")].split("-", 1)
    gpu = CELLS / adir / f"{rest}.json"
    g, c = json.loads(gpu.read_text()), json.loads(twin.read_text())
    same = all(a["clients"] == b["clients"] and a["steps"] == b["steps"] for a, b in zip(g["rounds"], c["rounds"]))
    gap = max(abs(a["test"]["accuracy"] - b["test"]["accuracy"]) for a, b in zip(g["rounds"], c["rounds"]) if "test" in a)
    mg, mc = metrics(gpu), metrics(twin)
    print(f"  {adir}/{rest}: same schedule {same}; " + "; ".join(f"{k} {mg[k]:.1f} / {mc[k]:.1f}" for k in mg)
          + f"; largest per-round gap {100 * gap:.1f} points")
for x in ("fedgalore_lr3e-3", "fedgalore_paper_lr3e-3"):
    a = {s: metrics(cell("a0.1", x, s, False)) for s in (1, 2, 3, 4)}
    b = {s: metrics(cell("a0.1", "fedgalore_minus_lr3e-3", s, True)) for s in (1, 2, 3, 4)}
    for k in ("last", "worst_after", "std_after"):
        p = h.paired({s: v[k] for s, v in a.items()}, {s: v[k] for s, v in b.items()})
        print(f"all CPU, a0.1, {x} - fedgalore_minus_lr3e-3, {k}: {p['mean']:+.1f} [{p['t95'][0]:+.1f}, {p['t95'][1]:+.1f}] "
              "(seeds 1-4: " + ", ".join(f"{d:+.1f}" for d in p["diff"]) + ")")
