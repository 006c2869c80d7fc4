"""Execution backends (sequential by default; ray and flower as optional extras)."""
from fedgalore.backends.base import Backend, ClientJob, ClientResult, Runtime  # noqa: F401


def make_backend(name: str, runtime, options: dict | None = None):
    """Build the backend ``name`` around the server's runtime."""
    from fedgalore.federated.config import ConfigError

    if name == "sequential":
        from fedgalore.backends.sequential import SequentialBackend

        return SequentialBackend(runtime)
    if name == "ray":
        try:
            from fedgalore.backends.ray import RayBackend
        except ImportError as exc:
            raise ConfigError(f"backend 'ray' needs Ray: pip install 'fedgalore[ray]' ({exc})") from None
        return RayBackend(runtime, **(options or {}))
    if name == "flower":
        raise ConfigError("backend 'flower' runs through the Flower app (`flwr run`), not `fedgalore run`: see docs/scale-out.md")
    raise ConfigError(f"unknown backend {name!r}; available: sequential, ray (flower via docs/scale-out.md)")
