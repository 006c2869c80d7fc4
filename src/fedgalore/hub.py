"""Hugging Face hub access for the command line: no network calls unless a task needs the hub.

Rule (docs/cli.md, "The Hugging Face hub"): when ``HF_HUB_OFFLINE`` is not set,

* a task that does not use the hub (the offline tasks, ``tiny_text``) runs with
  ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` — nothing is looked up online;
* a hub task (:data:`fedgalore.tasks.HUB_TASKS`: ``glue``, ``domainnet``, ``metamath``) first
  checks once whether the hub answers (a TCP connection to ``$HF_ENDPOINT``, default
  ``huggingface.co:443``, within 3 s). If it does, the libraries use the hub as usual; if not,
  the run goes offline the same way, so a model or data set that is neither cached nor given as
  a local path fails at once with one line instead of after ~30 s of retries.

``HF_HUB_OFFLINE`` set by the user (to anything, ``0`` included) is left alone, and no note is
shown. The generic tasks (``text_classification``, ``causal_lm``, ``image_classification``) need the
hub only when an option names something that is not a local path (a hub model or data set id;
:func:`names_hub_ids`): with local files only they go offline silently, without the check. The
note is shown at most once per process (a comparison grid, a resumed run).
"""
from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

__all__ = ["prepare_hub", "go_offline", "hub_reachable", "names_hub_ids", "folder_hub_id"]

#: the generic tasks: whether they need the hub depends on their options (:func:`names_hub_ids`)
_FILE_TASKS = frozenset({"text_classification", "causal_lm", "image_classification"})
#: the options of those tasks that may name a hub id
_HUB_OPTIONS = ("model", "base_model", "data")
_noted = False

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def go_offline() -> None:
    """Set the offline variables in this process (and in libraries already imported)."""
    for var in _OFFLINE_VARS:
        os.environ[var] = "1"
    consts = sys.modules.get("huggingface_hub.constants")
    if consts is not None:  # read once at import time
        consts.HF_HUB_OFFLINE = True
    dcfg = sys.modules.get("datasets.config")
    if dcfg is not None:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, True)


def hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    """(whether a TCP connection to the hub opens within ``timeout`` seconds, the host)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, host
    except OSError:
        return False, host


def names_hub_ids(options: dict | None) -> bool:
    """Whether a generic task's ``options`` name something that is not a local path: a
    ``model`` / ``base_model`` / ``data`` value (or a ``data`` split's) that is no existing file or
    folder, or a PEFT adapter folder whose recorded base is none (then the hub may have it).
    ``model`` left out is the offline model (local)."""
    from pathlib import Path

    def remote(value: object) -> bool:
        return isinstance(value, str) and bool(value) and not Path(value).expanduser().exists()

    options = options or {}
    for key in _HUB_OPTIONS:
        value = options.get(key)
        values = list(value.values()) if isinstance(value, dict) else [value]
        if any(remote(v) for v in values if not isinstance(v, dict)):
            return True
    model = options.get("model")
    if isinstance(model, str) and not options.get("base_model") and (Path(model).expanduser() / "adapter_config.json").is_file():
        import json

        try:
            base = json.loads((Path(model).expanduser() / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            return False
        from fedgalore.tasks.assets import HUB_IDS

        offline = {repo for repo, _ in HUB_IDS.values()}  # an offline model's hub id loads its installed copy
        return remote(base) and str(base) not in offline and not (Path(model).expanduser() / str(base)).exists()
    return False


from fedgalore.tasks.assets import folder_hub_id  # noqa: E402  (re-exported: it lives below the engine)


def prepare_hub(task: str, timeout: float = 3.0, options: dict | None = None) -> str | None:
    """Apply the rule above for a run of ``task`` with task ``options``; returns a note to show
    when a hub task goes offline because the hub is unreachable (else None; at most once per process)."""
    global _noted
    from fedgalore.tasks import HUB_TASKS

    if "HF_HUB_OFFLINE" in os.environ:
        return None
    if task not in HUB_TASKS or (task in _FILE_TASKS and not names_hub_ids(options)):
        go_offline()
        return None
    ok, host = hub_reachable(timeout)
    if ok:
        return None
    go_offline()
    if _noted:
        return None
    _noted = True
    return (f"note: the Hugging Face hub ({host}) is unreachable, so task {task!r} runs offline (HF_HUB_OFFLINE=1): "
            "models and data come from the local cache or the task's local-path options")
