"""``run`` and ``resume``: the Python API behind ``fedgalore run`` (docs/cli.md).

::

    import fedgalore
    cfg = fedgalore.load_config("conf/pipeline/offline_text.yaml", ["federation.rounds=5"])
    result = fedgalore.run(cfg)            # -> RunResult(run_dir, summary, history)
    fedgalore.resume(result.run_dir)       # continue a stopped run (a finished one is returned as is)
"""
from __future__ import annotations

from pathlib import Path

from fedgalore.job.config import ConfigError, FederatedConfig, load_config
from fedgalore.engine.events import LogProgress, ProgressSink
from fedgalore.records.identity import compare_with_saved, run_identity, summarize
from fedgalore.records.liveness import is_finished
from fedgalore.engine.loop import Federation, RunResult
from fedgalore.job.resolve import config_for_method
from fedgalore.records.rundir import extension_problem, saved_summary
from fedgalore.jsonl import read_jsonl
from fedgalore.methods.base import Method
from fedgalore.tasks.base import Task

__all__ = ["run", "resume"]


def run(cfg: FederatedConfig, *, resume: str | Path | None = None, progress: ProgressSink | None = None,
        task: Task | None = None, method: Method | None = None, run_dir: str | Path | None = None) -> RunResult:
    """Run (or, with ``resume=RUN_DIR``, continue) one federated run; returns its results.

    ``fedgalore.run(FederatedConfig(...))`` is the Python API behind ``fedgalore run``. With
    ``resume``, ``cfg`` (and ``task`` / ``method``) must be the saved run's — the same identity
    (:mod:`fedgalore.records.identity`: resolved config and the model and data files it read) —
    except ``federation.rounds``, which extends (or shortens) the run as :func:`resume`'s
    ``rounds`` does; any other difference is a :class:`ConfigError` naming it. A task object
    passed in code is recorded as such (``task.object`` in ``config.yaml``); resuming its run
    needs the object again (``task=``).
    """
    if resume is not None:
        return _resume(Path(resume), progress=progress, task=task, method=method, cfg=cfg)
    return Federation(cfg, run_dir=run_dir, progress=progress, task=task, method=method).run()


def resume(run_dir: str | Path, *, progress: ProgressSink | None = None, rounds: int | None = None) -> RunResult:
    """Continue a stopped run from its last complete round (a finished run is returned as is).
    Refused (:class:`ConfigError` naming the differences) when the run's identity changed since
    it started: a model or data file it reads, or a default of this version.

    ``rounds`` extends (or shortens) the run to that many rounds. It is allowed only when the
    result equals an uninterrupted run of ``rounds`` rounds, i.e. when the learning-rate schedule
    does not depend on the total (``train.schedule_scope=round``, or ``train.schedule=constant``
    with ``train.warmup_ratio=0``); otherwise :class:`ConfigError` says why and what to run
    instead (:func:`~fedgalore.records.rundir.extension_problem`).
    """
    return _resume(Path(run_dir), progress=progress, rounds=rounds)


def _resume(run_dir: Path, *, progress=None, task=None, method=None, cfg: FederatedConfig | None = None,
            rounds: int | None = None) -> RunResult:
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); nothing to resume")
    saved = load_config(run_dir / "config.yaml")
    mine = saved
    if cfg is not None:  # the caller's config, its method.options reduced to the method's own as config.yaml records them
        mine = config_for_method(cfg.validate()) if method is None else FederatedConfig.from_dict(cfg.to_dict())
        rounds, mine.federation.rounds = mine.federation.rounds, saved.federation.rounds
    diffs, note = compare_with_saved(run_dir, run_identity(mine, task=task, method=method))
    if diffs:
        raise ConfigError(f"cannot resume {run_dir} with another config or inputs ({summarize(diffs)}); a resumed run "
                          f"keeps its saved config.yaml and the model and data files it started with, and only "
                          f"federation.rounds may change (to extend it); start a new run instead: fedgalore run --config "
                          f"{run_dir / 'config.yaml'} output.run_name=<new name>")
    if note:
        (progress or LogProgress()).message(f"note: {note}")
    s = saved_summary(run_dir)
    if rounds is not None and int(rounds) != saved.federation.rounds:
        if int(rounds) < 1:
            raise ConfigError(f"federation.rounds={rounds} must be >= 1")
        done = int(s.get("rounds_completed", 0) or 0)
        problem = extension_problem(saved, int(rounds), done)
        if problem is not None:
            again = " output.run_name=<new name>" if saved.output.run_name else ""
            raise ConfigError(
                f"cannot continue {run_dir} to {rounds} rounds exactly: {problem}. Start a {rounds}-round run instead "
                f"(fedgalore run --config {run_dir / 'config.yaml'} federation.rounds={rounds}{again}); runs meant to be "
                f"extended need train.schedule_scope=round, or train.schedule=constant with train.warmup_ratio=0"
            )
        saved.federation.rounds = int(rounds)
    elif is_finished(s.get("status")):
        return RunResult(run_dir, s, read_jsonl(run_dir / "metrics.jsonl"))
    return Federation(saved, run_dir=run_dir, progress=progress, task=task, method=method, resume=True).run()
