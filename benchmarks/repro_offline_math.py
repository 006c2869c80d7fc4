"""Issue-8 comparison on the offline math task (Table 4 / MetaMathQA -> GSM8K at our scale).

Usage (from anywhere; the driver works from the repo root and skips cells that already finished)::

    python benchmarks/repro_offline_math.py main     # 4 methods x {Dir 0.5, IID} x seed 0
    options: --workers N (parallel single-threaded worker processes, default 2)

Budget: ``conf/pipeline/offline_math.yaml`` (SmolLM2-135M-Instruct on reasoning-gym gsm_symbolic
word problems, 4 clients, full participation, R = 4 rounds x 6 local steps of batch 4, rank 8 on
every attention and MLP matrix) evaluated once, after the last round, by greedy generation on 30
held-out problems (exact match of the final number) and by the response-token loss on them.
Every method runs at the paper's shared NLG rate 1e-4: one run takes 14–17 min on one core, so there
is no learning-rate probe and one seed; the table is a small-sample check, not a ranking.

This is the command the driver runs (two such processes share the cells), so a user can run or
extend it by hand::

    fedgalore compare --config conf/pipeline/offline_math.yaml \\
        --methods fedgalore,fedgalore_minus,fedit,fedavg_full --settings dirichlet:0.5,iid --seeds 0 \\
        --out benchmarks/runs/repro_math --progress plain \\
        task.options.n_test=30 federation.eval_every=4 output.checkpoint_every=2

Runs go to ``benchmarks/runs/repro_math/`` (ignored; the path is relative to the repo root, as the
cells' configs record it), the report to ``benchmarks/results/repro_math/``.
"""
# fedgalore-bench: not-in-all (a long study; run it by name)
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from repro_offline_text import ROOT, Study, _run_stage

METHODS = ["fedgalore", "fedgalore_minus", "fedit", "fedavg_full"]
SETTINGS = ["dirichlet:0.5", "iid"]
OVERRIDES = ("task.options.n_test=30", "federation.eval_every=4", "output.checkpoint_every=2")
OUT = Path("benchmarks/runs/repro_math")  # relative to ROOT

MATH = Study(
    "math",
    ROOT / "conf" / "pipeline" / "offline_math.yaml",
    ROOT / "benchmarks" / "runs",
    ROOT / "benchmarks" / "results",  # the report lands in results/<out.name> = results/repro_math
    lrs={},
    seeds=(0,),
    settings=tuple(SETTINGS),
)


def stage_main(workers: int) -> None:
    os.chdir(ROOT)  # cells record output.dir relative to the working directory
    _run_stage(OUT, METHODS, SETTINGS, list(MATH.seeds), {}, workers, overrides=OVERRIDES, study=MATH)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["main"])
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    print("== stage main", flush=True)
    stage_main(a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
