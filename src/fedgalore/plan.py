"""Traffic and memory plan of a pipeline, without training it (docs/scale-out.md; benchmarks/RESULTS.md §9.3).

``fedgalore plan --config PIPELINE.yaml`` says, before a run, how many bytes each method moves
per round and how much host RAM and accelerator memory each component of a run takes at its
peak.

**Bytes, exactly from shapes and payload types.** A payload's serialised size is a function of
its tensors' shapes and dtypes only: safetensors writes an 8-byte header length, a JSON header
(padded with spaces to a multiple of 8) and the raw tensor bytes (``protocol/payload.py``). The
plan obtains each method's payload *types* by running the method's own code once on a **shape
miniature** of the model: a module tree with the real parameter names in which every distinct
dimension ``d`` becomes a small distinct ``d'`` (order-preserving, so every matrix keeps its
orientation and its GaLore projection side) and the rank ``r`` becomes ``r' = 3``. The miniature
federation (one client, two rounds: round 0 has no synchronised state, later rounds have)
records every serialised payload; each tensor's shape is mapped back ``d' → d``, ``r' → r``, and
the header is rebuilt with the real shapes and offsets. A GaLore client's upload carries one term
per projector refresh, ``q = ⌈T/τ⌉`` for ``T`` optimizer steps (:func:`fedgalore.federated.client.
optimizer_steps`) — the miniature reproduces ``q`` with ``τ' = 1`` and ``T' = q``. Tensor bytes
are exact; a real run's headers differ only in the decimal digits of metadata floats (losses):
a few bytes per message. (A miniature step trains on a few numbers; nothing at the real size is
built, loaded or trained.)

**Memory per component** (bytes at the real size): model weights ``W`` (task dtype), trained
parameters = gradients ``G``, optimizer state at its largest step ``O``, server state ``S``
(after a synchronised round), broadcast and upload blobs ``B``, ``U`` — all from the miniature,
mapped back (exact); the training activations of one micro-batch ``A`` and the evaluation
key/value cache ``KV`` from formulas (:func:`activation_bytes`, :func:`kv_cache_bytes`) whose
coefficients are fitted on measured runs (``benchmarks/memory_scaling.py``). The peaks per phase
follow how the current code composes them (sequential backend; see :func:`memory_plan`).

**The machine it judges.** The verdict "fits" compares the peaks with the memory of the machine
the plan runs on (:func:`detect_machine`: the CUDA devices torch sees and their memory, the host's
``MemAvailable``), unless the caller names another machine (``--gpu-gib`` / ``--host-gib``;
:func:`usable_memory`). A config with ``device=cuda`` planned where torch sees no CUDA device
does not fit here ("no CUDA here") unless a GPU size is given. Nothing at the real size is
loaded: causal LMs (and the generic ``causal_lm`` task) are planned from their config on the
``meta`` device; the plan says which model and data it could not find here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.stages.privacy_ledger import client_signal, privacy_plan
from fedgalore.federated.client import optimizer_steps
from fedgalore.methods.base import MethodOptions, method_class, parse_options, split_options
from fedgalore.methods.fedgalore import FedGaLoreOptions
from fedgalore.protocol.payload import dump_header_json, dump_safetensors_header
from fedgalore.tasks.base import ArrayDataset, Task, TaskError, head_parameters, resolve_target_modules
from fedgalore.report.tables import format_count

__all__ = [
    "PlanError",
    "ModelSpec",
    "KNOWN_MODELS",
    "model_spec",
    "real_blob_size",
    "probe_method",
    "activation_bytes",
    "kv_cache_bytes",
    "memory_plan",
    "make_plan",
    "format_plan",
    "format_privacy_plan",
    "host_memory",
    "detect_machine",
    "usable_memory",
    "fit_verdict",
]

#: hub models whose config the plan knows without the hub (transformers ``LlamaConfig`` fields)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                     max_position_embeddings=4096, tie_word_embeddings=False),
}
#: training-set sizes of hub data sets (examples) for the step count when the data is not local
KNOWN_DATASETS: dict[str, int] = {"meta-math/MetaMathQA": 395_000}

R_MINI = 3
D_MINI_BASE = 64
GIB = 1024**3


class PlanError(ConfigError):
    """The plan cannot be made (unknown model config, a payload with an unmapped dimension)."""


# ============================================================================ model shapes
@dataclass
class ModelSpec:
    """Parameter names/shapes of a task's model (no weights), its adapted modules and heads."""

    params: list[tuple[str, tuple[int, ...]]]
    targets: list[str]  # module names of the adapted nn.Linear layers
    heads: list[str]  # parameter names every method trains fully
    dtype: torch.dtype
    arch: dict[str, Any] = field(default_factory=dict)  # causal LM geometry (activations, KV cache)
    source: str = ""
    #: ``task.options.quantization`` (4bit | 8bit; None: none) and the weights it quantises (every
    #: nn.Linear's except the head and lm_head: fedgalore.tasks.quantize)
    quantization: str | None = None
    quantizable: list[str] = field(default_factory=list)

    def bytes(self) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(int(np.prod(s)) for _, s in self.params) * size


def _causal_lm_config(model_id: str):
    """(config, where it came from) of ``model_id``: a local folder's ``config.json``, else the
    Hugging Face cache (no network), else :data:`KNOWN_MODELS`; one-line :class:`PlanError` otherwise."""
    from transformers import AutoConfig, LlamaConfig

    path = Path(str(model_id)).expanduser()
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path), str(path)
    if not path.is_absolute() and not str(model_id).startswith((".", "~")) and str(model_id).count("/") == 1:
        try:  # a hub id whose config is cached (local_files_only: no hub lookup, no retries)
            return AutoConfig.from_pretrained(str(model_id), local_files_only=True), f"{model_id} (config from the Hugging Face cache)"
        except (OSError, ValueError):
            pass
    if model_id in KNOWN_MODELS:
        return (LlamaConfig(**{k: v for k, v in KNOWN_MODELS[model_id].items() if k != "model_type"}),
                f"{model_id} (not here — no local folder, not in the Hugging Face cache: planned from fedgalore's built-in config)")
    raise PlanError(f"plan: no config for model {model_id!r} here (no hub); set task.options.model to a local folder "
                    f"with config.json (known without the hub: {', '.join(KNOWN_MODELS)})")


def _arch(config: Any, tokens: int, causal: bool, max_new_tokens: int = 0, checkpointing: bool = False) -> dict[str, Any]:
    """The geometry :func:`activation_bytes` and :func:`kv_cache_bytes` read from a transformers
    config (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``;
    ``{"causal_lm": causal}`` alone when the config lacks one of them: activations not modelled)."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    if config is None or not all(isinstance(getattr(config, k, None), int) for k in need) or tokens <= 0:
        return {"causal_lm": causal}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"causal_lm": causal, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "intermediate": config.intermediate_size, "vocab": int(getattr(config, "vocab_size", 0) or 0) if causal else 0,
            "kv_dim": kv_heads * head_dim, "heads": heads, "max_length": int(tokens), "max_new_tokens": int(max_new_tokens),
            "gradient_checkpointing": bool(checkpointing),
            "attention": getattr(config, "_attn_implementation", None) or "sdpa"}


def _task_tokens(task: Task, model: nn.Module) -> int:
    """Tokens per example of a non-LM task: its ``max_length`` (text; rows are padded to at most
    it) or ``seq_len``, else a ViT's patches + 1 (``(image_size / patch_size)²`` + [CLS]); 0 unknown."""
    for key in ("max_length", "seq_len"):
        v = getattr(task, key, None)
        if isinstance(v, int) and v > 0:
            return v
    config = getattr(model, "config", None)
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch > 0:
        return (size // patch) ** 2 + 1
    return 0


def model_spec(cfg: FederatedConfig) -> tuple[ModelSpec, Task | None]:
    """The model's shapes and geometry (``arch``: :func:`_arch`). Causal-LM tasks: from the model
    config on the ``meta`` device — ``metamath`` / ``offline_math`` without weights, data or hub
    (:data:`KNOWN_MODELS`); the generic ``causal_lm`` reads its files and tokenizer (the clients'
    split) but never its weights; other tasks: the task's own model (the offline tasks build small
    models). Returns the spec and the task when one was built."""
    from fedgalore.tasks import TASKS, get_task

    name, opts = cfg.task.name, dict(cfg.task.options)
    if name in ("metamath", "offline_math"):
        from transformers import AutoModelForCausalLM

        from fedgalore.tasks.assets import smollm2_path
        from fedgalore.tasks.paper_math.base import LLAMA_TARGET_MODULES, torch_dtype

        model_id = opts.get("model") or ("meta-llama/Llama-2-7b-hf" if name == "metamath" else str(smollm2_path()))
        config, source = _causal_lm_config(model_id)
        dtype = torch_dtype(opts.get("dtype", "bfloat16")) if name == "metamath" else torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        targets = resolve_target_modules(model, LLAMA_TARGET_MODULES)
        params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        quant = opts.get("quantization") or ("4bit" if opts.get("load_in_4bit") else None)
        arch = _arch(model.config, int(opts.get("max_length", 1024 if name == "metamath" else 160)), True,
                     int(opts.get("max_new_tokens", opts.get("eval_max_new_tokens", 512 if name == "metamath" else 96))),
                     bool(opts.get("gradient_checkpointing", False)))
        return ModelSpec(params, targets, [], dtype, arch, source, quant, _quantizable(model, ()) if quant else []), None
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}")
    quant = opts.pop("quantization", None)  # planned from the dense model: quantising needs a CUDA GPU
    task = get_task(name, **opts)
    if name == "causal_lm":  # the generic causal LM: its files and tokenizer are read, its weights never loaded
        from transformers import AutoModelForCausalLM

        from fedgalore.tasks.generic.architectures import load_config, skeleton

        config = load_config(task.model_id)
        model = skeleton(AutoModelForCausalLM, config).to(task.dtype)  # meta device: shapes only
        targets = resolve_target_modules(model, task.target_modules)
        params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        arch = _arch(model.config, int(task.max_length), True, int(task.max_new_tokens),
                     bool(getattr(task.options, "gradient_checkpointing", False)))
        return (ModelSpec(params, targets, [], task.dtype, arch, f"{task.model_id} (config only, no weights loaded)", quant,
                          _quantizable(model, ()) if quant else []), task)
    model = task.build_model()
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    head_params = head_parameters(model, task.head_modules)
    dtype = next(model.parameters()).dtype
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    arch = _arch(getattr(model, "config", None), _task_tokens(task, model), False)
    return (ModelSpec(params, targets, head_params, dtype, arch, f"task {name}", quant,
                      _quantizable(model, task.head_modules) if quant else []), task)


def _quantizable(model: nn.Module, heads: Sequence[str]) -> list[str]:
    """The weights bitsandbytes quantises: every ``nn.Linear``'s outside the head modules and ``lm_head``."""
    skip = tuple(heads) + ("lm_head",)
    return [f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not any(n == h or n.startswith(h + ".") for h in skip)]


def quantized_for(spec: ModelSpec, method: str) -> bool:
    """Whether a run of ``method`` holds ``spec``'s base quantised: only the methods that train LoRA
    adapters on a frozen base (the config check refuses the others)."""
    from fedgalore.methods.base import available_methods, method_class

    return bool(spec.quantization) and method in available_methods() and method_class(method).traits.explicit_adapters


def quantized_model_bytes(spec: ModelSpec) -> tuple[int, int]:
    """(bytes of the base weights as a run holds them with ``spec.quantization``, as dense ``spec.dtype``
    weights): quantised matrices (:func:`fedgalore.tasks.quantize.quantized_bytes`), the
    other tensors in fp32 (PEFT's ``prepare_model_for_kbit_training`` casts 16-bit ones up)."""
    from fedgalore.tasks.quantize import quantized_bytes

    size = torch.empty(0, dtype=spec.dtype).element_size()
    quant = set(spec.quantizable)
    dense = held = 0
    for n, shape in spec.params:
        numel = int(np.prod(shape))
        dense += numel * size
        held += quantized_bytes(shape, spec.quantization) if n in quant else numel * max(size, 4)
    return held, dense


# ============================================================================ the miniature
class DimMap:
    """Real dimension ↔ miniature dimension (distinct, order-preserving), rank ``r ↔ r'``."""

    def __init__(self, spec: ModelSpec, rank: int):
        dims = sorted({int(d) for _, s in spec.params for d in s})
        self.to_mini = {d: D_MINI_BASE + i for i, d in enumerate(dims)}
        self.to_real = {v: k for k, v in self.to_mini.items()}
        self.rank, self.r_mini = int(rank), min(R_MINI, int(rank))
        if self.r_mini in self.to_real:
            raise PlanError("internal: miniature rank collides with a miniature dimension")
        self.to_real_r = {self.r_mini: self.rank}

    def mini(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.to_mini[int(d)] for d in shape)

    def real(self, shape: Sequence[int], what: str = "tensor") -> tuple[int, ...]:
        out = []
        for d in shape:
            d = int(d)
            if d in self.to_real:
                out.append(self.to_real[d])
            elif d in self.to_real_r:
                out.append(self.to_real_r[d])
            elif d == 1:  # a singleton axis (e.g. a per-column weight (1, r)) stays 1
                out.append(1)
            else:
                raise PlanError(f"{what}: dimension {d} of the miniature maps to no model dimension or rank "
                                f"(shape {tuple(shape)}); the plan needs payload tensors shaped by (m, n, r)")
        return tuple(out)

    def real_bytes(self, t: torch.Tensor, what: str = "tensor") -> int:
        return math.prod(self.real(t.shape, what)) * t.element_size() if t.dim() else t.element_size()


class _Tree(nn.Module):
    pass


def _mini_model(spec: ModelSpec, dims: DimMap, seed: int = 0) -> nn.Module:
    """A module tree with the real parameter names and miniature shapes; adapted modules and
    2-D heads are ``nn.Linear`` (PEFT wraps them), everything else plain parameters."""
    root = _Tree()
    g = torch.Generator().manual_seed(seed)
    names = {n for n, _ in spec.params}
    linear = set(spec.targets) | {h.rsplit(".", 1)[0] for h in spec.heads if h.endswith(".weight")}

    def node(path: str) -> nn.Module:
        mod = root
        for part in path.split(".") if path else []:
            if not hasattr(mod, part):
                mod.add_module(part, _Tree())
            mod = getattr(mod, part)
        return mod

    shapes = dict(spec.params)
    for name, shape in spec.params:
        path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if path in linear:
            parent, _, last = path.rpartition(".")
            holder = node(parent)
            if not isinstance(getattr(holder, last, None), nn.Linear):
                out_f, in_f = dims.mini(shapes[path + ".weight"])
                lin = nn.Linear(in_f, out_f, bias=(path + ".bias") in names, dtype=spec.dtype)
                with torch.no_grad():
                    lin.weight.copy_(0.3 * torch.randn(lin.weight.shape, generator=g))
                    if lin.bias is not None:
                        lin.bias.zero_()
                holder.add_module(last, lin)
            continue
        holder = node(path)
        holder.register_parameter(leaf, nn.Parameter(0.3 * torch.randn(dims.mini(shape), generator=g).to(spec.dtype)))
    return root


class _ProbeTask(Task):
    """Drives the miniature: one synthetic loss that reaches every adapted module and head."""

    name = "plan_probe"
    primary_metric = "loss"
    higher_is_better = False
    peft_task_type = None

    def __init__(self, spec: ModelSpec, dims: DimMap, n_examples: int):
        self.spec, self.dims = spec, dims
        self.target_modules = tuple(spec.targets)
        self.head_modules = tuple(sorted({h.rsplit(".", 1)[0] for h in spec.heads}))
        self._linears = list(spec.targets) + [h for h in self.head_modules if (h + ".weight") in dict(spec.params)]
        self._data = ArrayDataset({"i": torch.arange(max(int(n_examples), 1))})

    def build_model(self) -> nn.Module:
        return _mini_model(self.spec, self.dims)

    def train_set(self):
        return self._data

    def test_set(self):
        return ArrayDataset({"i": torch.arange(1)})

    def partition_labels(self) -> np.ndarray:
        return np.zeros(len(self._data), dtype=np.int64)

    def collate(self, examples):
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mods = dict(model.named_modules())
        g = torch.Generator().manual_seed(int(batch["i"][0]))
        total = torch.zeros((), dtype=torch.float32)
        for path in self._linears:
            mod = mods.get(path) or next(m for n, m in mods.items() if n.endswith("." + path))
            x = torch.randn(2, mod.in_features, generator=g).to(self.spec.dtype)
            total = total + mod(x).float().pow(2).mean()
        return total

    def evaluate(self, model, examples, batch_size):
        return {"loss": 0.0}


# ============================================================================ exact blob sizes


def _map_shapes(obj: Any, dims: DimMap) -> Any:
    if isinstance(obj, dict):
        return {k: (list(dims.real(v, "header shape")) if k == "shape" and isinstance(v, list) else _map_shapes(v, dims))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_shapes(v, dims) for v in obj]
    return obj


def real_blob_size(blob: bytes, dims: DimMap) -> tuple[int, int]:
    """``(total bytes, tensor bytes)`` of the real-size payload whose miniature is ``blob``.

    Every tensor's shape is mapped back, data offsets are recomputed in the file's order, shape
    fields of the fedgalore entry specs are mapped, and the header is re-serialised exactly as
    safetensors and :func:`fedgalore.protocol.payload.encode` write it (checked on the blob)."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    if dump_safetensors_header(header) != blob[8 : 8 + n]:
        raise PlanError("the safetensors header format is not the one the plan rebuilds; update fedgalore.protocol.payload.dump_safetensors_header")
    meta = dict(header.get("__metadata__", {}))
    if "fedgalore" in meta:
        spec = json.loads(meta["fedgalore"])
        if dump_header_json(spec) != meta["fedgalore"]:
            raise PlanError("the payload header is not fedgalore.protocol.payload.dump_header_json's; update fedgalore.plan.real_blob_size")
        meta["fedgalore"] = dump_header_json(_map_shapes(spec, dims))
    out: dict[str, Any] = {}
    if "__metadata__" in header:
        out["__metadata__"] = meta
    tensors = [(k, v) for k, v in header.items() if k != "__metadata__"]
    sizes = {}
    for k, v in tensors:
        itemsize = (v["data_offsets"][1] - v["data_offsets"][0]) // max(int(np.prod(v["shape"], dtype=np.int64)), 1) if v["shape"] else (
            v["data_offsets"][1] - v["data_offsets"][0])
        shape = list(dims.real(v["shape"], k))
        sizes[k] = (shape, int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize)
    offset, offsets = 0, {}
    for k, v in sorted(tensors, key=lambda kv: kv[1]["data_offsets"][0]):
        offsets[k] = [offset, offset + sizes[k][1]]
        offset += sizes[k][1]
    for k, v in tensors:
        out[k] = {**v, "shape": sizes[k][0], "data_offsets": offsets[k]}
    return 8 + len(dump_safetensors_header(out)) + offset, offset


def _tensors(obj: Any, seen: set | None = None) -> Iterable[torch.Tensor]:
    """Every tensor inside nested dicts/lists/tuples/dataclasses (a tensor held twice once; views
    at different places of one storage each — GaLoreAdamW keeps each matrix's moments as a view of
    its bucket's stack, fedgalore.optim.bucket)."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        key = (obj.data_ptr(), tuple(obj.shape), obj.stride()) if obj.numel() else id(obj)
        if key not in seen:
            seen.add(key)
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)


# ============================================================================ probe
@dataclass
class Probe:
    """One method's payloads and state sizes at the real size (bytes)."""

    method: str
    refreshes: list[int]  # GaLore terms per round of each miniature client (q); [0, ...] for other methods
    down_first: int  # broadcast of round 0 (no synchronised state yet)
    down: int  # broadcast of a later round
    up: int  # the largest client upload
    down_first_tensor_bytes: int
    down_tensor_bytes: int
    up_tensor_bytes: int
    up_by_refreshes: dict[int, tuple[int, int]]  # q -> (upload bytes, tensor bytes)
    server_state: int
    optimizer_state: int  # largest over the client's steps
    trained: int  # bytes of the parameters the client trains (= their gradients)
    model: int  # all model parameters, adapters included
    optimizers: list[str] = field(default_factory=list)  # optimizer classes the clients built
    #: q -> d, the coordinates of a client's upload change at the real size (second moments excluded):
    #: what client-level DP clips and noises (fedgalore.privacy.signal)
    up_coordinates_by_refreshes: dict[int, int] = field(default_factory=dict)


def _method_setting(cfg: FederatedConfig, method: str, options: dict[str, Any]) -> tuple[dict[str, Any], MethodOptions]:
    """The options of ``method`` in the pool ``options`` and their parsed dataclass."""
    kept, _ = split_options(method, options)
    return kept, parse_options(method, kept, cfg.method.rank)


def probe_method(cfg: FederatedConfig, spec: ModelSpec, method: str, options: dict[str, Any] | None = None,
                 refreshes: Sequence[int] = (1, 1)) -> Probe:
    """Run ``method`` on the shape miniature — one client per entry of ``refreshes`` (GaLore
    methods: client ``j`` makes ``refreshes[j]`` refreshes a round, i.e. that many steps at
    ``τ' = 1``; at least two clients when the federation has two, so clients whose bases differ
    are synchronised on a consensus basis as in the real run), two rounds — and map its payloads,
    server state and optimizer state back to the real size (module doc)."""
    from fedgalore.engine.loop import Federation

    opts, parsed = _method_setting(cfg, method, dict(cfg.method.options if options is None else options))
    traits = method_class(method).traits
    galore = traits.upload_follows_steps  # one update term per projector refresh (FedGaLore)
    if traits.downlink == "factored":
        # the plan's downlink is the dense model: what a client that holds no recent version gets, the
        # most any client gets; the factored downlink's bytes depend on who was sampled when
        # (benchmarks/downlink_bytes.py measures them)
        opts = {**opts, "downlink": "dense"}
    dims = DimMap(spec, cfg.method.rank)
    if galore:
        # one refresh per step: client j's record has refreshes[j] terms, as galore_terms counts them for the real
        # run -- steps schedule: the first adaptive_proj_steps data-driven; epoch / share schedules: all but the
        # last data-driven (the switch to R_k at the miniature's last step: adaptive_epochs 1 of its one epoch)
        opts = {**opts, "update_proj_gap": 1}
        if parsed.projector_schedule != "steps":
            opts.update(projector_schedule="epoch", adaptive_epochs=1.0)
        if isinstance(opts.get("joint_rank"), int):
            opts["joint_rank"] = min(int(opts["joint_rank"]), dims.r_mini)
    sizes = [max(int(q), 1) if galore else 1 for q in refreshes]
    data = cfg.to_dict()
    data.update({
        "name": "plan_probe",
        "method": {"name": method, "rank": dims.r_mini, "options": opts},
        "federation": {"num_clients": len(sizes), "clients_per_round": None, "rounds": 2, "eval_every": 2, "min_clients": 1,
                       "partition": {"kind": "iid"}},
        "backend": {"name": "sequential", "options": {}},
        "device": "cpu",
        "diagnostics": False,
    })
    # one process: the miniature's payloads and state do not depend on the site's devices (memory_plan counts them)
    data["train"] = {**data["train"], "batch_size": 1, "grad_accum_steps": 1, "local_steps": None, "local_epochs": 1,
                     "devices_per_client": 1, "shard_params": False}
    if cfg.privacy.client is not None and len(set(sizes)) == 1:  # client-level DP: fixed steps (one epoch of n rows, the same)
        data["train"]["local_steps"] = sizes[0]
    data["output"] = {**data.get("output", {}), "checkpoint_every": 100, "keep_checkpoints": 1, "progress": "quiet"}
    # the miniature is dense and on the CPU (a quantised base is counted by memory_plan); it keeps no adapters
    data["task"] = {**data["task"], "options": {k: v for k, v in (data["task"].get("options") or {}).items()
                                                if k not in ("quantization", "load_in_4bit")}}
    data["export"] = {}
    if data.get("privacy", {}).get("sites_dir"):  # the miniature releases nothing on the sites: no line in their ledgers
        data["privacy"] = {**data["privacy"], "sites_dir": None}
    probe_cfg = FederatedConfig.from_dict(data)
    task = _ProbeTask(spec, dims, sum(sizes))
    tmp = Path(tempfile.mkdtemp(prefix="fedgalore-plan-"))
    records: list[tuple[int, str, bytes]] = []
    opt_peak = [0]
    opt_kinds: set[str] = set()

    def on_step(optimizer, *_):
        opt_kinds.add(type(optimizer).__name__)
        opt_peak[0] = max(opt_peak[0], sum(dims.real_bytes(t, "optimizer state") for t in _tensors(dict(optimizer.state))))

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(on_step)
    try:
        fed = Federation(probe_cfg, run_dir=tmp / "run", task=task)
        # client j holds sizes[j] examples: one step (one refresh at τ' = 1) per example
        bounds = np.cumsum([0] + sizes)
        fed.runtime.parts = [np.arange(bounds[j], bounds[j + 1]) for j in range(len(sizes))]
        record = fed.ledger.record

        def capture(round_idx, client, direction, payload, blob=None):
            from fedgalore.protocol.payload import encode

            records.append((int(round_idx), int(client), direction, blob if isinstance(blob, bytes) else encode(payload)))
            return record(round_idx, client, direction, payload, blob)

        fed.ledger.record = capture  # type: ignore[method-assign]
        fed.run()
        model = fed.runtime.model
        trained = sum(dims.real_bytes(p, "parameter") for p in model.parameters() if p.requires_grad)
        model_bytes = sum(dims.real_bytes(p, "parameter") for p in _tensors(list(model.parameters())))
        state_bytes = sum(dims.real_bytes(t, "server state") for t in _tensors(
            [fed.state.params, fed.state.extras, getattr(fed.state, "moments", {})]))
    finally:
        handle.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    real = {(r, c, d): real_blob_size(b, dims) for r, c, d, b in records}
    rounds = sorted({r for r, _, _ in real})
    first, last = rounds[0], rounds[-1]
    down_first, down = real[(first, 0, "down")], real[(last, 0, "down")]
    ups = {(sizes[c] if galore else 0): real[(last, c, "up")] for c in range(len(sizes))}
    coords = {(sizes[c] if galore else 0): _upload_coordinates(b, dims) for r, c, d, b in records if r == last and d == "up"}
    largest = max(ups.values())
    return Probe(
        method=method, refreshes=sizes if galore else [0] * len(sizes),
        down_first=down_first[0], down=down[0], up=largest[0],
        down_first_tensor_bytes=down_first[1], down_tensor_bytes=down[1], up_tensor_bytes=largest[1], up_by_refreshes=ups,
        optimizers=sorted(opt_kinds), up_coordinates_by_refreshes=coords,
        server_state=state_bytes, optimizer_state=opt_peak[0], trained=trained, model=model_bytes,
    )


def _upload_coordinates(blob: bytes, dims: DimMap) -> int:
    """d of one miniature upload at the real size: every coordinate of its update and head entries
    (second moments, clipped apart, excluded) — what client-level DP clips and noises."""
    from fedgalore.privacy.client_dp import is_moment
    from fedgalore.protocol.payload import decode

    return sum(int(np.prod(dims.real(tuple(t.shape), key), dtype=np.int64))
               for key, e in decode(blob).entries.items() if not is_moment(key) for t in _tensors(e))


# ============================================================================ memory model
#: fitted on benchmarks/results/memory_scaling.json (four model sizes, CPU; see activation_bytes)
ACT_COEF = {"layer_values_bfloat16": 5.70, "layer_values_float32": 4.70, "checkpointed_per_layer_hidden": 1.0,
            "checkpointed_extra_hidden": 3.0, "logits_bytes_per_vocab_bfloat16": 3.87, "logits_bytes_per_vocab_float32": 4.23}


#: values per layer, head and (query, key) pair an eager attention keeps for the backward pass (the
#: softmax probabilities and the scores they came from): an estimate, not fitted; SDPA keeps none
EAGER_SCORE_VALUES = 2.0


def activation_bytes(arch: dict[str, Any], batch: int, tokens: int, dtype: torch.dtype, checkpointing: bool | None = None) -> int:
    """Training activations of one micro-batch of ``b = batch`` rows of ``s = tokens`` tokens (bytes):
    the autograd graph at the end of the forward pass, plus one layer recomputed with
    checkpointing. ``arch`` is the model config's geometry (:func:`_arch`): ``L`` layers, hidden
    size ``h``, MLP width ``i``, ``n_h`` attention heads, vocabulary ``V``; ``e`` bytes per value of
    the model dtype. Every task with such a config is counted — causal LMs (``s`` = the task's
    ``max_length``), encoders (text: ``max_length``; ViT: patches + 1)::

        A = b · s · (e · body + λ · V)  [+ b · L' · n_h · s² · 2 · e with an eager attention]

    * ``body`` per token, in values: without checkpointing ``a L (h + i)`` (``a`` per dtype: bf16
      keeps fp32 copies in norms and softmax); with checkpointing ``(c L + d) h + a (h + i)`` (every
      layer's input, the last hidden states and the layer being recomputed);
    * logits: ``λ V`` bytes per token, causal LMs only (a classifier's few outputs are negligible:
      ``V`` = 0);
    * attention scores: none with SDPA (transformers' default: flash / memory-efficient kernels keep
      no ``s × s`` matrix); an eager attention (``config._attn_implementation == "eager"``) keeps
      :data:`EAGER_SCORE_VALUES` values per head and (query, key) pair in each of ``L' = L`` layers
      (``L' = 1`` with checkpointing).

    Coefficients :data:`ACT_COEF` (``a, c, d, λ``) are fitted on measured CPU runs of decoders at ≤
    128 tokens (``benchmarks/memory_scaling.py``); for encoders the same per-layer values are an
    estimate. Linear in ``b · s`` apart from the eager term. 0 when the model has no such config
    (not modelled).
    """
    if not arch.get("layers") or batch <= 0 or tokens <= 0:
        return 0
    size = torch.empty(0, dtype=dtype).element_size()
    name = str(dtype).replace("torch.", "")
    a = ACT_COEF.get(f"layer_values_{name}", ACT_COEF["layer_values_bfloat16"])
    layer = a * (arch["hidden"] + arch["intermediate"])
    ckpt = arch.get("gradient_checkpointing", False) if checkpointing is None else checkpointing
    if ckpt:
        body = (ACT_COEF["checkpointed_per_layer_hidden"] * arch["layers"] + ACT_COEF["checkpointed_extra_hidden"]) * arch["hidden"] + layer
    else:
        body = layer * arch["layers"]
    logits = ACT_COEF.get(f"logits_bytes_per_vocab_{name}", 4.0) * arch.get("vocab", 0) if arch.get("causal_lm") else 0.0
    scores = 0.0
    if arch.get("attention") == "eager":
        scores = batch * (1 if ckpt else arch["layers"]) * arch.get("heads", 0) * tokens**2 * EAGER_SCORE_VALUES * size
    return int(batch * tokens * (body * size + logits) + scores)


def kv_cache_bytes(arch: dict[str, Any], batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Greedy generation's key/value cache: ``batch × tokens × layers × 2 × kv_dim`` values."""
    if not arch.get("causal_lm") or not arch.get("layers"):
        return 0
    size = torch.empty(0, dtype=dtype).element_size()
    return int(batch * tokens * arch["layers"] * 2 * arch["kv_dim"] * size)


def phase_peaks(c: dict[str, int], clients: int, on_host: bool, diagnostics: bool, dense_uploads: bool) -> dict[str, dict[str, int]]:
    """Memory per phase of one round from the components ``c`` (keys ``model W, gradients G,
    optimizer_state O, activations A, server_state S, broadcast_blob B, upload_blob U,
    eval_kv_cache KV``), as the current code holds them (sequential backend; measured on CPU by
    ``benchmarks/memory_scaling.py``). ``K`` = clients per round. Host (H) / accelerator (A):

    The server state ``S`` lives on the host whatever the model's device (``init_server_state``
    copies it there; measured on an H100 at 7B, benchmarks/RESULTS.md §10.1); the accelerator holds the model
    and what training and evaluation add to it.

    * broadcast (the client's copy, ``fedgalore.protocol.payload.transfer``): A ``W``; H ``S +
      B`` — the sequential backend hands the payload over in process, nothing is serialised (the
      ledger computes the encoded size);
    * client training (last client): A ``W + G + O + A + T`` (``T`` the optimizer step's
      temporaries: torch AdamW's foreach path allocates one more copy of the trained parameters,
      the single-tensor CPU path ~0.37 of them, measured; fused AdamW — FedAvg-Full on CUDA —
      none); H ``S + B`` (the client's copy of the broadcast, alive while it trains) ``+ (K−1)U``
      (earlier clients' uploads);
    * upload (last client): H ``S + B + (K−1)U`` ``+ U`` (its tensors) ``+ U`` (the server's copy);
    * aggregation: H ``S + KU`` (every upload) ``+ S`` (the dense applied update ``A`` returns,
      kept for the diagnostics); A ``W``;
    * diagnostics (``diagnostics: true``): H also every client's dense delta (``K S``; none when
      the uploads are dense deltas already) and their weighted mean while the drift is measured
      (``S``);
    * evaluation: A ``W + KV``; H whatever the round still holds (``S + KU + S`` and the clients'
      dense deltas: locals of the round);
    * checkpoint: streamed tensor by tensor (``CheckpointWriter``): H ``S`` plus one 64 MiB chunk,
      taken as 0.

    With ``on_host`` (``device=cpu``) both columns are one pool, reported as host."""
    W, G, O, A, S = c["model"], c["gradients"], c["optimizer_state"], c["activations"], c["server_state"]
    B, U, KV, K, T = c["broadcast_blob"], c["upload_blob"], c["eval_kv_cache"], clients, c.get("optimizer_step_transient", 0)
    deltas = K * S if diagnostics and not dense_uploads else 0
    held = S + K * U + S
    phases = {
        "broadcast": {"accelerator": W, "host": S + B},
        "client_training": {"accelerator": W + G + O + A + T, "host": S + B + (K - 1) * U},
        "upload": {"accelerator": W, "host": S + B + (K - 1) * U + 2 * U},
        "aggregation": {"accelerator": W, "host": held},
        "diagnostics": {"accelerator": W, "host": held + deltas + S},
        "evaluation": {"accelerator": W + KV, "host": held + deltas},
        "checkpoint": {"accelerator": W, "host": S},
    }
    if not diagnostics:
        del phases["diagnostics"]
    if on_host:
        phases = {k: {"accelerator": 0, "host": v["accelerator"] + v["host"]} for k, v in phases.items()}
    return phases


#: temporaries of one torch AdamW step, as a share of the trained parameters' bytes (measured:
#: foreach — CUDA's default — 1.0; the CPU single-tensor path 0.37); GaLoreAdamW works per matrix
ADAMW_STEP_TRANSIENT = {"foreach": 1.0, "cpu": 0.37, "fused": 0.0}  # FedAvg-Full runs AdamW(fused=True) on CUDA
#: host memory outside the components: Python, torch, the tokenizer and the tokenised data set
HOST_RUNTIME = 3 * GIB


def low_precision_bytes(cfg: FederatedConfig, spec: ModelSpec, probe: Probe) -> int:
    """What GaLoreAdamW keeps for bf16 / fp16 GaLore weights (the miniature runs in fp32 and has
    none): ``low_precision: compensated`` the rounding each step lost, in the weights' dtype (2
    bytes per entry of the adapted matrices); ``master`` an fp32 copy (4 bytes); ``off`` nothing."""
    if "GaLoreAdamW" not in probe.optimizers or spec.dtype not in (torch.bfloat16, torch.float16):
        return 0
    _, parsed = _method_setting(cfg, probe.method, dict(cfg.method.options))
    mode = getattr(parsed, "low_precision", "off")
    per = {"compensated": torch.empty(0, dtype=spec.dtype).element_size(), "master": 4}.get(mode, 0)
    shapes = dict(spec.params)
    return per * sum(int(np.prod(shapes[f"{t}.weight"])) for t in spec.targets)


def fsdp_units(spec: ModelSpec) -> tuple[int, int]:
    """Bytes of the weights a sharded site's rank holds gathered (:mod:`fedgalore.federated.sharded_site`):
    the root unit's (every parameter outside a ``ModuleList`` layer: embeddings, final norm, head —
    FSDP2 keeps the root gathered from forward to backward) and the largest layer's (a name's first
    ``.<index>.`` ends its layer)."""
    size = torch.empty(0, dtype=spec.dtype).element_size()
    units: dict[str, int] = {}
    root = 0
    for name, shape in spec.params:
        m = re.match(r"^(.*?\.\d+)\.", name)
        if m is None:
            root += int(np.prod(shape)) * size
        else:
            units[m.group(1)] = units.get(m.group(1), 0) + int(np.prod(shape)) * size
    return root, max(units.values(), default=0)


def site_training(c: dict[str, int], spec: ModelSpec, devices: int, shard: bool, activations_rank: int) -> dict[str, int]:
    """What one rank of a site with ``devices`` = N ≥ 2 devices holds while a client trains
    (``train.devices_per_client``; :mod:`fedgalore.federated.data_parallel`), from the components
    ``c`` (``W, G, O, T``) and the activations of its ``⌈b / N⌉`` rows (``A_r``):

    * data parallel: a whole replica, ``W + G + O + T + A_r``;
    * sharded (``train.shard_params``): ``(W + G + O + T) / N`` plus what is gathered at a time — the
      root unit and two layers (the running one and the prefetched next, FSDP2's default) with their
      unsharded gradients, ``(1 + G/W)(W_root + 2 W_layer)`` — plus ``A_r``. An estimate: blocks are
      taken as exactly ``1/N`` (they are ``⌈·/N⌉`` rows or columns), and GaLore's bases, which are
      whole on every rank, are counted as sharded (benchmarks/RESULTS.md §9.5: rank 0's optimizer state was 0.58
      of the whole at N = 2, not 0.50)."""
    W, G, O, T = c["model"], c["gradients"], c["optimizer_state"], c.get("optimizer_step_transient", 0)
    if not shard:
        return {"rank": W + G + O + T + activations_rank, "gathered": 0}
    root, layer = fsdp_units(spec)
    gathered = int((1 + G / max(W, 1)) * (root + 2 * layer))
    return {"rank": -(-(W + G + O + T) // devices) + gathered + activations_rank, "gathered": gathered}


def memory_plan(cfg: FederatedConfig, spec: ModelSpec, probe: Probe, clients_per_round: int) -> dict[str, Any]:
    """Components (bytes) and per-phase peaks (:func:`phase_peaks`) of one round of ``cfg``;
    the host column includes :data:`HOST_RUNTIME`. With ``train.devices_per_client`` N ≥ 2 the
    training phase is one rank's (:func:`site_training`; ``site`` in the result): on an accelerator
    rank 0's device, and a sharded client's whole model on the host besides; on the CPU all N ranks
    on the host."""
    tc = cfg.train
    a = spec.arch
    tokens = int(a.get("max_length", 0))
    model = probe.model
    if quantized_for(spec, probe.method):  # the frozen base quantised: its dense bytes out, the quantised ones in
        held, dense = quantized_model_bytes(spec)
        model = probe.model - dense + held
    comp = {"model": model, "gradients": probe.trained, "optimizer_state": probe.optimizer_state,
            "activations": activation_bytes(a, tc.batch_size, tokens, spec.dtype), "server_state": probe.server_state,
            "broadcast_blob": probe.down, "upload_blob": probe.up,
            "eval_kv_cache": kv_cache_bytes(a, cfg.federation.eval_batch_size, tokens + int(a.get("max_new_tokens", 0)), spec.dtype)}
    on_host = not (cfg.device.startswith("cuda") or cfg.device == "mps")
    if "AdamW" in probe.optimizers:  # torch's AdamW (GaLoreAdamW is a different class)
        comp["optimizer_step_transient"] = int(ADAMW_STEP_TRANSIENT["cpu" if on_host else "fused"] * probe.trained)
    comp["optimizer_state"] += low_precision_bytes(cfg, spec, probe)
    phases = phase_peaks(comp, clients_per_round, on_host, bool(cfg.diagnostics), method_class(probe.method).traits.uploads_dense_deltas)
    n_dev, shard = int(tc.devices_per_client), bool(tc.shard_params)
    site = None
    if n_dev > 1:  # a site with several devices: the training phase per rank (site_training)
        site = site_training(comp, spec, n_dev, shard, activation_bytes(a, -(-tc.batch_size // n_dev), tokens, spec.dtype))
        site.update(devices=n_dev, sharded=shard)
        train = phases["client_training"]
        whole = comp["model"] + comp["gradients"] + comp["optimizer_state"] + comp["activations"] + comp.get("optimizer_step_transient", 0)
        if on_host:  # every rank on this host; a sharded site's client process keeps the whole model besides
            train["host"] += n_dev * site["rank"] - whole + (comp["model"] if shard else 0)
        else:  # rank 0's device; a sharded client's whole model waits on the host
            train["accelerator"] += site["rank"] - whole
            train["host"] += comp["model"] if shard else 0
    for v in phases.values():
        v["host"] += HOST_RUNTIME
    return {"components": comp, "phases": phases, "site": site,
            "peak": {"accelerator": max(p["accelerator"] for p in phases.values()), "host": max(p["host"] for p in phases.values())},
            "peak_phase": {"accelerator": max(phases, key=lambda k: phases[k]["accelerator"]), "host": max(phases, key=lambda k: phases[k]["host"])}}


# ============================================================================ the machine
MEMINFO = Path("/proc/meminfo")
#: accelerator memory a run cannot use: the CUDA context and the caching allocator's slack (an 80 GB
#: GPU reports 79.1 GiB; about 78 GiB are usable)
CUDA_RESERVE = 1 * GIB


def host_memory(meminfo: Path = MEMINFO) -> dict[str, Any]:
    """This host's memory in bytes: ``total`` and ``available`` (what new processes can take
    without swapping) from ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``), else from
    ``os.sysconf`` (``SC_PHYS_PAGES``, ``SC_AVPHYS_PAGES`` × ``SC_PAGE_SIZE``: free pages, less
    than Linux's ``MemAvailable``); ``None`` each where neither answers. ``source`` says which."""
    try:
        fields = dict(re.findall(r"^(\w+):\s+(\d+) kB", meminfo.read_text(), flags=re.MULTILINE))
        total, avail = fields.get("MemTotal"), fields.get("MemAvailable") or fields.get("MemFree")
        if total is not None:
            return {"total": int(total) * 1024, "available": int(avail) * 1024 if avail else None, "source": str(meminfo)}
    except OSError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError):
            avail = None
        return {"total": int(total), "available": None if avail is None else int(avail), "source": "os.sysconf"}
    except (ValueError, OSError, AttributeError):
        return {"total": None, "available": None, "source": None}


def detect_machine() -> dict[str, Any]:
    """The devices and memory of the machine this process runs on: ``cuda`` — one entry per CUDA
    device torch sees (``index``, ``name``, ``total`` bytes from ``torch.cuda.get_device_properties``),
    ``[]`` without CUDA, with ``cuda_missing`` saying why (a torch built without CUDA, or no GPU
    visible); ``mps`` — whether Apple's MPS is available; ``host`` — :func:`host_memory`."""
    cuda: list[dict[str, Any]] = []
    missing = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            cuda.append({"index": i, "name": props.name, "total": int(props.total_memory)})
    else:
        missing = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
    mps = bool(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available())
    return {"cuda": cuda, "cuda_missing": missing, "mps": mps, "host": host_memory()}


def usable_memory(device: str, machine: dict[str, Any], gpu_gib: float | None = None, host_gib: float | None = None,
                  devices_per_client: int = 1) -> dict[str, Any]:
    """The memory a run of ``device`` may use, in bytes, and where each number came from.

    * host: ``host_gib`` GiB when given (``--host-gib``), else the detected ``available`` memory;
    * accelerator (``device`` cuda / cuda:N / mps; ``None`` for cpu): ``gpu_gib`` GiB when given
      (``--gpu-gib``), else the smallest total memory of the CUDA devices a client uses (``cuda:d …
      cuda:d+N−1`` for ``devices_per_client`` N) less :data:`CUDA_RESERVE`; for mps torch's
      ``recommended_max_memory``.

    ``problem`` (None when there is none): the device is not here — "no CUDA here", fewer CUDA
    devices than the config uses, "no MPS here" — and no ``gpu_gib`` names another machine; the
    verdict is then "does not fit" (:func:`fit_verdict`). ``note`` says the same when ``gpu_gib``
    overrides it."""
    for flag, v in (("--gpu-gib", gpu_gib), ("--host-gib", host_gib)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanError(f"{flag} {v!r}: give a positive number of GiB")
    host = machine.get("host") or {}
    out: dict[str, Any] = {"device": device, "on_host": not (device.startswith("cuda") or device == "mps"),
                           "accelerator": None, "accelerator_from": None, "problem": None, "note": None}
    if host_gib is not None:
        out["host"], out["host_from"] = int(host_gib * GIB), "--host-gib"
    elif host.get("available") is not None:
        out["host"], out["host_from"] = int(host["available"]), f"detected: available memory ({host.get('source')})"
    else:
        out["host"], out["host_from"] = None, "unknown here (pass --host-gib)"
    if out["on_host"]:
        return out
    problem, why, detected, detected_from = None, None, None, None
    if device.startswith("cuda"):
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        n = max(int(devices_per_client), 1)
        cuda = machine.get("cuda") or []
        if not cuda:
            problem, why = "no CUDA here", machine.get("cuda_missing")
        elif first + n > len(cuda):
            problem = (f"no {device} here" if n == 1 else f"no cuda:{first}..cuda:{first + n - 1} here") + \
                f" ({len(cuda)} CUDA device{'s' if len(cuda) != 1 else ''})"
        else:
            used = cuda[first:first + n]
            small = min(used, key=lambda d: d["total"])
            detected = max(small["total"] - CUDA_RESERVE, 0)
            detected_from = f"detected: cuda:{small['index']} {small['name']}, {small['total'] / GIB:.1f} GiB less {CUDA_RESERVE / GIB:g} GiB reserve"
    else:  # mps: unified memory
        if not machine.get("mps"):
            problem = "no MPS here"
        else:
            rec = getattr(getattr(torch, "mps", None), "recommended_max_memory", None)
            detected = int(rec()) if callable(rec) else None
            detected_from = "detected: torch.mps.recommended_max_memory" if detected else None
    if gpu_gib is not None:
        out["accelerator"], out["accelerator_from"] = int(gpu_gib * GIB), "--gpu-gib"
        out["note"] = f"{problem}: judged for a GPU of {gpu_gib:g} GiB (--gpu-gib)" if problem else None
    elif problem:
        out["problem"] = problem
        out["accelerator_from"] = problem + (f" ({why})" if why else "") + "; pass --gpu-gib X to judge for a machine with one"
    else:
        out["accelerator"] = detected
        out["accelerator_from"] = detected_from or "unknown here (pass --gpu-gib)"
    return out


def fit_verdict(peak: dict[str, int], usable: dict[str, Any]) -> dict[str, Any]:
    """Whether peaks ``peak`` (bytes: ``accelerator``, ``host``) fit ``usable``
    (:func:`usable_memory`): ``fits`` True / False / None (a memory unknown here) and ``reason``
    (one phrase; "" when it fits). The device missing here (``usable["problem"]``) does not fit."""
    if usable.get("problem"):
        return {"fits": False, "reason": usable["problem"]}
    why, unknown = [], []
    checks = [("host", peak["host"], usable.get("host"))]
    if not usable.get("on_host"):
        checks.insert(0, ("accelerator", peak["accelerator"], usable.get("accelerator")))
    for what, need, have in checks:
        if have is None:
            unknown.append(f"{what} memory unknown")
        elif need > have:
            why.append(f"{what} {need / GIB:.2f} > {have / GIB:.2f} GiB")
    if why:
        return {"fits": False, "reason": "; ".join(why)}
    if unknown:
        return {"fits": None, "reason": "; ".join(unknown)}
    return {"fits": True, "reason": ""}


# ============================================================================ the plan
def _client_sizes(cfg: FederatedConfig, task: Task | None, train_examples: int | None) -> list[int]:
    """Examples per client: the run's split (:func:`fedgalore.job.clients.split_clients`) when
    the task is built here, else an equal split of the training set (``train_examples``, the task's
    ``n_train`` or a known data set size)."""
    if task is not None and train_examples is None:
        from fedgalore.job.clients import split_clients

        return [len(p) for p in split_clients(cfg, task).parts]
    M = cfg.federation.num_clients
    if M is None:
        raise PlanError("plan: a natural partition's clients come from the data; plan it where the task is built "
                        "(without --train-examples), or set federation.num_clients")
    n = train_examples or cfg.task.options.get("n_train") or KNOWN_DATASETS.get(str(cfg.task.options.get("data", "meta-math/MetaMathQA")))
    if cfg.task.name == "offline_math" and n is None:
        n = 800
    if not n:
        raise PlanError("plan: the training-set size is unknown; pass --train-examples N")
    return [int(n) // M + (1 if i < int(n) % M else 0) for i in range(M)]


def galore_terms(n: int, cfg: FederatedConfig, options: FedGaLoreOptions) -> tuple[int, int]:
    """(data-driven, seeded) terms of the update record of a FedGaLore client with ``n`` examples:
    one per projector refresh. Steps schedule: ``q = ⌈T/τ⌉`` refreshes, the first
    ``adaptive_proj_steps`` data-driven for ``*_then_random`` (all data-driven for ``svd``/``rsvd``,
    all seeded for ``random``). Epoch / share schedules (``*_then_random``): refreshes at steps
    ``0, τ, 2τ, … < s`` (data-driven) and one at the switch ``s`` to ``R_k``
    (:func:`fedgalore.federated.client.epoch_switch_step`), ``⌈s/τ⌉`` and 1."""
    from fedgalore.federated.client import epoch_switch_step

    steps, tau, proj = _steps(n, cfg), options.update_proj_gap, options.projector
    if proj == "identity":
        return 1, 0
    if options.projector_schedule != "steps" and proj.endswith("_then_random") and options.adaptive_scope == "round":
        k = max(int(cfg.train.grad_accum_steps), 1)
        if options.projector_schedule == "epoch":
            switch = epoch_switch_step(n, cfg.train.batch_size, k, options.adaptive_epochs, steps)
        else:
            switch = max(0, min(math.ceil(options.adaptive_share * steps - 1e-9), steps - 1))
        return -(-switch // tau), 1
    q = max(-(-steps // tau), 1)
    if proj.endswith("_then_random"):
        dd = min(q, options.adaptive_proj_steps) if options.adaptive_scope == "round" else q
        return dd, q - dd
    return (0, q) if proj == "random" else (q, 0)


def _steps(n: int, cfg: FederatedConfig) -> int:
    """Optimizer steps of a client with ``n`` examples in one round."""
    tc = cfg.train
    if tc.local_steps is not None:
        return int(tc.local_steps)
    micro = int(math.ceil(float(tc.local_epochs) * n / tc.batch_size)) if n > 0 else 0
    return optimizer_steps(micro, tc.grad_accum_steps)


def _data_note(cfg: FederatedConfig, task: Task | None, train_examples: int | None, sizes: Sequence[int]) -> str | None:
    """Where the training-set size came from when the plan read no data (None when it did)."""
    if task is not None and train_examples is None:
        return None
    n = sum(sizes)
    if train_examples:
        return f"training set: {n:,} examples (--train-examples)"
    if cfg.task.options.get("n_train"):
        return f"training set: {n:,} examples (task.options.n_train)"
    data = str(cfg.task.options.get("data", "meta-math/MetaMathQA"))
    if data in KNOWN_DATASETS:
        return f"training set: {data} not read; its known size, {n:,} examples, assumed (--train-examples N to change)"
    return f"training set: not read; {n:,} examples assumed (--train-examples N to change)"


def make_plan(cfg: FederatedConfig, methods: Sequence[str] | None = None, method_options: dict[str, dict] | None = None,
              train_examples: int | None = None, machine: dict[str, Any] | None = None, gpu_gib: float | None = None,
              host_gib: float | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per-round bytes per method, the memory plan of ``cfg`` (see the module doc) and whether each
    method fits the machine: ``machine`` (:func:`detect_machine` of this one when None), or the
    GPU / host sizes ``gpu_gib`` / ``host_gib`` given instead (:func:`usable_memory`,
    :func:`fit_verdict`). ``progress`` (a callable taking one line) hears each step while the plan
    works (a miniature run per method: seconds each, more for models with many layers)."""
    say = progress or (lambda line: None)
    machine = detect_machine() if machine is None else machine
    if cfg.federation.site_ranks is not None:
        return _site_plan(cfg, methods, method_options, train_examples, machine, gpu_gib, host_gib, say)
    usable = usable_memory(cfg.device, machine, gpu_gib, host_gib, int(cfg.train.devices_per_client))
    say(f"plan: reading the model's shapes ({cfg.task.name}; no weights are loaded for causal LMs)")
    spec, task = model_spec(cfg)
    methods = list(methods or [cfg.method.name])
    sizes = _client_sizes(cfg, task, train_examples)
    M = len(sizes)
    K = cfg.federation.clients_per_round or M
    out: dict[str, Any] = {"config": cfg.name, "model": spec.source, "dtype": str(spec.dtype).replace("torch.", ""),
                           "quantization": spec.quantization,
                           "params": sum(int(np.prod(s)) for _, s in spec.params), "targets": len(spec.targets),
                           "clients": M, "clients_per_round": K, "rounds": cfg.federation.rounds, "device": cfg.device,
                           "client_examples": sizes, "data_note": _data_note(cfg, task, train_examples, sizes),
                           "activations_modelled": bool(spec.arch.get("layers")),
                           "machine": machine, "usable": usable, "methods": {}}
    out["privacy"] = privacy_plan(cfg, sizes, lambda n: _steps(n, cfg))  # the ε privacy.record will spend (or none)
    for i, method in enumerate(methods):
        say(f"plan: {method} ({i + 1}/{len(methods)}): running its miniature ({len(spec.targets)} adapted matrices)")
        options = {**dict(cfg.method.options), **dict((method_options or {}).get(method, {}))}
        _, parsed = _method_setting(cfg, method, options)
        galore = method_class(method).traits.upload_follows_steps  # one update term per projector refresh
        terms = [galore_terms(n, cfg, parsed) if galore else (0, 0) for n in sizes]  # (data-driven, seeded) per client
        qs = [max(d + sd, 1) if galore else 0 for d, sd in terms]
        distinct = sorted(set(qs))
        clients = distinct if len(distinct) >= 2 or K == 1 else distinct * 2
        base = probe_method(cfg, spec, method, options, clients)
        up = [base.up_by_refreshes[q][0] for q in qs]
        up_mean = sum(up) / M
        per_round_down, per_round_up = K * base.down, K * up_mean
        total = K * base.down_first + K * up_mean + (cfg.federation.rounds - 1) * (per_round_down + per_round_up)
        mem = memory_plan(cfg, spec, base, K)
        out["methods"][method] = {
            "refreshes_per_round": distinct if galore else None,
            "data_driven_terms_per_round": sorted({d for d, _ in terms}) if galore else None,
            "up_by_client": up, "up_tensor_bytes_by_client": [base.up_by_refreshes[q][1] for q in qs],
            "down_per_client": base.down, "down_per_client_round0": base.down_first, "up_per_client": up_mean,
            "per_round": {"down": per_round_down, "up": per_round_up}, "run_total": total,
            "probe": dataclasses.asdict(base), "memory": mem, "quantized_base": quantized_for(spec, method),
            "fit": fit_verdict(mem["peak"], usable),
        }
        if cfg.privacy.client is not None:  # the noise against the signal, before any round is paid for
            dim = max(base.up_coordinates_by_refreshes.get(q, 0) for q in set(qs)) if base.up_coordinates_by_refreshes else 0
            signal = client_signal(cfg, method, parsed, M, dim) if dim else None
            out["methods"][method]["client_dp_signal"] = dataclasses.asdict(signal) if signal is not None else None
            out["methods"][method]["client_dp_signal_line"] = signal.line() if signal is not None else None
    return out


def _site_plan(cfg: FederatedConfig, methods: Sequence[str] | None, method_options: dict[str, dict] | None,
               train_examples: int | None, machine: dict[str, Any], gpu_gib: float | None, host_gib: float | None,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The plan of a federation whose sites train at their own ranks (``federation.site_ranks``).

    Each distinct rank ``r`` is planned as a federation at rank ``r`` (:func:`make_plan`): what a
    site at ``r`` uploads, holds while it trains and needs at its peak. The downlink and the
    server are the same for every site — the broadcast at the largest rank (the frame: FedGaLore's
    synchronised state, FLoRA's merged W) — so they come from the largest rank's plan, which is also
    the plan's top level (the traffic table, the server's memory). Each tier is judged against its
    stated device (``tiers[].device_gb``: the accelerator under ``device: cuda``, the host under
    ``device: cpu``), else against the machine like the rest of the plan; ``sites`` lists, per
    method, every tier with its sites and verdict, and ``sites_not_fitting`` the sites that do not
    fit their device."""
    from fedgalore.federated.site_ranks import site_devices, site_ranks
    from fedgalore.methods.base import method_class

    probe_cfg = FederatedConfig.from_dict(cfg.to_dict())
    num, names = cfg.federation.num_clients, None
    if cfg.federation.site_ranks.named:  # sites by name: their ids come from the data's split
        from fedgalore.job.clients import split_clients

        task = model_spec(cfg)[1]
        if task is None:
            raise PlanError("plan: federation.site_ranks names sites by name, which the data's split gives; "
                            "plan it where the task's data is readable, or give the sites' client ids")
        clients = split_clients(cfg, task)
        num, names = len(clients.parts), clients.names
    elif num is None:  # a natural / files partition: the sites are known once the data is split
        num = len(_client_sizes(cfg, model_spec(cfg)[1], train_examples))
    ranks = site_ranks(cfg.federation.site_ranks, num, cfg.method.rank, names) or []
    devices = site_devices(cfg.federation.site_ranks, num)
    methods = list(methods or [cfg.method.name])
    for m in methods:
        why = method_class(m).site_ranks_problem(parse_options(m, split_options(m, {**dict(cfg.method.options), **dict(
            (method_options or {}).get(m, {}))})[0], cfg.method.rank), m)
        if why is not None:
            raise PlanError(why)
    probe_cfg.federation.site_ranks = None
    by_rank: dict[int, dict[str, Any]] = {}
    for r in sorted(set(ranks)):
        say(f"plan: sites at rank {r} ({ranks.count(r)} of {num})")
        probe_cfg.method.rank = r
        by_rank[r] = make_plan(probe_cfg, methods, method_options, train_examples, machine, gpu_gib, host_gib, say)
    top = by_rank[max(by_rank)]
    out = dict(top)
    out["site_ranks"] = ranks
    out["methods"] = {}
    not_fitting: dict[str, list[int]] = {}
    for m in methods:
        entry = dict(top["methods"][m])
        tiers = []
        for (r, dev) in sorted({(r, d) for r, d in zip(ranks, devices)}, key=lambda x: (x[0], x[1] or 0)):
            sub = by_rank[r]["methods"][m]
            sites = [c for c in range(num) if ranks[c] == r and devices[c] == dev]
            usable = (usable_memory(cfg.device, machine, dev if cfg.device != "cpu" else None,
                                    dev if cfg.device == "cpu" else host_gib, int(cfg.train.devices_per_client))
                      if dev is not None else by_rank[r]["usable"])
            verdict = fit_verdict(sub["memory"]["peak"], usable)
            up = sum(sub["up_by_client"][c] for c in sites) / len(sites)
            tiers.append({"rank": r, "sites": sites, "device_gb": dev, "up_per_client": up,
                          "down_per_client": top["methods"][m]["down_per_client"], "peak": sub["memory"]["peak"],
                          "peak_phase": sub["memory"]["peak_phase"], "optimizer_state": sub["memory"]["components"]["optimizer_state"],
                          "fit": verdict})
            if verdict["fits"] is False:
                not_fitting.setdefault(m, []).extend(sites)
        K = cfg.federation.clients_per_round or num
        up_mean = sum(t["up_per_client"] * len(t["sites"]) for t in tiers) / num
        entry["up_per_client"] = up_mean
        entry["up_by_client"] = [by_rank[ranks[c]]["methods"][m]["up_by_client"][c] for c in range(num)]
        entry["up_tensor_bytes_by_client"] = [by_rank[ranks[c]]["methods"][m]["up_tensor_bytes_by_client"][c] for c in range(num)]
        entry["per_round"] = {"down": entry["per_round"]["down"], "up": K * up_mean}
        entry["run_total"] = K * entry["down_per_client_round0"] + K * up_mean + (cfg.federation.rounds - 1) * (
            entry["per_round"]["down"] + K * up_mean)
        entry["sites"] = tiers
        out["methods"][m] = entry
    out["sites_not_fitting"] = {m: sorted(v) for m, v in not_fitting.items()}
    return out


def _site_lines(plan: dict[str, Any]) -> list[str]:
    """The plan's "Sites at their own ranks" section (:func:`_site_plan`)."""
    if "site_ranks" not in plan:
        return []
    lines = ["## Sites at their own ranks (federation.site_ranks; GiB)", "",
             "| method | rank | sites | device | up / client / round | down / client / round | optimizer state | "
             "peak accelerator | peak host | fits |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for m, r in plan["methods"].items():
        for t in r["sites"]:
            ids = t["sites"]
            span = (f"{ids[0]}–{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2
                    else ", ".join(map(str, ids)))
            v = t["fit"]
            fits = "yes" if v["fits"] else (f"**no**: {v['reason']}" if v["fits"] is False else f"unknown: {v['reason']}")
            dev = f"{t['device_gb']:g}" if t["device_gb"] is not None else "(this machine)"
            lines.append(f"| {m} | {t['rank']} | {span} ({len(ids)}) | {dev} | {_gib(t['up_per_client'])} | "
                         f"{_gib(t['down_per_client'])} | {_gib(t['optimizer_state'])} | "
                         f"{'–' if plan['device'] == 'cpu' else _gib(t['peak']['accelerator'])} | "
                         f"{_gib(t['peak']['host'])} | {fits} |")
    bad = plan.get("sites_not_fitting") or {}
    lines += [""] + (["Sites that do not fit their device: " + "; ".join(f"{m}: {', '.join(map(str, v))}" for m, v in bad.items()) + "."]
                     if bad else ["Every site fits its device."])
    return lines + [""]


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}" if x >= 0.01 * GIB else f"{x / 1024**2:.1f} MiB"


def _machine_lines(machine: dict[str, Any], usable: dict[str, Any]) -> list[str]:
    """The plan's "Machine" section: what was detected here and the numbers the verdict used."""
    cuda = machine.get("cuda") or []
    gpus = (", ".join(f"cuda:{d['index']} {d['name']} {d['total'] / GIB:.1f} GiB" for d in cuda) if cuda
            else "none" + (f" ({machine['cuda_missing']})" if machine.get("cuda_missing") else ""))
    host = machine.get("host") or {}
    hm = (f"{host['total'] / GIB:.1f} GiB total, " + (f"{host['available'] / GIB:.1f} GiB available" if host.get("available") is not None
          else "available unknown") + f" ({host.get('source')})") if host.get("total") else "unknown"
    acc = ("– (device cpu: one pool, the host's)" if usable.get("on_host") else
           f"**{usable['accelerator_from']}**" if usable.get("problem") else
           f"{usable['accelerator'] / GIB:.2f} GiB ({usable['accelerator_from']})" if usable.get("accelerator") is not None
           else str(usable.get("accelerator_from")))
    hu = f"{usable['host'] / GIB:.2f} GiB ({usable['host_from']})" if usable.get("host") is not None else str(usable.get("host_from"))
    lines = ["## Machine", "", f"Detected here: CUDA devices: {gpus}" + ("; MPS available" if machine.get("mps") else "") +
             f"; host memory: {hm}.", "", f"Judged against (device {usable.get('device')}): accelerator {acc}; host {hu}."]
    if usable.get("note"):
        lines[-1] += f" Note: {usable['note']}."
    return lines + [""]


def format_plan(plan: dict[str, Any], accelerator_gib: float | None = None, host_gib: float | None = None) -> str:
    """Markdown: traffic per method, the machine judged against, memory components and per-phase
    peaks, fit verdicts (:func:`fit_verdict`; ``accelerator_gib`` / ``host_gib`` re-judge for
    another machine's GiB)."""
    machine = plan.get("machine") or detect_machine()
    usable = plan.get("usable")
    if usable is None or accelerator_gib is not None or host_gib is not None:
        usable = usable_memory(plan["device"], machine, accelerator_gib, host_gib)
    quant = f", {plan['quantization']} base for the LoRA methods" if plan.get("quantization") else ""
    lines = [f"# Plan: {plan['config']} — {plan['model']} ({format_count(plan['params'])} params, {plan['dtype']}{quant}, "
             f"{plan['targets']} adapted matrices), {plan['clients_per_round']} of {plan['clients']} clients per round, "
             f"{plan['rounds']} rounds, device {plan['device']}", ""]
    if plan.get("data_note"):
        lines += [plan["data_note"][0].upper() + plan["data_note"][1:] + ".", ""]
    lines += ["## Traffic (bytes exactly from shapes and payload types; GiB)", "",
              "| method | GaLore terms per client round | down / client / round | up / client / round | per round (all clients) | run total |",
              "|---|---|---:|---:|---:|---:|"]
    for m, r in plan["methods"].items():
        q = "–" if not r["refreshes_per_round"] else ", ".join(map(str, r["refreshes_per_round"]))
        lines.append(f"| {m} | {q} | {_gib(r['down_per_client'])} | {_gib(r['up_per_client'])} | "
                     f"{_gib(r['per_round']['down'] + r['per_round']['up'])} | {_gib(r['run_total'])} |")
    lines += [""] + _site_lines(plan) + _machine_lines(machine, usable)
    lines += ["## Memory (GiB; peaks per phase as the current code holds them, fedgalore.plan.phase_peaks)", "",
              "| method | model | grads | optimizer | activations | server state | broadcast | upload | eval KV | "
              "peak accelerator (phase) | peak host (phase) | fits |", "|---|" + "---:|" * 10 + "---|"]
    for m, r in plan["methods"].items():
        c, pk = r["memory"]["components"], r["memory"]["peak"]
        on_host = usable["on_host"]
        v = fit_verdict(pk, usable)
        fits = "yes" if v["fits"] else (f"**no**: {v['reason']}" if v["fits"] is False else f"unknown: {v['reason']}")
        lines.append(f"| {m} | {_gib(c['model'])} | {_gib(c['gradients'])} | {_gib(c['optimizer_state'])} | {_gib(c['activations'])} | "
                     f"{_gib(c['server_state'])} | {_gib(c['broadcast_blob'])} | {_gib(c['upload_blob'])} | {_gib(c['eval_kv_cache'])} | "
                     f"{_gib(pk['accelerator']) + ' (' + r['memory']['peak_phase']['accelerator'].replace('_', ' ') + ')' if not on_host else '–'} | "
                     f"{_gib(pk['host'])} ({r['memory']['peak_phase']['host'].replace('_', ' ')}) | {fits} |")
    if plan.get("activations_modelled") is False:
        lines += ["", "Activations: not modelled for this model (no transformer config with layers, hidden and MLP sizes): "
                  "counted as 0."]
    sites = {m: r["memory"].get("site") for m, r in plan["methods"].items() if r["memory"].get("site")}
    if sites:
        first = next(iter(sites.values()))
        how = ("sharded (FSDP2: 1/N of weights, gradients and optimizer state per rank, plus what is gathered at a time)"
               if first["sharded"] else "data parallel (a whole replica per rank)")
        lines += ["", f"A site trains each client on {first['devices']} devices, {how}; the training phase above is per "
                  "rank (an estimate: fedgalore.plan.site_training): " + ", ".join(
                      f"{m} {_gib(v['rank'])}" + (f" ({_gib(v['gathered'])} gathered)" if v["sharded"] else "")
                      for m, v in sites.items()) + " GiB."]
    if "privacy" in plan:
        lines += [""] + format_privacy_plan(plan["privacy"])
        signals = [(m, r["client_dp_signal_line"]) for m, r in plan["methods"].items() if r.get("client_dp_signal_line")]
        lines += [f"{m}: {line}" if len(plan["methods"]) > 1 else line for m, line in signals]
    return "\n".join(lines) + "\n"


def _eps(x: float) -> str:
    return "∞" if not math.isfinite(x) else f"{x:.3g}"


def _client_plan_lines(cp: dict[str, Any] | None) -> list[str]:
    """The plan's lines for client-level DP (:func:`fedgalore.engine.stages.privacy_ledger.client_plan`)."""
    if not cp:
        return []
    if "error" in cp:
        return [f"Client-level DP: **a run refuses this config:** {cp['error']}", ""]
    how = (f"σ = {cp['noise_multiplier']:.4g} calibrated to ε = {cp['target_epsilon']:g}" if cp["target_epsilon"] is not None
           and cp["calibrated"] else f"σ = {cp['noise_multiplier']:g}")
    mom = f"; moments σ_m = {cp['moment_noise_multiplier']:.4g}, composed" if cp["moment_noise_multiplier"] is not None else ""
    cap = (f" The run stops before a round would take ε past {cp['target_epsilon']:g}."
           if cp["target_epsilon"] is not None else "")
    return [f"Client-level DP-FedAvg ({cp['noise']} noise, C = {cp['clip']:g}, {how}{mom}; {cp['sampled']} of "
            f"{cp['num_clients']} clients per round, replace-one, dp-accounting RDP, δ = {cp['delta']:g}): ε after round 1 "
            f"{_eps(cp['epsilon_first_round'])}, after all {cp['rounds']} rounds **{_eps(cp['epsilon_planned'])}**.{cap}", ""]


def format_privacy_plan(priv: dict[str, Any], max_rows: int = 12) -> list[str]:
    """The plan's privacy section (:func:`fedgalore.engine.stages.privacy_ledger.privacy_plan`): the ε(δ)
    each site will spend, before the run."""
    rec = priv.get("record")
    client = _client_plan_lines(priv.get("client"))
    if rec is None and client:
        return ["## Privacy", ""] + client
    if rec is None:
        return ["## Privacy", "", "None: no differential privacy (privacy.record and privacy.client unset) — nothing the "
                "sites upload is protected."]
    how = (f"σ calibrated per site to ε = {rec['target_epsilon']:g} over its "
           f"{'expected' if rec['calibration'] == 'expected' else 'every'} round(s)" if rec["target_epsilon"] is not None
           else f"σ = {rec['noise_multiplier']:g}")
    sites = priv["sites"]
    lines = [f"## Privacy (record-level DP-SGD at each site: C = {rec['max_grad_norm']:g}, {how}; Opacus "
             f"{rec['accountant'].upper()} accountant, Poisson sampling, δ = {rec['delta']:g})", "",
             f"ε per site if it takes part in its expected {priv['participation']:.3g} × {priv['rounds']} = "
             f"{priv['participation'] * priv['rounds']:.3g} rounds: up to **{_eps(priv['epsilon_planned_max'])}**; if it "
             f"takes part in every round: up to {_eps(priv['epsilon_every_round_max'])}.", ""]
    small = min((r["num_examples"] for r in sites if r["num_examples"] > 0), default=0)
    if small and rec["delta"] >= 1.0 / small:
        lines += [f"**A run refuses this config:** δ = {rec['delta']:g} is not below 1/n = {1.0 / small:.3g} for the smallest "
                  f"site ({small} examples).", ""]
    lines += ["| examples | sites | q | steps / round | σ | planned rounds | ε planned | ε every round |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shown = sites if len(sites) <= max_rows else sites[: max_rows // 2] + sites[-(max_rows // 2):]
    for i, r in enumerate(shown):
        if len(sites) > max_rows and i == max_rows // 2:
            lines.append(f"| … {len(sites) - max_rows} more sizes | | | | | | | |")
        lines.append(f"| {r['num_examples']} | {r['sites']} | {r['sample_rate']:.3g} | {r['steps_per_round']} | "
                     f"{r['noise_multiplier']:.3g} | {r['planned_rounds']:.3g} | {_eps(r['epsilon_planned'])} | "
                     f"{_eps(r['epsilon_every_round'])} |")
    return lines
