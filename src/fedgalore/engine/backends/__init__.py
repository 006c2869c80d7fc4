"""Execution backends (sequential by default; ray and flower as optional extras)."""
from __future__ import annotations

from typing import Any

from fedgalore.engine.backends.base import Backend
from fedgalore.job.config import ConfigError

__all__ = ["Backend", "make_backend"]


def make_backend(name: str, options: dict[str, Any] | None = None) -> Backend:
    """The backend ``name`` with its ``backend.options`` (not yet started: see :meth:`Backend.start`)."""
    if name == "sequential":
        from fedgalore.engine.backends.sequential import SequentialBackend

        opts = dict(options or {})
        unknown = sorted(set(opts) - {"keep_client_models"})
        if unknown:
            raise ConfigError(f"backend.options {', '.join(unknown)} not known to the sequential backend "
                              "(it takes keep_client_models: true | false)")
        return SequentialBackend(**opts)
    if name == "ray":
        try:
            from fedgalore.engine.backends.ray import RayBackend
        except ImportError as exc:
            raise ConfigError(f"backend 'ray' needs Ray: pip install 'fedgalore[ray]' ({exc})") from None
        return RayBackend(**(options or {}))
    if name == "flower":
        raise ConfigError("backend 'flower' runs through the Flower app (`flwr run`), not `fedgalore run`: see docs/scale-out.md")
    raise ConfigError(f"unknown backend {name!r}; available: sequential, ray (flower via docs/scale-out.md)")
