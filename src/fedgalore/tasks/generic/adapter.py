"""A PEFT LoRA adapter folder as the starting model of a generic task (``task.options.model``).

A folder with ``adapter_config.json`` (what ``peft``'s ``save_pretrained`` and
``fedgalore export --format peft`` write) is an adapter, not a model: the model is its base,
``base_model_name_or_path`` of its config (a local folder or a hub id; ``task.options.base_model``
overrides it — an adapter made on another machine often records a path that exists only there).
The base must be there offline: a local folder, a hub id already in the Hugging Face cache, or
the hub id of one of fedgalore's offline models (:func:`fedgalore.tasks.assets.offline_model`: an
adapter exported from a run on the offline MiniLM names it ``sentence-transformers/all-MiniLM-L6-v2``,
and loads on the installed copy, said once); otherwise one :class:`~fedgalore.tasks.base.TaskError`
line says how to get it.

The task builds the base model as it would without an adapter, then loads the adapter into it
with PEFT (``PeftModel.from_pretrained``) and takes it apart again (``unload``, no merge):

* the base weights stay the pretrained ones (``W0``); the adapter's other saved tensors — the
  ``modules_to_save`` copies (a classifier head) and trained biases — are put in place;
* the LoRA factors ``(B, A)`` and the scaling ``s`` of every adapted layer are kept aside as a
  :class:`StartAdapter` (``task.start_adapter``), so that the global model at round 0 is exactly
  the adapter's model ``W0 + s·BA``.

What happens to them depends on the method (:mod:`fedgalore.engine.start_adapter`): the methods
whose global model is the base plus LoRA adapters (FedIT, FFA-LoRA, LoRA-FAIR) start training from
these factors (the same rank and scaling are required); every other method starts from the merged
weights ``W0 + s·BA``. Only LoRA adapters (no DoRA) are read; an adapter's own target layers are the
task's default target modules (``task.options.target_modules`` overrides them).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedgalore.tasks.base import TaskError

__all__ = ["ADAPTER_CONFIG", "AdapterSource", "StartAdapter", "is_adapter_folder", "read_adapter", "load_adapter"]

#: the file that makes a folder a PEFT adapter
ADAPTER_CONFIG = "adapter_config.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSource:
    """An adapter folder and the base model it was trained on."""

    #: the adapter folder
    folder: Path
    #: the base as this run loads it: a local folder (absolute) or a hub id
    base: str
    #: the base as named by the user or the adapter (``base_model_name_or_path`` / ``task.options.base_model``)
    base_name: str
    #: ``adapter_config.json``
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.config.get("r", 0))

    @property
    def alpha(self) -> float:
        return float(self.config.get("lora_alpha", self.rank))

    def target_modules(self) -> tuple[str, ...] | None:
        """The adapter's target modules as its config lists them (None: a regex string, resolved
        from the loaded layers instead)."""
        t = self.config.get("target_modules")
        if isinstance(t, (list, tuple)) and t:
            return tuple(str(x) for x in t)
        return None


@dataclass
class StartAdapter:
    """The LoRA factors of a loaded adapter: per adapted layer (full module name) ``(B, A)`` and
    its scaling ``s`` (``W = W0 + s·BA``)."""

    source: AdapterSource
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: dict[str, float]

    @property
    def rank(self) -> int:
        return max((int(a.shape[0]) for _, a in self.factors.values()), default=0)


def is_adapter_folder(model: str | None) -> bool:
    """Whether ``model`` names a local folder holding ``adapter_config.json`` (and no ``config.json``:
    a full model folder that also carries an adapter config is a model)."""
    if not model:
        return False
    path = Path(model).expanduser()
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no")


def _hub_cached(repo: str) -> bool:
    """Whether the hub id ``repo`` has a config.json in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library rejects is simply not cached
        return False
    return isinstance(found, str) and Path(found).is_file()


def read_adapter(model: str, base_model: str | None = None) -> AdapterSource:
    """The adapter in folder ``model`` and its resolved base (module doc); ``base_model``: the
    base to use instead of the one the adapter records. One-line :class:`TaskError` for a
    non-LoRA adapter or a base that cannot be found offline."""
    folder = Path(model).expanduser().resolve()
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TaskError(f"task.options.model={model!r}: {ADAPTER_CONFIG} is unreadable ({exc})") from None
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        raise TaskError(f"task.options.model={model!r} is a PEFT {kind or 'unknown'} adapter; only LoRA adapters can start a run")
    if config.get("use_dora"):
        raise TaskError(f"task.options.model={model!r} is a DoRA adapter; merge it into its base first "
                        "(PeftModel.merge_and_unload, then save_pretrained) and give that folder as task.options.model")
    name = base_model or config.get("base_model_name_or_path")
    if not name:
        raise TaskError(f"task.options.model={model!r} is a PEFT adapter whose {ADAPTER_CONFIG} names no base model "
                        "(base_model_name_or_path); set task.options.base_model to the base's folder or hub id")
    option = "task.options.base_model" if base_model else f"its {ADAPTER_CONFIG}'s base_model_name_or_path"
    path = Path(str(name)).expanduser()
    candidates = [path] if path.is_absolute() else [path, folder / path]
    local = next((p for p in candidates if p.is_dir()), None)
    if local is not None:
        if not (local / "config.json").is_file():
            raise TaskError(f"the base model of adapter {model!r}, {str(local)!r} ({option}), is a folder without config.json; "
                            "set task.options.base_model to the base model's folder or hub id")
        return AdapterSource(folder, str(local.resolve()), str(name), config)
    looks_like_path = path.is_absolute() or str(name).startswith((".", "~")) or str(name).count("/") > 1
    if not looks_like_path and _offline() and not _hub_cached(str(name)):
        from fedgalore.tasks.assets import hub_id, offline_model

        copy = offline_model(str(name))  # a hub id of an offline model (make setup installs it)
        if copy is not None:
            log.warning("adapter %s: its base %s is loaded from the offline copy %s (%s)", folder, name, copy,
                        (hub_id(copy, note=True) or "").partition("(")[2].rstrip(")"))
            return AdapterSource(folder, str(copy), str(name), config)
    if looks_like_path or (_offline() and not _hub_cached(str(name))):
        where = "no such folder" if looks_like_path else "not a local folder and not in the Hugging Face cache (HF_HUB_OFFLINE=1)"
        raise TaskError(f"the base model of adapter {model!r}, {str(name)!r} ({option}), is not available offline ({where}); "
                        "set task.options.base_model to a local copy of it (a save_pretrained folder) or its hub id")
    return AdapterSource(folder, str(name), str(name), config)


@torch.no_grad()
def load_adapter(model: nn.Module, source: AdapterSource) -> tuple[nn.Module, StartAdapter]:
    """``model`` (the base, as the task builds it) with the adapter's saved non-LoRA tensors put
    in place, and the adapter's LoRA factors set aside (module doc). The global RNG is untouched."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    try:
        with torch.random.fork_rng(devices=[]):  # PEFT initialises the layers it injects from the global RNG
            peft_model = PeftModel.from_pretrained(model, str(source.folder), is_trainable=False)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise TaskError(f"could not load the PEFT adapter {str(source.folder)!r} onto its base {source.base!r} ({first}); "
                        "is it an adapter of this base model?") from None
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scaling: dict[str, float] = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, LoraLayer) and "default" in getattr(module, "lora_A", {}):
            if getattr(module, "use_dora", {}).get("default", False):
                raise TaskError(f"adapter {str(source.folder)!r}: layer {name} is a DoRA layer; merge the adapter first")
            factors[name] = (module.lora_B["default"].weight.detach().float().cpu().clone(),
                             module.lora_A["default"].weight.detach().float().cpu().clone())
            scaling[name] = float(module.scaling["default"])
    if not factors:
        raise TaskError(f"adapter {str(source.folder)!r} adapts no layer of its base {source.base!r}")
    plain = peft_model.unload()  # the base weights untouched; modules_to_save copies and trained biases in place
    plain.eval()
    return plain, StartAdapter(source, factors, scaling)
