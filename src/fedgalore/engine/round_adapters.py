"""A small PEFT adapter of the global model after every round (``export.every_round: true``).

For the methods whose global model is the pretrained base plus LoRA adapters (FedIT, FFA-LoRA,
LoRA-FAIR: :attr:`~fedgalore.methods.traits.MethodTraits.explicit_adapters`) the round loop writes, after
each round's aggregation, ``<run dir>/adapters/round-NNNN/`` — ``adapter_config.json`` and
``adapter_model.safetensors`` in PEFT's own layout: the global ``(B, A)`` of every adapted module
and the head as ``modules_to_save`` — so any round loads with
``PeftModel.from_pretrained(base, "<run dir>/adapters/round-0003")`` on the same base as
``fedgalore export --format peft`` uses, and gives that round's global model. The config names the
base portably (:func:`~fedgalore.records.identity.base_model_name_for`). Each folder is written
beside its place and renamed into it (never half-written); a resumed run rewrites the rounds it
repeats. Cost: the adapters' bytes per round (a FedIT rank-8 adapter of MiniLM-L6: about 1 MiB).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fedgalore.records.identity import base_model_name_for
from fedgalore.protocol.state import ServerState

__all__ = ["ADAPTERS_DIR", "round_adapter_dir", "save_round_adapter"]

#: the folder of the per-round adapters inside a run directory
ADAPTERS_DIR = "adapters"


def round_adapter_dir(run_dir: str | Path, round: int) -> Path:  # noqa: A002
    """``<run_dir>/adapters/round-NNNN`` (1-based round)."""
    return Path(run_dir) / ADAPTERS_DIR / f"round-{int(round):04d}"


@torch.no_grad()
def save_round_adapter(runtime: Any, state: ServerState, run_dir: str | Path, round: int) -> Path:  # noqa: A002
    """Write the global model of ``state`` (after 1-based ``round``) as a PEFT adapter folder
    (module doc); returns the folder. The runtime's model is loaded with the global state, as
    the loop's evaluation loads it."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    method, task, model = runtime.method, runtime.task, runtime.model
    method.load_global(model, state)
    tensors: dict[str, torch.Tensor] = {}
    for t in runtime.target_modules:
        tensors[f"base_model.model.{t}.lora_A.weight"] = method.lora_a(model, t).detach().float().cpu().contiguous()
        tensors[f"base_model.model.{t}.lora_B.weight"] = method.lora_b(model, t).detach().float().cpu().contiguous()
    for n, p in method.head_params(model).items():
        tensors[f"base_model.model.{n}"] = p.detach().float().cpu().contiguous()
    heads = [h for h in task.head_modules if any(n == h or n.startswith(h + ".") for n in runtime.head_params)]
    name, _ = base_model_name_for(task, run_dir)
    config = LoraConfig(r=int(method.rank), lora_alpha=float(method.lora_alpha), lora_dropout=float(method.lora_dropout),
                        target_modules=list(runtime.target_modules), modules_to_save=heads or None, bias="none",
                        task_type=task.peft_task_type, base_model_name_or_path=name)
    out = round_adapter_dir(run_dir, round)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "fedgalore_round.json").write_text(json.dumps({"round": int(round), "method": method.name,
                                                              "base_model": name}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
