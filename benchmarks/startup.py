"""What a command costs before it does anything: ``fedgalore --help``, ``fedgalore methods``, the
time to a tiny run's first round, and ``evaluate`` / ``export`` / ``predict`` of a small finished run.

Every figure is the wall time of a fresh ``python -m fedgalore.cli ...`` process (start-up and
imports included: that is what a user waits for), single-threaded (``OMP_NUM_THREADS=1``), with the
load average (``uptime``'s three numbers) measured just before it. The time to the first round is
taken from the parent's clock at the start of the process to the child's clock when the round loop
announces round 1 (``round_start``; the child then exits), for two runs:

* ``first_round_tiny``: the test suite's tiny pipeline (``tiny_text``: a random-weight BERT of
  ``transformers``' class, 16 wide, 1 layer; 3 clients);
* ``first_round_image``: the data guide's image example (docs/data.md, "Image classification":
  600 Fashion-MNIST test images in class folders, the offline tiny ViT, 5 clients).

``evaluate``, ``export`` and ``predict`` (20 images) run on a finished one-round run of that image
example (~0.2 M parameters), made once per variant before the timings.

``floor_imports`` is what none of these can avoid: a process that only imports torch, transformers'
ViT and BERT classes and peft (``transformers`` itself pulls in SciPy and ``torch.distributed.tensor``).

``--before SRC`` adds a second variant, another source tree (e.g. ``/work/main/src``: the code
before a change), interleaved with this tree's rep by rep, so both see the same load. Writes
``benchmarks/results/startup.json``.
"""
# fedgalore-bench: not-in-all (about 5 min per variant with 3 reps; run it by name)
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "startup.json"
TINY = """\
name: tiny
seed: 0
task: {{name: tiny_text, options: {{n_train: 48, n_test: 16, hidden_size: 16, num_layers: 1, seq_len: 8}}}}
method: {{name: fedgalore, rank: 4, options: {{}}}}
federation: {{num_clients: 3, clients_per_round: 2, rounds: 2, eval_every: 1,
             partition: {{kind: dirichlet, alpha: 0.5, min_size: 2}}}}
train: {{lr: 1.0e-3, batch_size: 16, local_steps: 2}}
output: {{dir: {out}, progress: quiet}}
"""
IMAGE = """\
name: clothes
task:
  name: image_classification
  options: {{data: {data}, new_head: true}}
method: {{name: fedgalore, rank: 8}}
federation:
  num_clients: 5
  rounds: {rounds}
  partition: {{kind: dirichlet, alpha: 0.5}}
train: {{lr: 1.0e-3, batch_size: 32, local_steps: 10}}
output: {{dir: {out}, progress: quiet}}
"""
#: the child that times the first round: patches the round loop's progress tracker before the CLI runs
PROBE = """\
import os, sys, time
from fedgalore.engine import events

def _first(self, round, clients):
    with open(sys.argv[1], "w") as fh:
        fh.write(repr(time.time()))
    os._exit(0)

events.TrackingProgress.round_start = _first
from fedgalore.cli import main
sys.exit(main(sys.argv[2:]))
"""
FLOOR = "import torch, peft\nfrom transformers import BertForSequenceClassification, ViTForImageClassification\n"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _wall(src: Path, args: list[str], cwd: Path) -> dict:
    """One ``python -m fedgalore.cli ARGS`` process: its wall seconds and the load before it."""
    load = _load()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fedgalore.cli", *args], cwd=cwd, env=_env(src),
                          capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"fedgalore {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"s": round(dt, 3), "load": load}


def _floor(cwd: Path) -> dict:
    """A process that imports only what a run of a ``transformers`` model needs in any case."""
    load = _load()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], cwd=cwd, env=_env(ROOT / "src"), check=True)
    return {"s": round(time.perf_counter() - t0, 3), "load": load}


def _first_round(src: Path, config: Path, cwd: Path) -> dict:
    """Seconds from the process's start to round 1 starting (the child exits there)."""
    stamp = cwd / "first_round.txt"
    stamp.unlink(missing_ok=True)
    for runs in cwd.glob("runs-probe*"):
        shutil.rmtree(runs)
    load = _load()
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", PROBE, str(stamp), "run", "--config", str(config),
                           f"output.dir={cwd / 'runs-probe'}"], cwd=cwd, env=_env(src), capture_output=True, text=True)
    if not stamp.is_file():
        raise SystemExit(f"the run of {config.name} never reached round 1 ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"s": round(float(stamp.read_text()) - t0, 3), "load": load}


def _images(folder: Path, per_class: int = 60) -> None:
    """docs/data.md's image example: ``per_class`` Fashion-MNIST test images per class folder."""
    from PIL import Image

    from fedgalore.tasks.mnist import FASHION_MNIST_CLASSES, load_fashion_mnist

    x, y = load_fashion_mnist("test")
    for c, name in enumerate(FASHION_MNIST_CLASSES):
        sub = folder / name.replace("/", "-").replace(" ", "_")
        sub.mkdir(parents=True, exist_ok=True)
        for k, i in enumerate([j for j in range(len(y)) if y[j] == c][:per_class]):
            Image.fromarray(x[i]).save(sub / f"{k:03d}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", metavar="SRC", help="another source tree to time too, interleaved (e.g. /work/main/src)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    variants = {"after": ROOT / "src"} | ({"before": Path(args.before).resolve()} if args.before else {})
    t_start, load0 = time.perf_counter(), _load()
    res: dict = {name: {} for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _images(tmp / "clothes")
        (tmp / "new.csv").write_text("image\n" + "".join(f"{p}\n" for p in sorted((tmp / "clothes" / "Bag").glob("*.png"))[:20]))
        (tmp / "tiny.yaml").write_text(TINY.format(out=tmp / "runs-tiny"))
        (tmp / "image.yaml").write_text(IMAGE.format(data=tmp / "clothes", rounds=3, out=tmp / "runs-image"))
        finished = {}
        for name, src in variants.items():  # a finished one-round run per variant, made by its own code
            (tmp / f"done-{name}.yaml").write_text(IMAGE.format(data=tmp / "clothes", rounds=1, out=tmp / f"done-{name}"))
            res[name]["make_run"] = _wall(src, ["run", "--config", str(tmp / f"done-{name}.yaml")], tmp)
            finished[name] = next((tmp / f"done-{name}").iterdir())
        for rep in range(args.reps):
            for name, src in variants.items():
                run = str(finished[name])
                out = res[name]
                for key, cmd in (("help", ["--help"]), ("methods", ["methods"])):
                    out.setdefault(key, []).append(_wall(src, cmd, tmp))
                out.setdefault("floor_imports", []).append(_floor(tmp))
                out.setdefault("first_round_tiny", []).append(_first_round(src, tmp / "tiny.yaml", tmp))
                out.setdefault("first_round_image", []).append(_first_round(src, tmp / "image.yaml", tmp))
                out.setdefault("evaluate", []).append(_wall(src, ["evaluate", run], tmp))
                out.setdefault("export", []).append(_wall(src, ["export", run, "--out", str(tmp / "exported"), "--force"], tmp))
                out.setdefault("predict", []).append(_wall(src, ["predict", run, "--data", str(tmp / "new.csv"),
                                                                 "--out", str(tmp / "pred.csv"), "--force"], tmp))
                print(f"rep {rep} {name}: " + ", ".join(f"{k} {v[-1]['s']:.2f}s" for k, v in out.items() if isinstance(v, list))
                      + f" (load {_load()[0]})", flush=True)
    summary = {name: {k: {"median_s": round(statistics.median(m["s"] for m in v), 2),
                          "min_s": round(min(m["s"] for m in v), 2)} for k, v in out.items() if isinstance(v, list)}
               for name, out in res.items()}
    import torch

    meta = {"python": platform.python_version(), "torch": torch.__version__, "omp_num_threads": "1",
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "reps": args.reps,
            "variants": {k: str(v) for k, v in variants.items()}, "loadavg_start": load0, "loadavg_end": _load(),
            "seconds": round(time.perf_counter() - t_start, 1)}
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "runs": res}, indent=1) + "\n")
    for name, rows in summary.items():
        print(f"{name}: " + ", ".join(f"{k} {v['median_s']:.2f}s" for k, v in rows.items()))
    print(f"load average {load0} -> {_load()}; written to {args.out}")


if __name__ == "__main__":
    main()
