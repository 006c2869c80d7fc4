"""The server side of the Flower app: a ServerApp running :class:`FedGaLoreStrategy`.

Run config keys (``[tool.flwr.app.config]`` in the Flower project's pyproject.toml, or
``flwr run . --run-config "..."``):

* ``config`` — path of a fedgalore pipeline YAML (relative paths: to the app directory given to
  :func:`make_server_app`, then to the current directory);
* ``overrides`` — space-separated ``key=value`` overrides (``"federation.rounds=2 seed=1"``);
* ``run-dir`` — where the run directory goes (default: ``output.dir`` of the config);
* ``timeout`` — seconds to wait for the replies of a round (and of a query or evaluation);
  a SuperNode that has not answered by then is dropped from that round (default 3600); a round
  retried for too few valid uploads (``federation.min_clients``) waits twice as long at each retry;
* ``join-timeout`` — seconds to wait for a SuperNode's first answer (its site or partition id),
  which includes its cold start: installing the app and starting its ClientApp; and for a round
  (or evaluation) in which a node trains (evaluates) for the first time in the run, which
  includes building its runtime: loading the model, tokenising its data (default: the larger of
  ``timeout`` and 300);
* ``resume`` — ``true``: continue the run in ``run-dir`` (or the config's default run directory)
  from its last checkpoint, as ``fedgalore run --resume`` does; the metrics equal those of an
  uninterrupted run (default ``false``; :meth:`FedGaLoreStrategy.start`).

The app shows the run as ``fedgalore run`` does: the progress display of ``output.progress``
(``auto`` is one line per round here, Flower's log is not a terminal), then the final metrics and
the run directory. A user error (bad config, a run directory that already holds this run) is one
``fedgalore: error: ...`` line and fails the Flower run; ``python -m fedgalore.flower`` turns a
failed run into a non-zero exit status (``flwr run`` itself exits 0).
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedgalore.flower.strategy import FedGaLoreStrategy  # noqa: E402

__all__ = ["app", "make_server_app", "config_from_run_config", "run_config_flag", "FlowerRunError"]


class FlowerRunError(RuntimeError):
    """The fedgalore run inside the ServerApp failed; the message is the one-line reason."""


def config_from_run_config(run_config, app_dir: str | Path | None = None) -> "FederatedConfig":  # noqa: F821
    """The pipeline the run config names (``config``, relative to ``app_dir`` first) with its ``overrides``."""
    from fedgalore.job.config import ConfigError, load_config

    path = str(run_config.get("config", ""))
    if not path:
        raise ConfigError("the Flower run config needs config=<pipeline YAML> (see examples/flower/README.md)")
    p = Path(path)
    if not p.is_absolute() and app_dir is not None and (Path(app_dir) / p).is_file():
        p = Path(app_dir) / p
    return load_config(p, shlex.split(str(run_config.get("overrides", ""))))


def run_config_flag(run_config, key: str) -> bool:
    """A boolean run-config value: TOML ``true``/``false``, or the strings true/false/1/0/yes/no."""
    from fedgalore.job.config import ConfigError

    v = run_config.get(key, False)
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ConfigError(f"run config {key}={v!r}: expected true or false")


def make_server_app(cfg=None, *, app_dir: str | Path | None = None, run_dir=None, progress=None,
                    results: dict | None = None) -> ServerApp:
    """A ServerApp for ``cfg`` (or, when None, for the run config's ``config``/``overrides``,
    relative paths resolved against ``app_dir``). ``results``, when given, receives the
    RunResult under ``"result"``."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from fedgalore.cli import _fmt_metrics, _one_line, _user_errors
        from fedgalore.progress import make_progress

        rc = context.run_config
        try:
            c = cfg if cfg is not None else config_from_run_config(rc, app_dir)
            rd = run_dir if run_dir is not None else (rc.get("run-dir") or None)
            sink = progress if progress is not None else make_progress(c.output.progress)
            strategy = FedGaLoreStrategy(c, run_dir=rd, timeout=float(rc.get("timeout", 3600)), progress=sink,
                                         resume=run_config_flag(rc, "resume"),
                                         join_timeout=float(rc["join-timeout"]) if "join-timeout" in rc else None)
            res = strategy.start(grid)
        except _user_errors() as exc:
            line = f"fedgalore: error: {_one_line(exc)}"
            print(line + "  (Flower app: change the run with --run-config 'overrides=\"key=value ...\"' "
                  "or run-dir=...)", file=sys.stderr, flush=True)
            raise FlowerRunError(line) from None
        s = res.summary
        print(f"final ({s.get('rounds_completed')}/{s.get('rounds')} rounds, {s.get('status')}): "
              f"{_fmt_metrics(s.get('final') or {})}", flush=True)
        print(f"run dir: {Path(res.run_dir).resolve()}", flush=True)
        print(f"report:  fedgalore report {Path(res.run_dir).resolve()}", flush=True)
        if results is not None:
            results["result"] = res

    return server


app = make_server_app()
