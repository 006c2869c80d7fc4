"""Export a run's global model (``fedgalore export``; docs/export.md).

::

    import fedgalore
    res = fedgalore.export_run("runs/tiny-fedit-dirichlet0.5-s0", "exported/tiny")          # hf
    res = fedgalore.export_run(run_dir, "exported/tiny-adapter", format="peft")               # FedIT's adapter
    res = fedgalore.export_run(run_dir, "exported/tiny-r8", format="peft", rank=8)            # any method

Formats (the global model is :func:`~fedgalore.trained.global_model.load_global_model`'s: the
model the round loop evaluates, from a kept checkpoint):

* ``hf`` — a Hugging Face folder (``config.json`` with ``id2label``/``label2id`` for classifiers,
  ``model.safetensors``, the task's tokenizer or image processor): every method's adapters merged
  into plain weights — LoRA methods by PEFT's ``merge_and_unload`` (``W + s·BA``: FedIT's
  ``s·B̄Ā``, FFA-LoRA's ``s·B̄A``, LoRA-FAIR's corrected ``s·B̄'Ā``, FR-LoRA's residual base plus
  ``s·B0A0``, FLoRA's merged base with ``B = 0``), FedAvg-Full and FedGaLore as they are (they
  train the dense matrices). ``AutoModelFor….from_pretrained(DIR)`` loads it.
* ``peft`` — a PEFT LoRA adapter of the task's pretrained model, for the methods whose global
  model is that model plus adapters (:attr:`~fedgalore.methods.traits.MethodTraits.explicit_adapters`:
  FedIT, FFA-LoRA, LoRA-FAIR), their ``(B, A)`` and α as trained. ``PeftModel.from_pretrained(
  base, DIR)`` loads it on ``base = task.build_model()``.
* ``peft`` with ``rank`` — for any method: per adapted matrix the best rank-R approximation of
  ``W − W0`` (:mod:`~fedgalore.trained.lora_extract`), its relative error reported.
* ``peft`` with ``exact`` — for a method whose update is exactly low-rank (FedGaLore trained
  without weight decay, FLoRA, FR-LoRA; :mod:`~fedgalore.trained.lora_exact`): ``W − W0`` as an
  exact LoRA of each matrix's numerical rank (PEFT ``rank_pattern``), checked to the same strict
  tolerance as ``peft``; its ranks and size reported. The methods with explicit adapters export
  their own adapter (already exact).

Every ``peft`` adapter records a portable name of its base in ``base_model_name_or_path`` (the
hub id or the name the run's config gave; :func:`~fedgalore.trained.model_card.base_model_name`),
never a path into this machine's cache: the model card notes that path. A base that no hub id
names (the offline tiny ViT pretrained in fedgalore's cache, a model folder of one's own:
:func:`~fedgalore.trained.model_card.ships_base`) travels with the adapter instead, in its
``base/`` sub-folder: the task's pretrained model as the run started from it (``save_pretrained``,
the head the adapter replaces, the run's ``id2label``/``label2id``), so that
``PeftModel.from_pretrained(AutoModelFor….from_pretrained(DIR/base), DIR)`` loads it anywhere
with the run's labels and no head mismatch; the export's check loads it that way.

In both ``peft`` forms the classifier head — trained and averaged by every method — and any other
tensor the run changed outside the adapted matrices (FedAvg-Full ``trainable=all``: embeddings,
norms, biases) travel whole as PEFT ``modules_to_save`` (biases of adapted layers as
``bias="lora_only"``); the adapter files hold no copy of the pretrained weights.

Every export is checked before it is put in place: the written folder is loaded back the way a
user loads it and its logits on a few test examples are compared with the run's global model
(``hf`` and plain ``peft`` must agree to fp32 rounding; an extraction reports its difference).
The folder also gets ``README.md`` (:mod:`~fedgalore.trained.model_card`), the run's config
(``fedgalore_config.yaml``), its identity (``fedgalore_identity.json``: the files it read) and
``fedgalore_export.json``. It is written beside ``out`` and renamed into place: an export never
leaves a half-written folder.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedgalore.trained.evaluate import class_names, load_exported
from fedgalore.trained.global_model import (
    ExportError,
    GlobalModel,
    choose_round,
    load_global_model,
    merged_model,
    probe_batch,
    probe_logits,
    run_config,
)
from fedgalore.trained.lora_exact import ExactFactors, exact_factors, exact_problem
from fedgalore.trained.lora_extract import LoraFactors, lora_factors, total_error
from fedgalore.trained.model_card import (EXPORT_BASE, EXPORT_CONFIG, EXPORT_IDENTITY, base_model_name, exported_identity,
                                          model_card, ships_base)
from fedgalore.methods.base import Method, available_methods, method_class
from fedgalore.methods.traits import WrapsModel
from fedgalore.tasks.base import Task, quiet_transformers

__all__ = ["export_run", "ExportResult", "ExportError", "FORMATS"]

FORMATS = ("hf", "peft")
#: examples of the test set an export is checked on
PROBE_EXAMPLES = 8


@dataclass
class ExportResult:
    """What :func:`export_run` wrote and what its check measured."""

    out: Path
    run_dir: Path
    round: int
    method: str
    format: str
    rank: int | None
    #: the transformers class of the model (``AutoModelFor…`` resolves to it)
    model_class: str
    #: the class of the saved tokenizer / image processor (None: the task has none)
    processor: str | None
    #: max |Δ logits| of the loaded folder against the run's global model (None: not checked)
    check: float | None
    #: ``--rank``: each adapted matrix with its extraction (errors, numerical rank)
    matrices: list[tuple[str, LoraFactors]] = field(default_factory=list)
    #: ``--rank``: the total relative Frobenius error over all adapted matrices
    total_error: float | None = None
    #: ``peft``: the tensors carried whole (head, other trained tensors)
    dense: list[str] = field(default_factory=list)
    #: the task's classes in id order (:func:`class_names`; None: no classes — regression, a language model)
    labels: list[str] | None = None
    #: the run was live (a process running it) when exported: which round this took (fedgalore.records.liveness)
    live: str | None = None
    #: ``exact``: each adapted matrix the run changed with its exact factors (rank = numerical rank of W − W0)
    exact: list[tuple[str, ExactFactors]] = field(default_factory=list)
    #: ``peft``: bytes of the adapter's tensors (adapter_model.safetensors' tensors) and of the dense
    #: matrices the LoRA factors stand for (fp32)
    adapter_bytes: int | None = None
    dense_bytes: int | None = None
    #: the base model's portable name written into a PEFT adapter's config (None: hf)
    base_model: str | None = None
    #: ``peft``: the sub-folder of ``out`` holding the base model, when it travels with the adapter (None: named only)
    shipped_base: Path | None = None


def export_run(run_dir: str | Path, out: str | Path, *, round: int | None = None, best: bool = False,  # noqa: A002
               format: str = "hf", rank: int | None = None, force: bool = False, verify: bool = True,  # noqa: A002
               task: Task | None = None, method: Method | None = None, device: str = "cpu",
               exact: bool = False) -> ExportResult:
    """Write the global model of ``run_dir`` (round ``round``, the best validation round with
    ``best``, else the newest kept checkpoint) to the folder ``out`` in ``format`` (module
    docstring). ``out`` must not exist or be empty unless ``force`` (then it is replaced).
    ``verify``: load the folder back and compare its logits with the run's model (on by default;
    it costs a second copy of the model). ``task`` / ``method``: the objects the run was given
    instead of built from its config. ``exact`` (with ``format="peft"``): the update as an exact
    LoRA adapter (:mod:`~fedgalore.trained.lora_exact`). Bad input is one :class:`ExportError` line."""
    run_dir, out = Path(run_dir), Path(out)
    if format not in FORMATS:
        raise ExportError(f"--format {format!r} is not one of {', '.join(FORMATS)}")
    if rank is not None and format != "peft":
        raise ExportError("--rank extracts a LoRA adapter: use it with --format peft")
    if rank is not None and int(rank) < 1:
        raise ExportError(f"--rank {rank} must be >= 1")
    if exact and format != "peft":
        raise ExportError("--exact writes a LoRA adapter: use it with --format peft")
    if exact and rank is not None:
        raise ExportError("--exact keeps every direction of the update; --rank R truncates it: give one of them")
    cfg = run_config(run_dir)
    _check_out(out, force, run_dir)
    cls = type(method) if method is not None else method_class(cfg.method.name)
    if exact:
        problem = exact_problem(cfg.method.name, cfg)
        if problem is not None:
            raise ExportError(f"--exact: {problem}")
        exact = not cls.traits.explicit_adapters  # their own adapter is the exact one
    if format == "peft" and rank is None and not exact:
        if not cls.traits.explicit_adapters:
            adapters = ", ".join(n for n in available_methods() if method_class(n).traits.explicit_adapters)
            extra = ("; its update is exactly low-rank: --format peft --exact writes it as an exact LoRA adapter"
                     if exact_problem(cfg.method.name, cfg) is None else "")
            raise ExportError(f"method {cfg.method.name!r} changes the weights themselves, so it has no adapter of the "
                              f"pretrained model to export as it is (those methods: {adapters}); use --format hf for "
                              "the merged model, or --format peft --rank R to extract a rank-R LoRA adapter from W − W0"
                              + extra)
    chosen = choose_round(run_dir, round, best)  # bad rounds fail before the model is built
    g = load_global_model(run_dir, round=chosen, task=task, method=method, device=device)
    _require_transformers_model(g)
    if format == "hf" and _quant_method(g.model) not in (None, "gguf"):
        raise ExportError("the run's model is quantised (task.options.quantization): merging adapters into it would "
                          "requantise them; export --format peft (the adapters on the quantised base) instead")
    batch = probe_batch(g.task, PROBE_EXAMPLES)
    reference = probe_logits(g.model, batch) if verify else None
    num_labels = _num_labels(g)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        with quiet_transformers():
            result = _write(g, tmp, out, format, rank, exact, device)
            result.live = g.live
            processor = g.task.processor()
            if processor is not None:
                processor.save_pretrained(str(tmp))
                result.processor = type(processor).__name__
            if reference is not None:
                result.check = _check(load_exported(tmp, g.task), batch, reference, strict=rank is None)
        if format == "peft":
            result.adapter_bytes = _adapter_tensor_bytes(tmp)
        shutil.copyfile(run_dir / "config.yaml", tmp / EXPORT_CONFIG)
        identity = exported_identity(g)  # under DP without the sites' inputs, as the card (fedgalore.privacy.view)
        if identity is not None:
            (tmp / EXPORT_IDENTITY).write_text(json.dumps(identity, indent=1, sort_keys=True))
        result.labels = class_names(g.task)
        _write_info(tmp, result)
        (tmp / "README.md").write_text(model_card(
            g, out, fmt=format, model_class=result.model_class, processor=result.processor, rank=rank,
            matrices=result.matrices, total=result.total_error, check=result.check, dense=result.dense,
            num_labels=num_labels, probe=len(reference) if reference is not None else 0, exact=result.exact,
            adapter_bytes=result.adapter_bytes, dense_bytes=result.dense_bytes, shipped=result.shipped_base is not None))
        _usual_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- checks
def _check_out(out: Path, force: bool, run_dir: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder to write the model to")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out} exists and is not empty; choose another folder, or add --force to replace it")
        o, r = out.resolve(), run_dir.resolve()
        if o == r or o in r.parents:
            raise ExportError(f"--out {out} holds the run directory itself; --force would delete the run: choose another folder")


def _quant_method(model: nn.Module) -> str | None:
    """The ``quant_method`` of the model's ``config.quantization_config`` (None: none). ``gguf`` never
    means quantised weights: transformers dequantises a GGUF file when it loads it, and the
    ``quantization_config`` a converted folder keeps (the offline SmolLM2's) names the source file."""
    q = getattr(getattr(model, "config", None), "quantization_config", None)
    if q is None:
        return None
    kind = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(kind, "value", kind))


def _require_transformers_model(g: GlobalModel) -> None:
    """Export writes ``transformers`` models (``save_pretrained`` folders); a task of one's own with
    another model class (docs/data.md, "A task of your own") is one line saying where its model is."""
    from transformers import PreTrainedModel

    inner = getattr(g.model, "get_base_model", lambda: g.model)()
    if not isinstance(inner, PreTrainedModel):
        raise ExportError(f"the run's model ({type(inner).__name__}) is not a transformers model, so there is no Hugging Face "
                          f"folder to write; its global model: fedgalore.trained.global_model.load_global_model({str(g.run_dir)!r}, "
                          "task=<the task object>).model")


def _check(model: nn.Module, batch: dict[str, torch.Tensor], reference: torch.Tensor, strict: bool) -> float:
    """Max |Δ logits| of ``model`` against ``reference``; with ``strict`` more than rounding
    (1e-4 of the logits' scale in fp32, 2e-2 in 16-bit) is an error (the folder is not kept)."""
    diff = float((probe_logits(model, batch) - reference).abs().max())
    low = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    tol = (2e-2 if low else 1e-4) * max(1.0, float(reference.abs().max()))
    if strict and not diff <= tol:
        raise ExportError(f"the written folder does not reproduce the run's logits (max |Δ| = {diff:.3g} > {tol:.1g}); "
                          "nothing was written — this is a bug, please report it with the run's config.yaml")
    return diff


def _num_labels(g: GlobalModel) -> int | None:
    """The classifier's label count (None for models without one, e.g. causal LMs)."""
    config = getattr(g.model, "config", None)
    arch = type(g.method.inner(g.model) if isinstance(g.method, WrapsModel) else g.model).__name__
    if config is None or not arch.endswith(("ForSequenceClassification", "ForImageClassification")):
        return None
    return int(getattr(config, "num_labels", 0)) or None


# ----------------------------------------------------------------------------- writers
def _write(g: GlobalModel, tmp: Path, out: Path, fmt: str, rank: int | None, exact: bool = False,
           device: str = "cpu") -> ExportResult:
    def result(model_class: str, **kw: Any) -> ExportResult:
        base = base_model_name(g)[0] if fmt == "peft" else None
        shipped = out / EXPORT_BASE if (tmp / EXPORT_BASE).is_dir() else None
        return ExportResult(out, g.run_dir, g.round, g.cfg.method.name, fmt, rank, model_class, None, None, base_model=base,
                            shipped_base=shipped, **kw)

    if fmt == "hf":
        model = merged_model(g.model)
        if _quant_method(model) == "gguf":  # dense weights: a loader must not take the folder for a GGUF file
            del model.config.quantization_config
            model.hf_quantizer = None
        _set_labels(model, g.task)
        model.save_pretrained(str(tmp))
        return result(type(model).__name__)
    if exact:
        return _write_exact(g, tmp, result, device)
    if rank is None:
        m: Any = g.method  # a LoRA method (explicit_adapters)
        pre = g.task.build_model()
        pre_params = dict(pre.named_parameters())
        for t in g.runtime.target_modules:
            if not torch.equal(m.base_weight(g.model, t).detach().cpu(), pre_params[t + ".weight"].detach()):
                raise ExportError(f"method {g.cfg.method.name!r} changed the base weight of {t}: its adapters alone are "
                                  "not the global model; export --format hf or --format peft --rank R")
        factors = {t: (m.lora_b(g.model, t).detach().cpu(), m.lora_a(g.model, t).detach().cpu()) for t in g.runtime.target_modules}
        heads = {n: p.detach().cpu() for n, p in m.head_params(g.model).items()}
        dense = _write_peft(g, tmp, pre, factors, g.method.rank, float(m.lora_alpha), heads, {}, float(m.lora_dropout))
        return result(type(pre).__name__, dense=dense, dense_bytes=_dense_bytes(factors))
    pre = g.task.build_model()
    pre_params = dict(pre.named_parameters())
    targets = g.runtime.target_modules
    for t in targets:
        shape = tuple(pre_params[t + ".weight"].shape)
        if rank > min(shape):
            raise ExportError(f"--rank {rank} exceeds what the adapted matrix {t} ({shape[0]}×{shape[1]}) allows; "
                              f"use --rank <= {min(min(pre_params[x + '.weight'].shape) for x in targets)}")
    now = {n: p.detach().cpu() for n, p in merged_model(g.model).named_parameters()}
    extracted = [(t, lora_factors(now[t + ".weight"].float() - pre_params[t + ".weight"].detach().float(), rank)) for t in targets]
    others, biases = _changed_outside(g, now, pre_params)
    factors = {t: (f.b, f.a) for t, f in extracted}
    dense = _write_peft(g, tmp, pre, factors, rank, float(rank), others, biases, 0.0)
    return result(type(pre).__name__, matrices=extracted, total_error=total_error([f for _, f in extracted]), dense=dense,
                  dense_bytes=_dense_bytes(factors))


def _changed_outside(g: GlobalModel, now: dict[str, torch.Tensor], pre_params: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(tensors the run changed outside the adapted matrices — the head always —, changed biases of
    adapted layers): what a ``peft`` adapter carries whole."""
    targets, heads = g.runtime.target_modules, set(g.runtime.head_params)
    skip = {t + ".weight" for t in targets}
    biases = {n: now[n] for n in (t + ".bias" for t in targets) if n in now and not torch.equal(now[n], pre_params[n].detach())}
    others = {n: v for n, v in now.items() if n not in skip and n not in biases
              and (n in heads or not torch.equal(v, pre_params[n].detach()))}
    return others, biases


def _write_exact(g: GlobalModel, tmp: Path, result: Any, device: str) -> ExportResult:
    """``--exact``: every adapted matrix's ``W − W0`` as an exact LoRA of its numerical rank
    (:func:`~fedgalore.trained.lora_exact.exact_factors`), per-matrix ranks as PEFT ``rank_pattern``."""
    pre = g.task.build_model()
    pre_params = {n: p.detach() for n, p in pre.named_parameters()}
    now = {n: p.detach().cpu() for n, p in merged_model(g.model).named_parameters()}
    exact = [(t, exact_factors(now[t + ".weight"], pre_params[t + ".weight"], g.round, device)) for t in g.runtime.target_modules]
    kept = [(t, f) for t, f in exact if f.rank > 0]
    if not kept:
        raise ExportError(f"round {g.round} of {g.run_dir} changed no adapted matrix (W = W0): there is no update to export")
    others, biases = _changed_outside(g, now, pre_params)
    factors = {t: (f.b, f.a) for t, f in kept}
    ranks = {t: f.rank for t, f in kept}
    dense = _write_peft(g, tmp, pre, factors, max(ranks.values()), float(max(ranks.values())), others, biases, 0.0,
                        ranks=ranks)
    return result(type(pre).__name__, exact=exact, dense=dense, dense_bytes=_dense_bytes(factors))


def _dense_bytes(factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """fp32 bytes of the ``m × n`` matrices that LoRA ``factors`` (B: m×r, A: r×n) stand for."""
    return sum(4 * int(b.shape[0]) * int(a.shape[1]) for b, a in factors.values())


def _adapter_tensor_bytes(folder: Path) -> int:
    """Bytes of the tensors in ``folder/adapter_model.safetensors`` (header excluded)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as fh:
        for key in fh.keys():
            t = fh.get_slice(key)
            numel = 1
            for d in t.get_shape():
                numel *= int(d)
            total += numel * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}.get(t.get_dtype(), 4)
    return total


def _set_labels(model: nn.Module, task: Task) -> None:
    """``config.id2label``/``label2id`` from the task's label names when the config has only
    transformers' defaults (``LABEL_0``, …) and the counts agree (classifiers only)."""
    config = model.config
    if getattr(config, "problem_type", None) == "regression" or not type(model).__name__.endswith(
            ("ForSequenceClassification", "ForImageClassification")):
        return
    names = [str(n) for n in task.label_names()]
    default = all(str(v) == f"LABEL_{k}" for k, v in (config.id2label or {}).items())
    if default and len(names) == int(config.num_labels):
        config.id2label = dict(enumerate(names))
        config.label2id = {n: i for i, n in enumerate(names)}


def _carriers(g: GlobalModel, names: list[str]) -> list[str]:
    """The modules whose PEFT ``modules_to_save`` copy carries the tensors ``names`` whole: a head
    parameter's head module (``classifier``), else the tensor's own module."""
    heads = tuple(g.task.head_modules)
    targets = g.runtime.target_modules
    modules: list[str] = []
    for n in names:
        parts = n.split(".")
        cut = next((i + 1 for i, p in enumerate(parts[:-1]) if p in heads), len(parts) - 1)
        module = ".".join(parts[:cut])
        if any(t == module or t.startswith(module + ".") for t in targets):
            raise ExportError(f"cannot carry {n} in a PEFT adapter: its module {module} also holds adapted matrices; "
                              "export --format hf instead")
        if module not in modules:
            modules.append(module)
    return modules


def _write_peft(g: GlobalModel, tmp: Path, base: nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                r: int, alpha: float, dense: dict[str, torch.Tensor], biases: dict[str, torch.Tensor],
                dropout: float, ranks: dict[str, int] | None = None) -> list[str]:
    """A PEFT LoRA adapter of ``base`` (the task's pretrained model) with ``B``, ``A`` per adapted
    module (``W0 + (α/r)·BA``), the ``dense`` tensors carried whole (``modules_to_save``) and the
    adapted layers' ``biases``; written with ``save_pretrained`` to ``tmp``, its config naming the
    base portably (:func:`~fedgalore.trained.model_card.base_model_name`); a base no hub id names
    saved beside it in ``tmp/base`` first (:func:`_ship_base`). ``ranks``: a rank per module
    (``rank_pattern``, α = rank: scaling 1) instead of one ``r``. Returns the carried tensors."""
    import re

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    patterns: dict[str, Any] = {}
    if ranks:
        patterns = {"rank_pattern": {re.escape(t): int(k) for t, k in ranks.items()},
                    "alpha_pattern": {re.escape(t): float(k) for t, k in ranks.items()}}
    config = LoraConfig(r=int(r), lora_alpha=alpha, lora_dropout=dropout, target_modules=list(factors),
                        modules_to_save=_carriers(g, sorted(dense)) or None, bias="lora_only" if biases else "none",
                        task_type=g.task.peft_task_type, **patterns)
    _ship_base(g, base, tmp)  # before PEFT wraps its layers
    with torch.random.fork_rng(devices=[]):  # PEFT's initialisation draws from the global RNG
        peft_model = get_peft_model(base, config)
    state = {}
    for t, (b, a) in factors.items():
        state[f"base_model.model.{t}.lora_A.weight"] = a
        state[f"base_model.model.{t}.lora_B.weight"] = b
    state.update({f"base_model.model.{n}": v for n, v in dense.items()})
    state.update({f"base_model.model.{n[:-len('.bias')]}.base_layer.bias": v for n, v in biases.items()})
    loaded = set_peft_model_state_dict(peft_model, state)
    if loaded.unexpected_keys:
        raise ExportError(f"PEFT did not take {sorted(loaded.unexpected_keys)[:3]} (an unsupported layout); export --format hf")
    peft_model.save_pretrained(str(tmp), save_embedding_layers=False)
    name = base_model_name(g)[0]
    if name:  # PEFT records the folder the base was loaded from: a path that exists on this machine only
        conf_file = tmp / "adapter_config.json"
        conf = json.loads(conf_file.read_text())
        conf["base_model_name_or_path"] = name
        conf_file.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return sorted(dense) + sorted(biases)


def _ship_base(g: GlobalModel, base: nn.Module, tmp: Path) -> None:
    """Save ``base`` (the task's pretrained model, unwrapped) to ``tmp/base`` when no hub id names it
    (:func:`~fedgalore.trained.model_card.ships_base`), with the run's label names in its config;
    a quantised base is left to its name (its weights are not plain tensors to save)."""
    if not ships_base(g) or _quant_method(base) not in (None, "gguf"):
        return
    _set_labels(base, g.task)
    if _quant_method(base) == "gguf":  # dense weights, as the hf export writes them
        del base.config.quantization_config
        base.hf_quantizer = None
    base.save_pretrained(str(tmp / EXPORT_BASE))


def _usual_permissions(folder: Path) -> None:
    """Give the written files the permissions the umask gives new files (``safetensors`` writes
    the weights with mode 0600: unreadable to the rest of a team sharing the folder); the shipped
    base's files too."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [*folder.iterdir(), *((folder / EXPORT_BASE).iterdir() if (folder / EXPORT_BASE).is_dir() else ())]:
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _write_info(tmp: Path, result: ExportResult) -> None:
    info = {
        "run_dir": str(result.run_dir), "round": result.round, "method": result.method, "format": result.format,
        "rank": result.rank,
        "model_class": result.model_class, "processor": result.processor, "check_max_abs_logit_diff": result.check,
        "total_relative_error": result.total_error,
        "matrices": [{"name": n, "shape": [f.b.shape[0], f.a.shape[1]], "numerical_rank": f.numerical_rank,
                      "relative_error": f.rel_error} for n, f in result.matrices],
        "carried_whole": result.dense,
        "labels": result.labels,
        "base_model": result.base_model,
        "shipped_base": EXPORT_BASE if result.shipped_base is not None else None,
        "exact": [{"name": n, "shape": [f.b.shape[0], f.a.shape[1]], "rank": f.rank, "floor": f.floor,
                   "largest_dropped_singular_value": f.largest_dropped, "smallest_kept_singular_value": f.smallest_kept,
                   "relative_error": f.rel_error} for n, f in result.exact],
        "adapter_tensor_bytes": result.adapter_bytes,
        "dense_matrix_bytes": result.dense_bytes,
    }
    (tmp / "fedgalore_export.json").write_text(json.dumps(info, indent=1))
