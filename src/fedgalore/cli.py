"""The ``fedgalore`` command: run, status, compare, tune, partition, plan, report, export, evaluate, predict, ledger, bench, repro, methods, tasks.

See ``docs/cli.md`` for every command with examples. User errors (unknown method / task / config
key, a value of the wrong type or out of range, a missing file or asset) print one line on
stderr and exit with status 2; ``--debug`` adds the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import pkgutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2
#: a run stopped because a round failed (too few valid uploads after its retries; its checkpoint is kept)
EXIT_ROUND_FAILED = 3
_COMPARE_KEYS = ("methods", "settings", "seeds", "method_options", "out")


# ----------------------------------------------------------------------------- errors
def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the user asked for something wrong" (ValueError subclasses
    raised by the library with a message that says how to fix it)."""
    from fedgalore.job.config import ConfigError
    from fedgalore.federated.partition import PartitionError
    from fedgalore.methods.base import MethodError
    from fedgalore.report import ReportError
    from fedgalore.tasks.base import TaskError

    # TaskError covers fedgalore.tasks.assets.AssetError (a missing offline asset)
    return (ConfigError, TaskError, MethodError, PartitionError, ReportError, FileNotFoundError, NotADirectoryError)


def _one_line(exc: BaseException) -> str:
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text or type(exc).__name__


# ----------------------------------------------------------------------------- config loading
def _load_config(path: str | None, overrides: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """``load_config`` plus an optional top-level ``compare:`` section (returned separately).

    ``compare.*`` overrides go to that section; everything else to the FederatedConfig.
    """
    from omegaconf import OmegaConf

    from fedgalore.job.config import ConfigError, load_config

    cmp_over = [o for o in overrides if o.split("=", 1)[0].strip().startswith("compare.")]
    cfg_over = [o for o in overrides if o not in cmp_over]
    section: dict[str, Any] = {}
    if path is not None and Path(path).is_file():
        try:
            raw = OmegaConf.load(path)
        except Exception:  # invalid YAML: load_config below reports it
            raw = None
        if raw is not None and OmegaConf.is_dict(raw) and "compare" in raw:
            section = OmegaConf.to_container(raw.compare, resolve=True) or {}
            rest = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "compare"])
            with tempfile.TemporaryDirectory() as tmp:
                stripped = Path(tmp) / Path(path).name
                stripped.write_text(OmegaConf.to_yaml(rest))
                cfg = load_config(stripped, cfg_over)
        else:
            cfg = load_config(path, cfg_over)
    else:
        cfg = load_config(path, cfg_over)
    if cmp_over:
        try:
            merged = OmegaConf.merge(OmegaConf.create({"compare": section}), OmegaConf.from_dotlist(cmp_over))
        except Exception as exc:
            raise ConfigError(f"bad compare override: {str(exc).splitlines()[0]}") from None
        section = OmegaConf.to_container(merged, resolve=True)["compare"] or {}
    if not isinstance(section, dict):
        raise ConfigError("the compare: section must be a mapping (keys: " + ", ".join(_COMPARE_KEYS) + ")")
    unknown = sorted(set(section) - set(_COMPARE_KEYS))
    if unknown:
        raise ConfigError(f"unknown config key compare.{unknown[0]}; valid keys here: {', '.join(_COMPARE_KEYS)}")
    return cfg, section


def _split_list(value: Any, what: str) -> list[str]:
    from fedgalore.job.config import ConfigError

    if value is None:
        return []
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        raise ConfigError(f"{what} must be a comma-separated list, got {value!r}")
    if any(not v for v in items):
        raise ConfigError(f"{what} has an empty entry: {value!r}")
    return items


def _parse_seeds(value: Any) -> list[int]:
    from fedgalore.job.config import ConfigError

    out = []
    for v in _split_list(value, "--seeds"):
        try:
            out.append(int(v))
        except ValueError:
            raise ConfigError(f"--seeds must be comma-separated integers (e.g. 0,1,2), got {v!r}") from None
    return out


def _read_method_options(path: str) -> dict[str, dict[str, Any]]:
    from omegaconf import OmegaConf

    from fedgalore.job.config import ConfigError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--method-options file {str(p)!r} not found (a YAML/JSON mapping: method -> options)")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    except Exception as exc:
        raise ConfigError(f"--method-options file {p} is not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
    return _check_method_options(data, str(p))


def _check_method_options(data: Any, where: str) -> dict[str, dict[str, Any]]:
    from fedgalore.job.config import ConfigError

    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"{where} must map method names to option mappings, e.g. {{fedit: {{lora_alpha: 16}}}}")
    return {str(k): dict(v or {}) for k, v in data.items()}


# ----------------------------------------------------------------------------- commands
def _progress(mode: str | None, cfg: Any) -> Any:
    from fedgalore.progress import make_progress

    return make_progress(mode or (cfg.output.progress if cfg is not None else "auto"))


def _fmt_metrics(final: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in final.items())


def _resume_rounds(overrides: Sequence[str]) -> int | None:
    """``federation.rounds=N`` is the one override ``--resume`` takes (extending a run)."""
    from fedgalore.job.config import ConfigError

    rounds = None
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key.strip() != "federation.rounds":
            raise ConfigError(f"--resume continues a run with its saved config.yaml; the only override it takes is "
                              f"federation.rounds=N (to extend the run); drop {ov!r}")
        try:
            rounds = int(value)
        except ValueError:
            raise ConfigError(f"federation.rounds must be an integer, got {value!r}") from None
    return rounds


def _saved_task(run_dir: Path) -> tuple[str, dict[str, Any]]:
    from omegaconf import OmegaConf

    try:
        task = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").task, resolve=True)
        return str(task["name"]), dict(task.get("options") or {})
    except Exception:  # noqa: BLE001 - the resume itself reports an unreadable config
        return "", {}


def _hub_note(task: str, options: dict[str, Any] | None = None) -> None:
    """Offline unless the task needs the hub and it answers (fedgalore.hub); say so when it does not."""
    from fedgalore.hub import prepare_hub

    note = prepare_hub(task, options=options)
    if note:
        print(f"fedgalore: {note}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    """``fedgalore run``: one run, or ``--resume`` of a stopped one. A round that fails (too few
    valid uploads after its retries) ends it with one line naming the kept checkpoint and the
    command that continues, and exit status 3."""
    from fedgalore.engine.api import resume, run
    from fedgalore.job.config import ConfigError
    from fedgalore.engine.loop import RoundFailed

    try:
        if args.resume is not None:
            run_dir = Path(args.resume)
            if not run_dir.is_dir():
                raise ConfigError(f"--resume {str(run_dir)!r}: no such run directory")
            rounds = _resume_rounds(args.overrides)
            if (run_dir / "config.yaml").is_file():
                _hub_note(*_saved_task(run_dir))
            progress = _progress(args.progress, None)
            result = resume(run_dir, progress=progress, rounds=rounds)
        else:
            if args.config is None:
                raise ConfigError("fedgalore run needs --config conf/pipeline/<name>.yaml (or --resume RUN_DIR)")
            cfg, _ = _load_config(args.config, args.overrides)
            _hub_note(cfg.task.name, cfg.task.options)
            result = run(cfg, progress=_progress(args.progress, cfg))
    except RoundFailed as exc:  # summary.json says failed; the checkpoint is kept
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"fedgalore: {exc.advice()}", file=sys.stderr)
        return EXIT_ROUND_FAILED
    s = result.summary
    print(f"final ({s.get('rounds_completed')}/{s.get('rounds')} rounds, {s.get('status')}): {_fmt_metrics(s.get('final') or {})}")
    print(f"run dir: {result.run_dir}")
    print(f"report:  fedgalore report {result.run_dir}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fedgalore.compare import run_grid
    from fedgalore.job.config import ConfigError
    from fedgalore.engine.loop import RoundFailed

    cfg, section = _load_config(args.config, args.overrides)
    methods = _split_list(args.methods if args.methods is not None else section.get("methods"), "--methods")
    settings = _split_list(args.settings if args.settings is not None else section.get("settings"), "--settings")
    seeds = _parse_seeds(args.seeds if args.seeds is not None else section.get("seeds"))
    if not methods:
        raise ConfigError("fedgalore compare needs --methods (e.g. --methods fedgalore,fedavg_full) or compare.methods in the config")
    if not settings:
        settings = [cfg.setting_label()]
    _hub_note(cfg.task.name, cfg.task.options)
    options = _check_method_options(section.get("method_options"), "compare.method_options")
    if args.method_options:
        for label, opts in _read_method_options(args.method_options).items():
            options.setdefault(label, {}).update(opts)
    out = Path(args.out or section.get("out") or Path(cfg.output.dir) / f"compare-{cfg.name}")
    progress = _progress(args.progress, cfg)
    quiet = (args.progress or cfg.output.progress) == "quiet"
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    shard = None
    if args.shard:
        try:
            i, n = (int(x) for x in args.shard.split("/"))
        except ValueError:
            raise ConfigError(f"--shard must be I/N (e.g. 0/2), got {args.shard!r}") from None
        if not (n >= 1 and 0 <= i < n):
            raise ConfigError(f"--shard I/N needs 0 <= I < N, got {args.shard!r}")
        shard = (i, n)
    try:
        run_grid(cfg, methods, settings, seeds, out, progress, method_options=options, on_cell=say, report=not args.no_report,
                 shard=shard, rerun_changed=args.rerun_changed)
    except RoundFailed as exc:  # one cell's round failed: that cell is marked failed, its checkpoint kept
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"fedgalore: {exc} (cell {exc.run_dir}); the comparison stopped there: fix the cause, then run the same "
              "fedgalore compare command again (finished cells are skipped, that cell resumes from its last checkpoint)",
              file=sys.stderr)
        return EXIT_ROUND_FAILED
    if not quiet and not args.no_report and (out / "table.md").is_file():
        print((out / "table.md").read_text().split("### Runs")[0].rstrip())
    print(f"comparison dir: {out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """Search each row's space on the validation split, confirm on held-out seeds, write the report."""
    from fedgalore.job.config import ConfigError
    from fedgalore.tune import TuneSpec, tune
    from fedgalore.tune.space import parse_space

    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("fedgalore tune needs Optuna: pip install 'optuna>=4' (scripts/setup.sh installs it)") from None
    cfg, section = _load_config(args.config, args.overrides)
    methods = _split_list(args.methods if args.methods is not None else section.get("methods"), "--methods") or [cfg.method.name]
    options = _check_method_options(section.get("method_options"), "compare.method_options")
    if args.method_options:
        for label, opts in _read_method_options(args.method_options).items():
            options.setdefault(label, {}).update(opts)
    rounds = []
    for v in _split_list(args.confirm_rounds, "--confirm-rounds"):
        try:
            rounds.append(int(v))
        except ValueError:
            raise ConfigError(f"--confirm-rounds must be comma-separated integers (e.g. 20,50), got {v!r}") from None
    if any(r < 1 for r in rounds):
        raise ConfigError(f"--confirm-rounds must be positive, got {args.confirm_rounds}")
    spec = TuneSpec(base=cfg, labels=methods, out=Path(args.out or Path(cfg.output.dir) / f"tune-{cfg.name}"),
                    method_options=options, space=parse_space(args.space, methods), trials=args.trials,
                    storage=args.storage, workers=args.workers, sampler=args.sampler, pruner=args.pruner, last=args.last,
                    heldout_seeds=_parse_seeds(args.heldout_seeds), confirm_rounds=rounds, close=args.close,
                    widen=not args.no_widen, sampler_seed=args.sampler_seed)
    quiet = (getattr(args, "progress", None) or cfg.output.progress) == "quiet"
    path = tune(spec, (lambda text: None) if quiet else (lambda text: print(text, flush=True)), confirm=not args.no_confirm)
    if not quiet:
        print(path.read_text().split("## The search")[0].rstrip())
    print(f"tune dir: {spec.out}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    """The split a run would train on: a table with the clients' label TV and feature shift,
    partition.json and partition.png, no training (--no-features: no model is built)."""
    from fedgalore.job.config import ConfigError
    from fedgalore.job.partition_files import format_partition, preview_partition

    try:
        examples = int(args.feature_examples)
    except ValueError:
        examples = 0
    if examples < 1:
        raise ConfigError(f"--feature-examples must be an integer >= 1 (training examples embedded per client), "
                          f"got {args.feature_examples!r}")
    cfg, _ = _load_config(args.config, args.overrides)
    _hub_note(cfg.task.name, cfg.task.options)
    rec, out = preview_partition(cfg, args.out, features=not args.no_features, feature_examples=examples,
                                 note=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_partition(rec))
    print(f"wrote {out / 'partition.json'} and {out / 'partition.png'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Bytes and memory of a run of the config, judged against this machine (or --gpu-gib / --host-gib);
    progress on stderr; Ctrl-C / SIGTERM: "plan interrupted", never run advice (nothing was run)."""
    from fedgalore.records.liveness import Terminated, sigterm_stops
    from fedgalore.plan import format_plan, make_plan

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        with sigterm_stops():  # SIGTERM: the same clean stop as Ctrl-C (the miniature's temporary folder is removed)
            cfg, section = _load_config(args.config, args.overrides)
            if cfg.task.name not in ("metamath", "offline_math"):  # those are planned from a config alone, no hub
                _hub_note(cfg.task.name, cfg.task.options)  # offline unless the task names the hub and it answers
            methods = _split_list(args.methods if args.methods is not None else section.get("methods"), "--methods") or [cfg.method.name]
            options = _check_method_options(section.get("method_options"), "compare.method_options")
            plan = make_plan(cfg, methods, options, train_examples=args.train_examples, gpu_gib=args.gpu_gib,
                             host_gib=args.host_gib, progress=progress)
    except KeyboardInterrupt as exc:  # Terminated (SIGTERM) is a KeyboardInterrupt
        term = isinstance(exc, Terminated)
        print(f"fedgalore: plan interrupted ({'SIGTERM' if term else 'Ctrl-C'}); nothing was run or written", file=sys.stderr)
        return 143 if term else 130
    print(format_plan(plan), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=1, default=str))
        print(f"plan written to {args.json}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fedgalore.report import build_report

    res = build_report(args.path, args.out, which=args.which, plots=not args.no_plots)
    out = res["out"]
    print((out / "table.md").read_text().split("### Runs")[0].rstrip())
    plots = [p for p in res["files"] if p.suffix == ".png" and p.parent.name != "diagnostics"]
    diags = [p for p in res["files"] if p.suffix == ".png" and p.parent.name == "diagnostics"]
    if (out / "client_eval.md") in res["files"]:  # federation.client_eval: each client's held-out metrics
        print("\n" + (out / "client_eval.md").read_text().rstrip())
    print(f"wrote {out / 'table.md'}, {out / 'table.tex'}, {out / 'comparison.json'}"
          + (f" and {len(plots)} plots (PNG + PDF) in {out / 'plots'}" if plots else "")
          + (f", {len(diags)} diagnostics (one figure each, with what good looks like) in {out / 'plots' / 'diagnostics'}"
             if diags else ""))
    if args.tensorboard:
        from fedgalore.report.tensorboard import write_tensorboard

        dirs = write_tensorboard(args.path, args.tensorboard)
        print(f"tensorboard: {len(dirs)} run(s) in {args.tensorboard} (tensorboard --logdir {args.tensorboard})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fedgalore.trained.export import PROBE_EXAMPLES, export_run
    from fedgalore.trained.lora_extract import RANK_NOTES

    res = export_run(args.run_dir, args.out, round=args.round, best=args.best, format=args.format, rank=args.rank,
                     force=args.force, verify=not args.no_verify, device=args.device, exact=args.exact)
    kind = ("Hugging Face folder, merged weights" if res.format == "hf" else
            f"PEFT adapter, rank {res.rank} extracted from W - W0" if res.rank else
            "PEFT adapter, W - W0 as an exact LoRA" if res.exact else "PEFT adapter")
    if res.live:
        print(f"note: {res.live}")
    print(f"exported round {res.round} of {res.run_dir} to {res.out} ({kind}; "
          f"{res.processor or 'no tokenizer/image processor: the task makes its own inputs'})")
    if res.rank:
        width = max(len(n) for n, _ in res.matrices)
        for name, f in res.matrices:
            print(f"  {name:<{width}}  {f.b.shape[0]}x{f.a.shape[1]}  rank(dW)={f.numerical_rank:<4} "
                  f"relative error {f.rel_error:.4g}")
        print(f"total relative Frobenius error {res.total_error:.4g} over {len(res.matrices)} matrices"
              + (f"; {RANK_NOTES[res.method]}" if res.method in RANK_NOTES else ""))
    if res.exact:
        ranks = [f.rank for _, f in res.exact if f.rank > 0]
        print(f"exact: ranks {min(ranks)}-{max(ranks)} (sum {sum(ranks)}) over {len(ranks)} matrices; adapter tensors "
              f"{_mib(res.adapter_bytes)} against {_mib(res.dense_bytes)} for those matrices dense (fp32)")
    elif res.format == "peft" and res.adapter_bytes is not None:
        print(f"size:  adapter tensors {_mib(res.adapter_bytes)}")
    if res.base_model:
        print(f"base:  {res.base_model} (adapter_config.json base_model_name_or_path)"
              + (f"; no hub id names it: the base model travels in {res.shipped_base}" if res.shipped_base else ""))
    if res.check is not None:
        print(f"check: max |logit difference| {res.check:.3g} against the run's global model on "
              f"{PROBE_EXAMPLES} test examples")
    if res.format == "hf":
        print(f"load:  transformers.{res.model_class}.from_pretrained({str(res.out)!r})")
    elif res.shipped_base:
        print(f"load:  peft.PeftModel.from_pretrained(transformers.{res.model_class}.from_pretrained({str(res.shipped_base)!r}), "
              f"{str(res.out)!r})")
    else:
        print(f"load:  peft.PeftModel.from_pretrained(base, {str(res.out)!r})  (base: {res.out / 'README.md'}, \"Load\")")
    return 0


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.2f} MiB"


def cmd_evaluate(args: argparse.Namespace) -> int:
    from fedgalore.job.config import ConfigError
    from fedgalore.trained.evaluate import MIN_GROUP, evaluate

    if args.min_group is not None and args.by is None:
        raise ConfigError(f"--min-group {args.min_group} ranks the groups of --by COLUMN: give --by too (e.g. --by site)")
    if args.overrides and args.config is None:
        raise ConfigError("key=value overrides change a --config: give --config CONFIG with them")
    cfg = _load_config(args.config, args.overrides)[0] if args.config is not None else None
    ev = evaluate(args.path, cfg, data=args.data, device=args.device, batch_size=args.batch_size, by=args.by,
                  min_group=MIN_GROUP if args.min_group is None else args.min_group)
    if args.json:
        out = {"source": ev.source, "task": ev.task, "examples": ev.examples, "metrics": ev.metrics}
        if ev.by is not None:
            out.update(by=ev.by, groups=ev.groups, worst=ev.worst, min_group=ev.min_group,
                       training=ev.training or None, **({"training_note": ev.training_note} if ev.training_note else {}))
        if ev.live:
            out["live"] = ev.live
        print(json.dumps(out))
        return 0
    if ev.live:
        print(f"note: {ev.live}")
    print(f"{ev.source} on {ev.task} ({ev.examples} test examples): {_fmt_metrics(ev.metrics)}")
    if ev.by is not None:
        print(_group_table(ev))
    return 0


def _group_table(ev: Any) -> str:
    """``evaluate --by``: one line per group (rows, whether it took part in training, metrics) and
    the worst group among those of at least ``--min-group`` rows."""
    from fedgalore.trained.evaluate import TRAINING_STATES

    names = list(ev.groups)
    metrics = [k for k in ev.groups[names[0]] if k != "n"]
    width = max(len(ev.by), *(len(n) for n in names))
    tw = max(len("trained"), *(len(v) for v in ev.training.values())) if ev.training else len("trained")
    lines = [f"by {ev.by} ({len(names)} groups):",
             f"  {ev.by:<{width}}  {'n':>6}  {'trained':<{tw}}  " + "  ".join(f"{m:>12}" for m in metrics)]
    for n in names:
        g = ev.groups[n]
        lines.append(f"  {n:<{width}}  {int(g['n']):>6}  {ev.training.get(n, '?'):<{tw}}  "
                     + "  ".join(f"{g[m]:>12.4f}" for m in metrics))
    if ev.training:
        lines.append("trained: " + "; ".join(f"{k} = {TRAINING_STATES[k]}" for k in TRAINING_STATES
                                             if k in ev.training.values()))
    else:
        lines.append(f"trained: {ev.training_note}")
    small = sum(ev.groups[n]["n"] < ev.min_group for n in names)
    if ev.worst is None:
        lines.append(f"worst {ev.by}: none named, no group has n >= {ev.min_group} test rows (--min-group {ev.min_group}; "
                     "lower it to compare small groups)")
    else:
        lines.append(f"worst {ev.by} (by the task's primary metric): {ev.worst} "
                     f"({_fmt_metrics({k: v for k, v in ev.groups[ev.worst].items() if k != 'n'})}), among the "
                     f"{len(names) - small} group{'s' if len(names) - small != 1 else ''} with n >= {ev.min_group} "
                     f"(--min-group {ev.min_group}"
                     + (f"; {small} smaller group{'s' if small != 1 else ''} not ranked)" if small else ")"))
    return "\n".join(lines)


def cmd_predict(args: argparse.Namespace) -> int:
    """Predictions of an exported folder or a run for every row of a file (fedgalore.trained.predict)."""
    from fedgalore.job.config import ConfigError
    from fedgalore.trained.predict import parse_csv_options, predict

    if args.overrides and args.config is None:
        raise ConfigError("key=value overrides change a --config: give --config CONFIG with them")
    cfg = _load_config(args.config, args.overrides)[0] if args.config is not None else None
    columns = _split_list(args.text_column, "--text-column") if args.text_column else None
    csv_options = parse_csv_options(args.csv)
    with _row_progress(args.data, args.progress) as on_batch:
        res = predict(args.path, args.data, args.out, cfg, batch_size=args.batch_size, device=args.device,
                      text_column=columns, max_new_tokens=args.max_new_tokens, on_batch=on_batch, force=args.force,
                      csv=csv_options)
    if res.live:
        print(f"note: {res.live}")
    print(f"predicted {res.rows} rows of {args.data} with {res.source} ({res.task}); wrote {res.out} "
          f"(the input columns and {', '.join(res.columns[:3])}{', ...' if len(res.columns) > 3 else ''})")
    return 0


class _row_progress:
    """A progress bar over the predicted rows (``--progress``: ``auto`` — rich on a terminal, else
    none —, ``rich``, or none with ``plain`` / ``quiet``): the context value is the ``on_batch(rows)``
    callback ``(rows, total)`` (None: no bar)."""

    def __init__(self, data: str, mode: str | None) -> None:
        self.data, self.mode, self.bar = data, mode or "auto", None

    def __enter__(self) -> Any:
        if self.mode in ("quiet", "plain") or (self.mode == "auto" and not sys.stderr.isatty()):
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("predict", total=None)

        def on_batch(k: int, total: int) -> None:
            self.bar.update(self.task, advance=k, total=total)

        return on_batch

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


def cmd_status(args: argparse.Namespace) -> int:
    """Whether a run (or each run under a folder) is running, complete, failed or interrupted,
    and whether its process is alive (fedgalore.records.liveness)."""
    from fedgalore.job.config import ConfigError
    from fedgalore.records.liveness import run_state

    root = Path(args.run_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such run directory")
    if (root / "config.yaml").is_file() or (root / "summary.json").is_file():
        dirs = [root]
    else:  # a comparison folder, or any folder of runs
        dirs = sorted({p.parent for p in root.rglob("summary.json") if not any(part.startswith(".") for part in p.relative_to(root).parts)})
        if not dirs:
            raise ConfigError(f"{root} holds no run (no summary.json or config.yaml in it or below it)")
    states = [run_state(d) for d in dirs]
    if args.json:
        print(json.dumps([s.to_json() for s in states] if len(states) > 1 else states[0].to_json(), indent=1))
        return 0
    for s in states:
        print(s.verdict())
        if len(states) == 1 and s.last_metrics:
            print(f"last metrics (round {s.last_round}): {_fmt_metrics(s.last_metrics)}")
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """What a site has spent: its ledger's releases composed per guarantee at the policy's δ (or
    ``--delta``), per level and per run (fedgalore.privacy.site)."""
    from fedgalore.job.config import ConfigError
    from fedgalore.privacy.site import LEDGER_FILE, POLICY_FILE, SiteLedger, load_policy, spent

    path = Path(args.path)
    if path.is_dir():
        ledger, policy = path / LEDGER_FILE, path / POLICY_FILE
    elif path.is_file():
        ledger, policy = path, path.parent / POLICY_FILE
    else:
        raise ConfigError(f"{path}: no such ledger file or site folder")
    if not ledger.is_file() and not policy.is_file():
        raise ConfigError(f"{path} holds no {LEDGER_FILE} nor {POLICY_FILE} (a site writes its ledger with its first release)")
    pol = load_policy(policy) if policy.is_file() else None
    delta = args.delta if args.delta is not None else (pol.delta if pol is not None else 1e-5)
    if not 0 < delta < 1:
        raise ConfigError(f"--delta={delta:g} must be in (0, 1) (e.g. 1e-5)")
    lines = SiteLedger(ledger).lines()
    budget = pol.budget if pol is not None else None
    doc = {"ledger": str(ledger), "policy": str(policy) if pol is not None else None,
           "budget": {"epsilon": budget.epsilon, "delta": budget.delta} if budget is not None else None,
           "sites": sorted({str(ln.get("site")) for ln in lines}), **spent(lines, delta)}
    if args.json:
        def finite(v: Any) -> Any:  # JSON has no infinity: ε = ∞ (a release without noise) as "inf"
            if isinstance(v, dict):
                return {k: finite(x) for k, x in v.items()}
            if isinstance(v, list):
                return [finite(x) for x in v]
            return "inf" if isinstance(v, float) and v == float("inf") else v

        print(json.dumps(finite(doc), indent=1))
        return 0
    head = f"ledger {ledger}"
    if pol is not None:
        head += f" (policy {policy}: " + (f"budget ε = {budget.epsilon:g} at δ = {budget.delta:g})" if budget else "no budget)")
    print(head)
    if not lines:
        print("no releases yet")
        return 0
    print(f"site {', '.join(doc['sites'])}: {doc['releases']} release(s) in {len(doc['runs'])} run(s); ε at δ = {delta:g}: "
          f"each row {doc['epsilon_rows']:.4g}, the site's data as a whole {doc['epsilon_site']:.4g}")
    print("  " + ", ".join(f"{level}: {n}" for level, n in sorted(doc["levels"].items())))
    print(f"  {'run':<16}  {'name':<12}  {'first':<20}  {'last':<20}  {'releases':>8}  {'ε rows':>8}  {'ε site':>8}")
    for r in doc["runs"]:
        print(f"  {r['run']:<16}  {str(r['name'])[:12]:<12}  {str(r['first']):<20}  {str(r['last']):<20}  "
              f"{r['releases']:>8}  {r['epsilon_rows']:>8.4g}  {r['epsilon_site']:>8.4g}")
    return 0


def _repo_roots() -> list[Path]:
    import fedgalore

    roots = [Path.cwd(), *Path.cwd().parents]
    pkg = Path(fedgalore.__file__).resolve()
    if len(pkg.parents) > 2:
        roots.append(pkg.parents[2])  # src layout: <repo>/src/fedgalore/__init__.py
    return roots


def _benchmarks_dir() -> Path | None:
    for root in _repo_roots():
        d = root / "benchmarks"
        if d.is_dir() and any(d.glob("*.py")):
            return d
    return None


# a benchmark file holding this marker is a long staged study that ``bench all`` skips
_NOT_IN_ALL = "# fedgalore-bench: not-in-all"


def _benchmarks(d: Path | None) -> list[str]:
    return sorted(p.stem for p in d.glob("*.py") if not p.name.startswith("_")) if d else []


def cmd_bench(args: argparse.Namespace) -> int:
    from fedgalore.job.config import ConfigError

    d = _benchmarks_dir()
    names = _benchmarks(d)
    if args.list or args.name is None:
        if d is None:
            raise ConfigError("no benchmarks/ folder found; run fedgalore bench from the fedgalore repository checkout")
        print("\n".join(names))
        return 0
    if d is None:
        raise ConfigError(f"benchmark {args.name!r}: no benchmarks/ folder found; run from the fedgalore repository checkout")
    todo = names if args.name == "all" else [args.name]
    for name in todo:
        if name not in names:
            raise ConfigError(f"unknown benchmark {name!r}; available in {d}: {', '.join(names) or 'none'} (or 'all')")
    rc = 0
    for name in todo:
        if len(todo) > 1:
            print(f"== benchmark {name}", flush=True)
            if _NOT_IN_ALL in (d / f"{name}.py").read_text():
                print(f"skipped: {name} is a long staged study; run it by name (fedgalore bench {name} --help)", flush=True)
                continue
        rc = max(rc, subprocess.call([sys.executable, str(d / f"{name}.py"), *args.args]))
    return rc


def _experiments() -> list[str]:
    import fedgalore.experiments as ex

    return sorted(m.name for m in pkgutil.iter_modules(ex.__path__) if not m.name.startswith("_"))


def cmd_repro(args: argparse.Namespace) -> int:
    from fedgalore.job.config import ConfigError

    names = _experiments()
    if args.list or args.name is None:
        print("\n".join(names))
        return 0
    if args.name not in names:
        raise ConfigError(f"unknown experiment {args.name!r}; available: {', '.join(names) or 'none'} (fedgalore repro --list)")
    module = importlib.import_module(f"fedgalore.experiments.{args.name}")
    entry = getattr(module, "main", None)
    if entry is None:
        raise ConfigError(f"experiment {args.name!r} has no main(args) entry point")
    rc = entry(list(args.args))
    return int(rc) if isinstance(rc, int) else 0


def _yaml_scalar(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _method_listing() -> list[dict[str, Any]]:
    """The methods to list (``fedgalore.methods.listing``): the registry's when this process has
    imported it (it may hold methods registered here), else the built-in methods' generated
    ``methods/catalog.json``, read without importing the method classes (and torch)."""
    if "fedgalore.methods.base" not in sys.modules:
        try:
            return json.loads((Path(__file__).parent / "methods" / "catalog.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not shipped or unreadable: the registry itself
            pass
    from fedgalore.methods.listing import describe_methods

    return describe_methods()


def cmd_methods(args: argparse.Namespace) -> int:
    """Each method with its summary and its options (default, one-line doc); a method whose
    options are those of one listed before says so. ``--compat``: the compatibility tables
    instead (methods × round features, features × features: ``fedgalore.compat``, docs/compat.md)."""
    if getattr(args, "compat", False):
        from fedgalore.compat import render_markdown
        from fedgalore.methods.base import available_methods

        print(render_markdown(available_methods()), end="")
        return 0
    for entry in _method_listing():
        print(f"{entry['name']:<18} {entry['summary']}".rstrip() + ("  [site ranks]" if entry["site_ranks"] else ""))
        if "options_as" in entry:
            print(f"    options: as {entry['options_as']}")
            continue
        for opt in entry["options"]:
            print(f"    {opt['name']:<22} {opt['default']:<18} {opt['doc']}"
                  + (f" [{', '.join(opt['choices'])}]" if opt["choices"] else ""))
    print("options go in method.options (YAML or method.options.<name>=<value>); docs/cli.md, \"Method options\"; "
          "[site ranks]: trains sites at their own ranks (federation.site_ranks); which features combine with "
          "which method: fedgalore methods --compat")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    """Each task with what it needs, its class and its options (type, default, one-line doc)."""
    import dataclasses
    from typing import get_type_hints

    from fedgalore.tasks import TASK_NEEDS, TASKS, TaskError, task_class

    print(f"{'task':<21} {'needs':<88} class")
    for name in sorted(TASKS):
        print(f"{name:<21} {TASK_NEEDS.get(name, '?'):<88} {TASKS[name]}")
        try:
            opts = task_class(name).options_class
        except TaskError as exc:  # a task whose package is not installed
            print(f"    options: not shown ({_one_line(exc)})")
            continue
        hints = get_type_hints(opts) if opts is not None else {}
        for f in dataclasses.fields(opts) if opts is not None else ():
            kind = hints[f.name].__name__ if isinstance(hints[f.name], type) else str(hints[f.name]).replace("typing.", "")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = _yaml_scalar(list(default) if isinstance(default, tuple) else default)
            print(f"    {f.name:<22} {kind:<18} {default:<{max(18, len(default) + 1)}} {f.metadata.get('doc', '')}")
    print("options go in task.options (YAML or task.options.<name>=<value>); offline assets: installed by `make setup`; "
          "hub tasks also run offline from local paths")
    return 0


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from fedgalore.progress import PROGRESS_MODES

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")

    p = argparse.ArgumentParser(prog="fedgalore", parents=[common],
                                description="Federated fine-tuning under non-IID data: FedGaLore and baselines.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    r = sub.add_parser("run", parents=[common], help="one federated run")
    r.add_argument("--config", help="pipeline YAML (conf/pipeline/<name>.yaml)")
    r.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. federation.rounds=5")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    r.add_argument("--progress", choices=PROGRESS_MODES, help="display (default: output.progress, i.e. auto)")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("compare", parents=[common], help="a methods x settings x seeds grid with identical budgets")
    c.add_argument("--config", help="pipeline YAML (base config of every cell)")
    c.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the base config (and compare.*)")
    c.add_argument("--methods", help="comma-separated method names / row labels, e.g. fedgalore,fedit,fedavg_full")
    c.add_argument("--settings", help="comma-separated partition settings, e.g. iid,dirichlet:0.5,natural:site "
                   "(docs/data.md, \"Partitions\"; default: the config's)")
    c.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the config's seed)")
    c.add_argument("--out", help="comparison directory (default: <output.dir>/compare-<name>)")
    c.add_argument("--method-options", metavar="FILE", help="YAML/JSON mapping method -> options (see docs/cli.md)")
    c.add_argument("--progress", choices=PROGRESS_MODES, help="display (default: output.progress, i.e. auto)")
    c.add_argument("--no-report", action="store_true", help="only run the cells (write the report later with fedgalore report DIR)")
    c.add_argument("--shard", metavar="I/N", help="run only cells I, I+N, ... (start N workers on one --out; the last writes the report)")
    c.add_argument("--rerun-changed", action="store_true",
                   help="re-run cells that ran with another config or inputs (their old runs move to <out>/.superseded/)")
    c.set_defaults(func=cmd_compare)

    tu = sub.add_parser("tune", parents=[common], help="choose each method's rate (and any key) on validation data, confirm on held-out seeds, recommend with costs")
    tu.add_argument("--config", help="pipeline YAML (the base config of every trial; needs a validation split)")
    tu.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the base config")
    tu.add_argument("--methods", help="comma-separated methods / row labels, e.g. fedgalore,fedit,fedavg_full (default: compare.methods, else method.name)")
    tu.add_argument("--method-options", metavar="FILE", help="YAML/JSON mapping row -> options, as fedgalore compare's")
    tu.add_argument("--space", action="append", default=[], metavar="[ROWS:]KEY=SPEC",
                    help="a searched key: log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or choice:A,B,C, e.g. train.lr=log:1e-4:1e-1 "
                         "or fedit,flexlora:method.rank=choice:8,16,32 (repeatable; default: train.lr, two decades around the row's rate)")
    tu.add_argument("--trials", type=int, default=8, help="trials per row, finished or pruned (default: 8)")
    tu.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe", help="Optuna sampler (default: tpe; grid needs choice: spaces)")
    tu.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median", help="stops hopeless trials along the rounds (default: median)")
    tu.add_argument("--last", type=int, default=2, help="objective: mean validation metric over the last N evaluated rounds (default: 2)")
    tu.add_argument("--heldout-seeds", default="1,2,3,4", help="seeds of the confirmation runs, none the config's (default: 1,2,3,4)")
    tu.add_argument("--confirm-rounds", help="comma-separated horizons of the confirmation runs (default: the config's rounds)")
    tu.add_argument("--close", type=float, default=0.01, help="a runner-up this close to the best (metric units) is confirmed too (default: 0.01)")
    tu.add_argument("--no-widen", action="store_true", help="do not widen a range whose best value lies at its edge")
    tu.add_argument("--no-confirm", action="store_true", help="search only (e.g. the other machines of a shared --storage); the report lists the search")
    tu.add_argument("--out", help="tune folder: its SQLite study, trials, cells and report (default: <output.dir>/tune-<name>)")
    tu.add_argument("--storage", metavar="URL", help="an Optuna RDB URL shared by workers on several machines (default: sqlite in --out)")
    tu.add_argument("--workers", type=int, default=1, help="processes on this machine sharing the study (default: 1; one per core, OMP_NUM_THREADS=1)")
    tu.add_argument("--sampler-seed", type=int, default=0, help="seed of the sampler (default: 0)")
    tu.set_defaults(func=cmd_tune)

    pa = sub.add_parser("partition", parents=[common], help="the clients' data split of a config, drawn without training")
    pa.add_argument("--config", required=True, help="pipeline YAML (conf/pipeline/<name>.yaml)")
    pa.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. federation.partition.kind=natural")
    pa.add_argument("--out", help="where partition.json and partition.png go (default: <output.dir>/partitions/<name>-<setting>-s<seed>)")
    pa.add_argument("--no-features", action="store_true",
                    help="skip the feature side (the task's model embedding each client's examples); the label side stays")
    pa.add_argument("--feature-examples", metavar="N", default="64",
                    help="training examples embedded per client at most, seeded by the config's seed (default: 64)")
    pa.set_defaults(func=cmd_partition)

    pl = sub.add_parser("plan", parents=[common], help="bytes per round per method and peak memory, without training")
    pl.add_argument("--config", required=True, help="pipeline YAML (conf/pipeline/<name>.yaml)")
    pl.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.batch_size=4")
    pl.add_argument("--methods", help="comma-separated methods (default: compare.methods of the config, else method.name)")
    pl.add_argument("--train-examples", type=int, help="training-set size when the data is not available here")
    pl.add_argument("--gpu-gib", "--accelerator-gib", dest="gpu_gib", type=float, metavar="X",
                    help="judge for a GPU with X GiB usable (default: the CUDA device found here, less 1 GiB)")
    pl.add_argument("--host-gib", type=float, metavar="Y",
                    help="judge for a host with Y GiB usable RAM (default: the memory available here, /proc/meminfo)")
    pl.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    rp = sub.add_parser("report", parents=[common], help="tables and plots for a run or comparison directory")
    rp.add_argument("path", metavar="RUN_DIR_OR_COMPARISON_DIR")
    rp.add_argument("--out", help="where to write (default: the directory itself)")
    rp.add_argument("--which", choices=("final", "best"), default="final", help="final-round or best-round metric")
    rp.add_argument("--no-plots", action="store_true", help="tables only")
    rp.add_argument("--tensorboard", metavar="LOGDIR", help="also write TensorBoard event files (needs fedgalore[tensorboard])")
    rp.set_defaults(func=cmd_report)

    ex = sub.add_parser("export", parents=[common], help="a run's model as a Hugging Face folder or a PEFT adapter")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("--out", required=True, help="folder to write (must not exist or be empty; see --force)")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--round", type=int, help="export this round's kept checkpoint (default: the newest)")
    which.add_argument("--best", action="store_true", help="export the round with the best validation metric")
    ex.add_argument("--format", choices=("hf", "peft"), default="hf",
                    help="hf: merged weights (default); peft: a LoRA adapter (FedIT, FFA-LoRA, LoRA-FAIR; others need --rank)")
    ex.add_argument("--rank", type=int, help="with --format peft: extract a rank-R LoRA adapter from W - W0 (any method)")
    ex.add_argument("--exact", action="store_true",
                    help="with --format peft: W - W0 as an exact LoRA at its numerical rank (FedGaLore with "
                         "train.weight_decay=0, FLoRA, FR-LoRA)")
    ex.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    ex.add_argument("--no-verify", action="store_true", help="skip loading the folder back to compare logits")
    ex.add_argument("--device", default="cpu", help="where to build the model (default cpu)")
    ex.set_defaults(func=cmd_export)

    ev = sub.add_parser("evaluate", parents=[common], help="metrics of an exported folder or a run on a task's test split")
    ev.add_argument("path", metavar="DIR_OR_RUN")
    ev.add_argument("--config", help="the task to evaluate on (default: the run's config; an export carries it)")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of --config")
    ev.add_argument("--data", metavar="FILE", help="evaluate on this file instead of the test split (tasks that read files)")
    ev.add_argument("--batch-size", type=int, help="evaluation batch size (default: federation.eval_batch_size)")
    ev.add_argument("--device", default="cpu", help="where to run the model (default cpu)")
    ev.add_argument("--by", metavar="COLUMN", help="also the metrics of every group of test rows sharing a value of "
                    "COLUMN (e.g. site), from one pass, whether each group took part in training, and the worst group")
    ev.add_argument("--min-group", type=int, metavar="N",
                    help="with --by: name the worst group among groups of at least N test rows (default 20, "
                         "fedgalore.trained.evaluate.MIN_GROUP)")
    ev.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ev.set_defaults(func=cmd_evaluate)

    pr = sub.add_parser("predict", parents=[common], help="predictions of an exported folder or a run for every row of a file")
    pr.add_argument("path", metavar="DIR_OR_RUN")
    pr.add_argument("--data", required=True, metavar="FILE", help="the rows to predict (.csv .tsv .json .jsonl .parquet; no label needed)")
    pr.add_argument("--out", required=True, metavar="FILE", help="where to write the rows with their predictions (.csv or .jsonl)")
    pr.add_argument("--config", help="the task that makes the inputs (default: the run's config; an export carries it)")
    pr.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of --config")
    pr.add_argument("--text-column", metavar="COL[,COL2]", help="text column(s) to classify (default: the task's text_column)")
    pr.add_argument("--csv", action="append", metavar="KEY=VALUE",
                    help="how --data (a .csv/.tsv file) is written, replacing the run's task.options.csv: delimiter=';', "
                         "encoding=cp1252, quotechar=\"'\" (delimiter=tab for a tab); repeat for several; a field given "
                         "nowhere is sniffed")
    pr.add_argument("--max-new-tokens", type=int, help="causal_lm: tokens generated per row (default: the task's max_new_tokens)")
    pr.add_argument("--batch-size", type=int, help="batch size (default: federation.eval_batch_size)")
    pr.add_argument("--device", default="cpu", help="where to run the model (default cpu)")
    pr.add_argument("--force", action="store_true", help="replace --out if it exists")
    pr.add_argument("--progress", choices=PROGRESS_MODES, help="auto (default): a progress bar on a terminal; quiet: none")
    pr.set_defaults(func=cmd_predict)

    st = sub.add_parser("status", parents=[common], help="is a run running, complete, failed or interrupted; is its process alive")
    st.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or a folder of runs: one line each)")
    st.add_argument("--json", action="store_true", help="print the state as JSON")
    st.set_defaults(func=cmd_status)

    lg = sub.add_parser("ledger", parents=[common], help="what a site has spent: its privacy ledger across runs")
    lg.add_argument("path", metavar="LEDGER_OR_SITE_DIR", help="a site's fedgalore-ledger.jsonl, or the folder holding it")
    lg.add_argument("--delta", type=float, help="δ to read ε at (default: the policy's budget δ beside the ledger, else 1e-5)")
    lg.add_argument("--json", action="store_true", help="print the result as JSON")
    lg.set_defaults(func=cmd_ledger)

    b = sub.add_parser("bench", parents=[common], help="run benchmarks/NAME.py (or 'all')")
    b.add_argument("name", nargs="?", help="benchmark name (fedgalore bench --list)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.add_argument("--list", action="store_true", help="list the benchmarks")
    b.set_defaults(func=cmd_bench)

    x = sub.add_parser("repro", parents=[common], help="run a paper experiment (fedgalore.experiments.NAME)")
    x.add_argument("name", nargs="?", help="experiment name (fedgalore repro --list)")
    x.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the experiment's main(args)")
    x.add_argument("--list", action="store_true", help="list the experiments")
    x.set_defaults(func=cmd_repro)

    me = sub.add_parser("methods", parents=[common], help="list the federated methods")
    me.add_argument("--compat", action="store_true",
                    help="print which round features each method runs and which features combine (docs/compat.md)")
    me.set_defaults(func=cmd_methods)
    sub.add_parser("tasks", parents=[common], help="list the tasks").set_defaults(func=cmd_tasks)
    return p


class _OwnHandlerFilter(logging.Filter):
    """Drops records of libraries that already print them through their own handler
    (huggingface_hub, datasets), which would otherwise appear twice."""

    OWN = ("huggingface_hub", "datasets")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".", 1)[0] not in self.OWN


def _continue_hint(args: argparse.Namespace, run_dir: Any) -> str:
    """How to continue after Ctrl-C, naming the interrupted run directory."""
    if getattr(args, "command", None) == "compare":
        where = f" ({run_dir} resumes from its last checkpoint)" if run_dir else ""
        return f"continue the comparison by running the same fedgalore compare command again{where}"
    if run_dir is not None:
        return f"continue with: fedgalore run --resume {run_dir}"
    return "nothing was run yet"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value overrides may come before and after options (`compare --config X a=1 --methods M b=2`);
        # argparse takes only the first group as the positional list, the rest arrive here
        if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = list(args.overrides or []) + extra
        elif extra:
            parser.parse_args(argv)  # the usual usage error
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    debug = bool(getattr(args, "debug", False)) or "--debug" in argv
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # libraries that print through their own handler: once
        handler.addFilter(_OwnHandlerFilter())
    if not debug:  # deprecation notices between transformers and peft are not the user's to fix
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM arrives as its subclass Terminated (fedgalore.records.liveness)
        term = type(exc).__name__ == "Terminated"
        print(f"fedgalore: {'stopped by SIGTERM' if term else 'interrupted'}; {_continue_hint(args, getattr(exc, 'run_dir', None))}",
              file=sys.stderr)
        return 143 if term else 130
    except _user_errors() as exc:
        if debug:
            traceback.print_exc()
        print(f"fedgalore: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
