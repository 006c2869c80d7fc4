"""Traffic and memory plan of a pipeline, without training it (issue 18; docs/scale-out.md).

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
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.engine.config import ConfigError, FederatedConfig
from fedgalore.engine.privacy_ledger import privacy_plan
from fedgalore.federated.client import optimizer_steps
from fedgalore.methods.base import MethodOptions, parse_options, split_options
from fedgalore.methods.fedgalore import FedGaLoreOptions
from fedgalore.protocol.payload import dump_header_json, dump_safetensors_header
from fedgalore.tasks.base import ArrayDataset, Task, TaskError, head_parameters, resolve_target_modules

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
    from transformers import AutoConfig, LlamaConfig

    path = Path(str(model_id)).expanduser()
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path), str(path)
    if model_id in KNOWN_MODELS:
        return LlamaConfig(**{k: v for k, v in KNOWN_MODELS[model_id].items() if k != "model_type"}), f"{model_id} (built-in config)"
    raise PlanError(f"plan: no config for model {model_id!r} here (no hub); set task.options.model to a local folder "
                    f"with config.json (known without the hub: {', '.join(KNOWN_MODELS)})")


def model_spec(cfg: FederatedConfig) -> tuple[ModelSpec, Task | None]:
    """The model's shapes. Causal-LM tasks: from the model config on the ``meta`` device (no
    weights, no data, no hub for :data:`KNOWN_MODELS`); other tasks: the task's own model (the
    offline tasks build small models). Returns the spec and the task when one was built."""
    from fedgalore.tasks import TASKS, get_task

    name, opts = cfg.task.name, dict(cfg.task.options)
    if name in ("metamath", "offline_math"):
        from transformers import AutoModelForCausalLM

        from fedgalore.tasks.assets import smollm2_path
        from fedgalore.tasks.causal_lm.base import LLAMA_TARGET_MODULES, torch_dtype

        model_id = opts.get("model") or ("meta-llama/Llama-2-7b-hf" if name == "metamath" else str(smollm2_path()))
        config, source = _causal_lm_config(model_id)
        dtype = torch_dtype(opts.get("dtype", "bfloat16")) if name == "metamath" else torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        targets = resolve_target_modules(model, LLAMA_TARGET_MODULES)
        params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        quant = opts.get("quantization") or ("4bit" if opts.get("load_in_4bit") else None)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        arch = {"causal_lm": True, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                "intermediate": config.intermediate_size, "vocab": config.vocab_size, "kv_dim": kv_heads * head_dim,
                "heads": config.num_attention_heads,
                "max_length": int(opts.get("max_length", 1024 if name == "metamath" else 160)),
                "max_new_tokens": int(opts.get("max_new_tokens", opts.get("eval_max_new_tokens", 512 if name == "metamath" else 96))),
                "gradient_checkpointing": bool(opts.get("gradient_checkpointing", False))}
        return ModelSpec(params, targets, [], dtype, arch, source, quant, _quantizable(model, ()) if quant else []), None
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}")
    quant = opts.pop("quantization", None)  # planned from the dense model: quantising needs a CUDA GPU
    task = get_task(name, **opts)
    model = task.build_model()
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    head_params = head_parameters(model, task.head_modules)
    dtype = next(model.parameters()).dtype
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return (ModelSpec(params, targets, head_params, dtype, {"causal_lm": False}, f"task {name}", quant,
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

    return bool(spec.quantization) and method in available_methods() and method_class(method).explicit_adapters


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
        return int(np.prod(self.real(t.shape, what), dtype=np.int64)) * t.element_size() if t.dim() else t.element_size()


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
    galore = isinstance(parsed, FedGaLoreOptions)
    if hasattr(parsed, "downlink"):
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
    data["output"] = {**data.get("output", {}), "checkpoint_every": 100, "keep_checkpoints": 1, "progress": "quiet"}
    # the miniature is dense and on the CPU (a quantised base is counted by memory_plan); it keeps no adapters
    data["task"] = {**data["task"], "options": {k: v for k, v in (data["task"].get("options") or {}).items()
                                                if k not in ("quantization", "load_in_4bit")}}
    data["export"] = {}
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
    largest = max(ups.values())
    return Probe(
        method=method, refreshes=sizes if galore else [0] * len(sizes),
        down_first=down_first[0], down=down[0], up=largest[0],
        down_first_tensor_bytes=down_first[1], down_tensor_bytes=down[1], up_tensor_bytes=largest[1], up_by_refreshes=ups,
        optimizers=sorted(opt_kinds),
        server_state=state_bytes, optimizer_state=opt_peak[0], trained=trained, model=model_bytes,
    )


# ============================================================================ memory model
#: fitted on benchmarks/results/memory_scaling.json (four model sizes, CPU; see activation_bytes)
ACT_COEF = {"layer_values_bfloat16": 5.70, "layer_values_float32": 4.70, "checkpointed_per_layer_hidden": 1.0,
            "checkpointed_extra_hidden": 3.0, "logits_bytes_per_vocab_bfloat16": 3.87, "logits_bytes_per_vocab_float32": 4.23}


def activation_bytes(arch: dict[str, Any], batch: int, tokens: int, dtype: torch.dtype, checkpointing: bool | None = None) -> int:
    """Training activations of one micro-batch of ``batch × tokens`` tokens for a decoder (bytes):
    the autograd graph at the end of the forward pass, plus one layer recomputed with
    checkpointing.

    Per token, in model-dtype values: without checkpointing ``a L (h + i)`` (``L`` layers, ``h``
    hidden size, ``i`` MLP width; ``a`` per dtype: bf16 keeps fp32 copies in norms and softmax);
    with checkpointing ``(c L + d) h`` (every layer's input and the last hidden states) ``+ a (h +
    i)`` (the layer being recomputed). Logits: ``λ V`` bytes per token. Coefficients
    :data:`ACT_COEF` are fitted on measured CPU runs at ≤ 128 tokens
    (``benchmarks/memory_scaling.py``): linear in tokens — an attention that materialises the
    ``s × s`` scores (no flash/memory-efficient SDPA) adds ``heads · s²`` values per layer, not
    modelled. Non-LM tasks: 0 (not modelled).
    """
    if not arch.get("causal_lm"):
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
    logits = ACT_COEF.get(f"logits_bytes_per_vocab_{name}", 4.0) * arch["vocab"]
    return int(batch * tokens * (body * size + logits))


def kv_cache_bytes(arch: dict[str, Any], batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Greedy generation's key/value cache: ``batch × tokens × layers × 2 × kv_dim`` values."""
    if not arch.get("causal_lm"):
        return 0
    size = torch.empty(0, dtype=dtype).element_size()
    return int(batch * tokens * arch["layers"] * 2 * arch["kv_dim"] * size)


def phase_peaks(c: dict[str, int], clients: int, on_host: bool, diagnostics: bool, dense_uploads: bool) -> dict[str, dict[str, int]]:
    """Memory per phase of one round from the components ``c`` (keys ``model W, gradients G,
    optimizer_state O, activations A, server_state S, broadcast_blob B, upload_blob U,
    eval_kv_cache KV``), as the current code holds them (sequential backend; measured on CPU by
    ``benchmarks/memory_scaling.py``). ``K`` = clients per round. Host (H) / accelerator (A):

    The server state ``S`` lives on the host whatever the model's device (``init_server_state``
    copies it there; measured on an H100 at 7B, RESULTS §10.6); the accelerator holds the model
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
#: methods whose uploads are the dense deltas themselves (the diagnostics reuse them)
DENSE_UPLOADS = frozenset({"fedavg_full"})
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
      whole on every rank, are counted as sharded (RESULTS §19.1: rank 0's optimizer state was 0.58
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
    phases = phase_peaks(comp, clients_per_round, on_host, bool(cfg.diagnostics), probe.method in DENSE_UPLOADS)
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


# ============================================================================ the plan
def _client_sizes(cfg: FederatedConfig, task: Task | None, train_examples: int | None) -> list[int]:
    """Examples per client: the run's split (:func:`fedgalore.engine.clients.split_clients`) when
    the task is built here, else an equal split of the training set (``train_examples``, the task's
    ``n_train`` or a known data set size)."""
    if task is not None and train_examples is None:
        from fedgalore.engine.clients import split_clients

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
        k = max(int(getattr(cfg.train, "grad_accum_steps", 1)), 1)
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
    return optimizer_steps(micro, getattr(tc, "grad_accum_steps", 1))


def make_plan(cfg: FederatedConfig, methods: Sequence[str] | None = None, method_options: dict[str, dict] | None = None,
              train_examples: int | None = None) -> dict[str, Any]:
    """Per-round bytes per method and the memory plan of ``cfg`` (see the module doc)."""
    spec, task = model_spec(cfg)
    methods = list(methods or [cfg.method.name])
    sizes = _client_sizes(cfg, task, train_examples)
    M = len(sizes)
    K = cfg.federation.clients_per_round or M
    out: dict[str, Any] = {"config": cfg.name, "model": spec.source, "dtype": str(spec.dtype).replace("torch.", ""),
                           "quantization": spec.quantization,
                           "params": sum(int(np.prod(s)) for _, s in spec.params), "targets": len(spec.targets),
                           "clients": M, "clients_per_round": K, "rounds": cfg.federation.rounds, "device": cfg.device,
                           "client_examples": sizes, "methods": {}}
    out["privacy"] = privacy_plan(cfg, sizes, lambda n: _steps(n, cfg))  # the ε privacy.record will spend (or none)
    for method in methods:
        options = {**dict(cfg.method.options), **dict((method_options or {}).get(method, {}))}
        _, parsed = _method_setting(cfg, method, options)
        galore = isinstance(parsed, FedGaLoreOptions)
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
        }
    return out


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}" if x >= 0.01 * GIB else f"{x / 1024**2:.1f} MiB"


def format_plan(plan: dict[str, Any], accelerator_gib: float = 78.0, host_gib: float = 120.0) -> str:
    """Markdown: traffic per method, memory components and per-phase peaks, fit verdicts."""
    quant = f", {plan['quantization']} base for the LoRA methods" if plan.get("quantization") else ""
    lines = [f"# Plan: {plan['config']} — {plan['model']} ({plan['params'] / 1e9:.2f} B params, {plan['dtype']}{quant}, "
             f"{plan['targets']} adapted matrices), {plan['clients_per_round']} of {plan['clients']} clients per round, "
             f"{plan['rounds']} rounds, device {plan['device']}", "",
             "## Traffic (bytes exactly from shapes and payload types; GiB)", "",
             "| method | GaLore terms per client round | down / client / round | up / client / round | per round (all clients) | run total |",
             "|---|---|---:|---:|---:|---:|"]
    for m, r in plan["methods"].items():
        q = "–" if not r["refreshes_per_round"] else ", ".join(map(str, r["refreshes_per_round"]))
        lines.append(f"| {m} | {q} | {_gib(r['down_per_client'])} | {_gib(r['up_per_client'])} | "
                     f"{_gib(r['per_round']['down'] + r['per_round']['up'])} | {_gib(r['run_total'])} |")
    lines += ["", f"## Memory (GiB; usable: {accelerator_gib:g} GiB accelerator, {host_gib:g} GiB host; peaks per phase as the "
              "current code holds them, fedgalore.plan.phase_peaks)", "",
              "| method | model | grads | optimizer | activations | server state | broadcast | upload | eval KV | "
              "peak accelerator (phase) | peak host (phase) | fits |", "|---|" + "---:|" * 10 + "---|"]
    for m, r in plan["methods"].items():
        c, pk = r["memory"]["components"], r["memory"]["peak"]
        on_host = plan["device"] == "cpu"
        fits = (pk["host"] <= host_gib * GIB) and (on_host or pk["accelerator"] <= accelerator_gib * GIB)
        lines.append(f"| {m} | {_gib(c['model'])} | {_gib(c['gradients'])} | {_gib(c['optimizer_state'])} | {_gib(c['activations'])} | "
                     f"{_gib(c['server_state'])} | {_gib(c['broadcast_blob'])} | {_gib(c['upload_blob'])} | {_gib(c['eval_kv_cache'])} | "
                     f"{_gib(pk['accelerator']) + ' (' + r['memory']['peak_phase']['accelerator'].replace('_', ' ') + ')' if not on_host else '–'} | "
                     f"{_gib(pk['host'])} ({r['memory']['peak_phase']['host'].replace('_', ' ')}) | {'yes' if fits else '**no**'} |")
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
    return "\n".join(lines) + "\n"


def _eps(x: float) -> str:
    return "∞" if not math.isfinite(x) else f"{x:.3g}"


def _client_plan_lines(cp: dict[str, Any] | None) -> list[str]:
    """The plan's lines for client-level DP (:func:`fedgalore.engine.privacy_ledger.client_plan`)."""
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
    """The plan's privacy section (:func:`fedgalore.engine.privacy_ledger.privacy_plan`): the ε(δ)
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
