"""What a validated config means on this machine, right before a run starts.

* :func:`config_for_method` — ``method.options`` may hold options of several methods (a pipeline
  written for FedGaLore runs unchanged with ``method.name=fedit``); the run keeps the options its
  method takes (:func:`fedgalore.methods.base.split_options`), and that is what its
  ``config.yaml`` records;
* :func:`method_options` — the method's typed options with what depends on the rest of the
  config filled in: a ``downlink: auto`` (FedGaLore) becomes ``factored``, or ``dense`` when a
  server optimizer other than ``fedavg`` rewrites the aggregate (the factored chain would then
  not be the update the server applied);
* :func:`resolve_method` — the same for a method object passed in code
  (``fedgalore.run(cfg, method=...)``): its ``downlink: auto`` is resolved against the config's
  server optimizer, and an explicit ``factored`` with a server optimizer that rewrites the
  aggregate is refused (the recorded chain would not rebuild the server's model);
* :func:`check_device` — ``device=cuda`` on a torch without CUDA (or ``cuda:3`` with one GPU, or
  ``mps`` off Apple silicon) is one :class:`~fedgalore.job.config.ConfigError` line that
  says what to change, before any model or data is loaded.
"""
from __future__ import annotations

from fedgalore.job.config import ConfigError, FederatedConfig

__all__ = ["config_for_method", "method_options", "resolve_method", "check_device"]


def config_for_method(cfg: FederatedConfig) -> FederatedConfig:
    """A copy of ``cfg`` whose ``method.options`` holds only what ``method.name`` takes (options
    that only other registered methods take are dropped)."""
    out = FederatedConfig.from_dict(cfg.to_dict())
    out.method.options = cfg.method.own_options()
    return out


def method_options(cfg: FederatedConfig):
    """``cfg.method.typed_options()`` with ``downlink: auto`` resolved (see the module docstring)."""
    from dataclasses import replace

    opts = cfg.method.typed_options()
    if getattr(opts, "downlink", None) == "auto":
        opts = replace(opts, downlink="factored" if cfg.federation.server_optimizer.identity else "dense")
    return opts


def resolve_method(method, cfg: FederatedConfig):
    """``method`` (an object built in code) with its ``downlink`` resolved for ``cfg`` (module
    doc); returns the same object. Raises :class:`ConfigError` for ``downlink: factored`` under a
    server optimizer other than ``fedavg``."""
    from dataclasses import replace

    if method.traits.downlink != "factored":  # no downlink option (MethodTraits.downlink)
        return method
    downlink = method.options.downlink
    identity = cfg.federation.server_optimizer.identity
    if downlink == "auto":
        method.options = replace(method.options, downlink="factored" if identity else "dense")
    elif downlink == "factored" and not identity:
        raise ConfigError(f"federation.server_optimizer.name={cfg.federation.server_optimizer.name} changes the update "
                          f"the factored downlink sends; build the {method.name} method with downlink='dense' "
                          "(or use server_optimizer.name=fedavg)")
    return method


def check_device(device: str) -> None:
    """Raise :class:`ConfigError` when ``device`` is not usable by this torch build and machine."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (check CUDA_VISIBLE_DEVICES / the driver)")
            raise ConfigError(f"device={device} but {why}; run on the CPU with device=cpu, "
                              "or install a CUDA build of torch on a machine with a GPU")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={device} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                              f"use device=cuda:0 ... cuda:{torch.cuda.device_count() - 1}")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS (Apple GPU) is not available here; use device=cpu")
