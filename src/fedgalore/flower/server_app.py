"""The server side of the Flower app: a ServerApp running :class:`FedGaLoreStrategy`.

Run config keys (``[tool.flwr.app.config]`` in the Flower project's pyproject.toml, or
``flwr run . --run-config "..."``):

* ``config`` — path of a fedgalore pipeline YAML (relative paths: to the app directory given to
  :func:`make_server_app`, then to the current directory);
* ``overrides`` — space-separated ``key=value`` overrides (``"federation.rounds=2 seed=1"``);
* ``run-dir`` — where the run directory goes (default: ``output.dir`` of the config);
* ``timeout`` — seconds to wait for a round's replies (default 3600).
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedgalore.flower.strategy import FedGaLoreStrategy  # noqa: E402

__all__ = ["app", "make_server_app", "config_from_run_config"]


def config_from_run_config(run_config, app_dir: str | Path | None = None) -> "FederatedConfig":  # noqa: F821
    from fedgalore.federated.config import ConfigError, load_config

    path = str(run_config.get("config", ""))
    if not path:
        raise ConfigError("the Flower run config needs config=<pipeline YAML> (see examples/flower/README.md)")
    p = Path(path)
    if not p.is_absolute() and app_dir is not None and (Path(app_dir) / p).is_file():
        p = Path(app_dir) / p
    return load_config(p, shlex.split(str(run_config.get("overrides", ""))))


def make_server_app(cfg=None, *, app_dir: str | Path | None = None, run_dir=None, progress=None,
                    results: dict | None = None) -> ServerApp:
    """A ServerApp for ``cfg`` (or, when None, for the run config's ``config``/``overrides``,
    relative paths resolved against ``app_dir``). ``results``, when given, receives the
    RunResult under ``"result"``."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        c = cfg if cfg is not None else config_from_run_config(rc, app_dir)
        rd = run_dir if run_dir is not None else (rc.get("run-dir") or None)
        strategy = FedGaLoreStrategy(c, run_dir=rd, timeout=float(rc.get("timeout", 3600)), progress=progress)
        res = strategy.start(grid)
        if results is not None:
            results["result"] = res

    return server


app = make_server_app()
