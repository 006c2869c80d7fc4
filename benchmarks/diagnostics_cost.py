"""What the default diagnostics cost in a round: MiniLM text and SmolLM2 causal LM.

For each task — ``offline_text`` (MiniLM-L6 × BBC News, ``conf/pipeline/offline_text.yaml``) and
``offline_math`` (SmolLM2-135M, ``conf/pipeline/offline_math.yaml``), both with FedGaLore as
shipped — one process runs round 1 of the pipeline three ways, interleaved, ``--reps`` times:

* ``off``: ``diagnostics: false``;
* ``exact``: ``diagnostics_exact: true`` — every matrix's tail energy by a full SVD (the behaviour
  before the randomized estimate, fedgalore.federated.diagnostics);
* ``default``: the shipped default (exact for small matrices, the randomized top-r estimate for
  large ones).

Reported per variant: ``time_diagnostics / time_round`` (the loop's own split) and the whole
overhead ``(time_round − time_round[off]) / time_round`` — what diagnostics cost anywhere in the
round (the clients' shadow moments and the dense deltas included). Round 1 only, stopped before
round 2; evaluation is not part of round 1 here (``eval_every: 2``), since it is not diagnostics.
Single-threaded (``torch.set_num_threads(1)``); the load average is recorded next to every timing.
Writes ``benchmarks/results/diagnostics_cost.json``. ``--quick``: MiniLM only, one rep.
"""
# fedgalore-bench: not-in-all (about 10 min single-threaded; run it by name)
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "diagnostics_cost.json"
TASKS = {"offline_text": ROOT / "conf" / "pipeline" / "offline_text.yaml",
         "offline_math": ROOT / "conf" / "pipeline" / "offline_math.yaml"}
VARIANTS = {"off": {"diagnostics": False}, "exact": {"diagnostics_exact": True}, "default": {}}


class _StopAfterFirstRound(Exception):
    pass


def _round_one(task: str, variant: str, out: Path) -> dict:
    """Round 1 of ``task``'s pipeline under ``variant``: the loop's time split."""
    import fedgalore
    from fedgalore.job.config import load_config
    from fedgalore.engine.events import ProgressSink

    cfg = load_config(TASKS[task])
    cfg.federation.rounds, cfg.federation.eval_every = 2, 2
    cfg.output.dir, cfg.output.progress = str(out), "quiet"
    for k, v in VARIANTS[variant].items():
        setattr(cfg, k, v)
    got: dict = {}

    class Stop(ProgressSink):
        def round_end(self, round, record):
            got.update(record)
            raise KeyboardInterrupt("benchmark: round 1 measured")

    try:
        fedgalore.run(cfg, progress=Stop())
    except KeyboardInterrupt:
        pass
    keys = ("time_round", "time_clients", "time_server", "time_diagnostics", "time_eval")
    return {k: float(got.get(k, 0.0)) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", default=",".join(TASKS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tasks = ["offline_text"] if args.quick else [t for t in args.tasks.split(",") if t]
    reps = 1 if args.quick else args.reps
    runs: dict = {t: {v: [] for v in VARIANTS} for t in tasks}
    with tempfile.TemporaryDirectory() as tmp:
        for t in tasks:
            for rep in range(reps):
                for v in VARIANTS:  # interleaved
                    rec = _round_one(t, v, Path(tmp) / f"{t}-{v}-{rep}")
                    rec["load_avg"] = os.getloadavg()[0]
                    runs[t][v].append(rec)
                    print(f"{t} {v} rep {rep}: round {rec['time_round']:.1f} s, diagnostics {rec['time_diagnostics']:.2f} s "
                          f"(load {rec['load_avg']:.2f})", flush=True)
    summary = {}
    for t in tasks:
        med = {v: {k: statistics.median(r[k] for r in runs[t][v]) for k in ("time_round", "time_diagnostics")} for v in VARIANTS}
        off = med["off"]["time_round"]
        summary[t] = {v: {"time_round_s": med[v]["time_round"], "time_diagnostics_s": med[v]["time_diagnostics"],
                          "diagnostics_share": med[v]["time_diagnostics"] / med[v]["time_round"],
                          "overhead_vs_off": (med[v]["time_round"] - off) / med[v]["time_round"]} for v in VARIANTS}
        for v in VARIANTS:
            s = summary[t][v]
            print(f"{t:13s} {v:8s} round {s['time_round_s']:7.2f} s  diagnostics {s['time_diagnostics_s']:6.2f} s "
                  f"({100 * s['diagnostics_share']:.1f} % of the round; whole overhead vs off {100 * s['overhead_vs_off']:+.1f} %)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "threads": 1, "reps": reps, "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
