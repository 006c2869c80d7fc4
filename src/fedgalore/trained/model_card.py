"""The ``README.md`` model card of an exported run (``fedgalore export``; docs/export.md).

It states what the folder holds and how it was made: method, task, base model, the model and
data files the run read (name, size and the fingerprint its identity recorded when it started —
never the data), the partition, the rounds, the privacy it had (ε, δ and the mechanism, or none:
``privacy.json``), the metrics at the exported round and at the run's
end, the bytes sent up and down until that round (the run's ledger), how to load the folder, the
low-rank extraction's error per matrix (``--rank``), and the command that reproduces the run from
its saved config.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedgalore.job.config import ConfigError
from fedgalore.trained.global_model import GlobalModel
from fedgalore.privacy.view import view_of
from fedgalore.records.identity import IDENTITY_FILE, base_model_local, base_model_name_for, run_identity
from fedgalore.trained.lora_extract import RANK_NOTES, LoraFactors
from fedgalore.records.liveness import run_state
from fedgalore.engine.stages.privacy_ledger import read_privacy
from fedgalore.records.rundir import saved_summary
from fedgalore.privacy.statement import summary_line
from fedgalore.tasks.base import TaskError

__all__ = ["model_card", "recorded_inputs", "exported_identity", "base_model_name", "base_model_name_for",
           "base_model_local", "ships_base", "EXPORT_CONFIG", "EXPORT_IDENTITY", "EXPORT_BASE"]

#: the run's config.yaml, copied into an export (the card's reproduce command; ``fedgalore evaluate``)
EXPORT_CONFIG = "fedgalore_config.yaml"
#: the run's identity.json, copied into an export (where its data files are: ``fedgalore evaluate``)
EXPORT_IDENTITY = "fedgalore_identity.json"
#: the sub-folder of a ``peft`` export that holds its base model, when no hub id names it (:func:`ships_base`)
EXPORT_BASE = "base"


def recorded_inputs(g: GlobalModel) -> tuple[list[dict[str, Any]], str]:
    """The model and data files the run read, as its identity recorded them when it started
    (``identity.json``'s ``inputs``: :func:`fedgalore.records.identity.run_identity`, fingerprints
    by :func:`fedgalore.tasks.fingerprint.fingerprint_path`) — one source of truth with the check
    that refuses to mix runs on changed files; plus, for a task object passed in code, the digests
    of its in-memory examples. Each entry: ``label`` and the fingerprint's fields (``path`` absent
    for in-memory data). A run written before identities is fingerprinted now (``run_identity``
    of its config), and the returned sentence says which."""
    try:
        saved = json.loads((g.run_dir / IDENTITY_FILE).read_text())
        inputs, config, when = saved.get("inputs") or {}, saved.get("config") or {}, "when the run started"
    except (OSError, json.JSONDecodeError):
        try:
            identity = run_identity(g.cfg)
            inputs, config = identity.inputs or {}, identity.config
        except (ConfigError, TaskError):
            inputs, config = {}, {}
        when = f"at export (the run has no {IDENTITY_FILE}: it predates run identities)"
    out = [{"label": label, **fp} for label, fp in sorted(inputs.items())]
    for split, digest in sorted(((config.get("task") or {}).get("data") or {}).items()):
        out.append({"label": f"task.data.{split}", "kind": "examples", "sha256": digest})
    return out, when


def base_model_name(g: GlobalModel) -> tuple[str | None, str | None]:
    """``(portable name, local note)`` of the run's base model. The name: for a PEFT adapter given as
    ``task.options.model``, its base as the config's ``base_model`` or the adapter names it; else
    ``task.options.model`` as the run's saved config gives it (the hub id or the name the user
    wrote — never the absolute path a reloaded config carries); else the hub id of the task's
    offline model (:func:`fedgalore.tasks.assets.hub_id`). A base read from a local copy of a hub
    model (an offline model's folder, a Hugging Face cache snapshot, a folder whose config.json
    names its hub id: :func:`fedgalore.tasks.assets.folder_hub_id`) is named by that hub id, however the
    config gave it. The note: the folder this run read, and for a copy how it relates to the hub's.
    ``(None, None)`` for a task that builds its model itself (``tiny_text``)."""
    return base_model_name_for(g.task, g.run_dir)


def ships_base(g: GlobalModel) -> bool:
    """Whether a ``peft`` export of ``g`` carries its base model (in :data:`EXPORT_BASE`): when the
    run read its base from a folder of this machine that is no copy of a hub model
    (:func:`fedgalore.tasks.assets.folder_hub_id`) — the offline tiny ViT fedgalore pretrained in its
    cache, a model folder of one's own — so that no name would load it elsewhere. A base named by a
    hub id (given as one, or a local copy of one) travels by that name; a task that builds its model
    itself (``tiny_text``) has none to ship."""
    from fedgalore.tasks.assets import folder_hub_id

    if base_model_name(g)[0] is None:
        return False
    adapter = getattr(g.task, "adapter", None)
    desc = g.task.describe()
    local = adapter.base if adapter is not None else (desc.get("model") or desc.get("checkpoint"))
    return bool(local) and Path(str(local)).expanduser().is_dir() and folder_hub_id(local) is None


def _input_row(f: Mapping[str, Any]) -> str:
    """One table row of :func:`recorded_inputs`' entry ``f``."""
    if f["kind"] == "examples":
        return f"| {f['label']} | (in memory) | | digest of the examples `{f['sha256']}` |"
    name = Path(f["path"]).name
    if f["kind"] == "folder":
        unhashed = f" ({f['unhashed']} of them by name and size only)" if f.get("unhashed") else ""
        return (f"| {f['label']} | {name}/ | {f['files']:,} files, {f['bytes']:,} B | SHA-256 of the listing (names, sizes, "
                f"hashes){unhashed} `{f['sha256']}` |")
    how = "SHA-256" if f.get("hash") == "full" else "sampled SHA-256 (size, head and blocks)"
    return f"| {f['label']} | {name} | {f['size']:,} B | {how} `{f['sha256']}` |"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _metric_rows(record: Mapping[str, Any]) -> list[str]:
    test = {k[5:]: v for k, v in record.items() if k.startswith("eval/") and not k.startswith("eval/val_")}
    val = {k[9:]: v for k, v in record.items() if k.startswith("eval/val_")}
    names = list(dict.fromkeys([*test, *val]))
    if not names:
        return []
    rows = ["| split | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for split, values in (("test", test), ("validation", val)):
        if values:
            rows.append(f"| {split} | " + " | ".join(_fmt(values.get(n, "")) for n in names) + " |")
    return rows


def _view(g: GlobalModel):
    """The run's server view (fedgalore.privacy.view): what the card may say about a site."""
    return view_of(g.cfg)


def _site_input(f: Mapping[str, Any]) -> bool:
    """Whether recorded input ``f`` is a site's data (not the model or a shared test set)."""
    return "model" not in f["label"] and f.get("kind") != "examples"


def exported_identity(g: GlobalModel) -> dict[str, Any] | None:
    """The run's ``identity.json`` as an export carries it (:data:`EXPORT_IDENTITY`): whole where the
    server view names the sites' data paths, else without the sites' inputs (their byte sizes, file
    counts and fingerprints would say how much data each site holds: the card lists none of them
    either), with ``withheld`` saying so. The config's own paths stay (``config`` here and
    ``fedgalore_config.yaml``: what the operator wrote). None when the run has no identity file."""
    try:
        doc = json.loads((g.run_dir / IDENTITY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    view = _view(g)
    if view.site_paths:
        return doc
    inputs = doc.get("inputs") or {}
    kept = {label: fp for label, fp in inputs.items() if not _site_input({"label": label, **fp})}
    if len(kept) < len(inputs):
        doc["inputs"] = kept
        doc["withheld"] = (f"{len(inputs) - len(kept)} data input(s) of the sites ({view.level}: an export gives no "
                           "site's file sizes, counts or fingerprints; fedgalore.privacy.view)")
    return doc


def _partition_line(g: GlobalModel) -> str:
    fed = g.cfg.federation
    try:
        sizes = json.loads((g.run_dir / "partition.json").read_text()).get("sizes") or []
    except (OSError, json.JSONDecodeError):
        sizes = []
    per_round = fed.clients_per_round if fed.clients_per_round is not None else fed.num_clients
    line = f"{g.cfg.setting_label()} over {fed.num_clients} clients, {per_round} per round"
    if sizes and _view(g).site_size:  # the sites' sizes only where the server view declares them
        line += f"; client sizes {min(sizes)}–{max(sizes)} (median {statistics.median(sizes):g})"
    if fed.validation_fraction > 0:
        line += f"; {fed.validation_fraction:g} of the training pool held out for validation"
    return line


def _load_snippet(g: GlobalModel, out: Path, fmt: str, model_class: str, processor: str | None,
                  num_labels: int | None, shipped: bool = False) -> list[str]:
    lines = ["```python"]
    if fmt == "hf":
        lines += [f"from transformers import {model_class}", f'model = {model_class}.from_pretrained("{out}")']
    elif shipped:  # the base travels with the adapter: transformers loads it as it is
        lines += ["from peft import PeftModel", f"from transformers import {model_class}",
                  f'base = {model_class}.from_pretrained("{out / EXPORT_BASE}")  # the run\'s pretrained model, shipped '
                  "with the adapter" + (" (its head sized and named for the run's labels)" if num_labels else ""),
                  f'model = PeftModel.from_pretrained(base, "{out}")']
    else:
        model_id = base_model_name(g)[0]
        lines += ["from peft import PeftModel",
                  "import fedgalore",
                  "from fedgalore.tasks import get_task",
                  f'cfg = fedgalore.load_config("{out / EXPORT_CONFIG}")',
                  "base = get_task(cfg.task.name, **cfg.task.options).build_model()  # the run's pretrained model"]
        tail = f", num_labels={num_labels}, ignore_mismatched_sizes=True)" if num_labels else ")"
        names = [str(n) for n in g.task.label_names()] if num_labels and not getattr(g.task, "regression", False) else []
        if names and len(names) == num_labels:  # the run's label names, as the hf export's config.json has them
            tail = (f", id2label={dict(enumerate(names))!r}, label2id={ {n: i for i, n in enumerate(names)}!r}, "
                    "ignore_mismatched_sizes=True)")
        if model_id:
            lines += [f"# or, with transformers only: base = {model_class}.from_pretrained(\"{model_id}\"" + tail]
        local = base_model_local(g.task)
        if model_id and local and local != model_id:  # the hub id above; where this machine has it without the hub
            lines += [f"# offline, from the local copy this run read: base = {model_class}.from_pretrained(\"{local}\"" + tail]
        lines += [f'model = PeftModel.from_pretrained(base, "{out}")']
        if num_labels:
            lines += ["# transformers reports the checkpoint's head as newly initialised or resized (MISMATCH) when its "
                      "size differs: the adapter's modules_to_save replaces it"]
    if processor:
        auto = ("AutoTokenizer" if "Tokenizer" in processor else
                "AutoImageProcessor" if "ImageProcessor" in processor else "AutoProcessor")
        lines += [f"from transformers import {auto}", f'processor = {auto}.from_pretrained("{out}")  # {processor}']
        channels = getattr(getattr(g.model, "config", None), "num_channels", None)
        if auto == "AutoImageProcessor" and channels in (1, 3):  # the processor does not convert the mode itself
            mode = "L" if channels == 1 else "RGB"
            lines += [f'# images in mode "{mode}" ({channels} channel{"s" if channels > 1 else ""}), as the model was trained: '
                      f'processor(PIL.Image.open(path).convert("{mode}"), return_tensors="pt")']
    return lines + ["```"]


def _base_cell(g: GlobalModel) -> str:
    """The card's base-model cell: the portable name, and the local folder as a note."""
    name, note = base_model_name(g)
    if name is None:
        return "built by the task (no pretrained folder)"
    adapter = getattr(g.task, "adapter", None)
    start = f"; the run started from the PEFT adapter {adapter.folder}" if adapter is not None else ""
    return f"{name}" + (f" ({note}{start})" if note or start else "").replace("(; ", "(")


def start_folder(g: GlobalModel) -> Path | None:
    """The working directory the run was started in, as its relative task paths tell it: a
    relative ``task.options`` path ``V`` that the run's identity recorded as the absolute ``P``
    gives ``P`` minus ``V``. None when the config names no relative path (or the run recorded no
    inputs)."""
    from fedgalore.job.config import load_config

    try:
        inputs = json.loads((g.run_dir / IDENTITY_FILE).read_text()).get("inputs") or {}
        options = load_config(g.run_dir / "config.yaml").task.options  # as saved (g.cfg has the recorded paths)
    except (OSError, json.JSONDecodeError, ConfigError):
        return None
    for label, fp in inputs.items():
        keys = label.split(".")
        if keys[:2] != ["task", "options"] or "path" not in fp:
            continue
        value: Any = options
        try:
            for k in keys[2:]:
                value = value[int(k) if isinstance(value, list) else k]
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if isinstance(value, str) and not Path(value).expanduser().is_absolute():
            recorded, rel = Path(fp["path"]), Path(value)
            if recorded.parts[-len(rel.parts):] == rel.parts:
                return Path(*recorded.parts[: len(recorded.parts) - len(rel.parts)])
    return None


def _reproduce(g: GlobalModel, out: Path) -> list[str]:
    """The card's reproduce command: the saved config, run from the folder its relative paths
    are relative to, into a fresh output folder (the original run directory may still be there)."""
    config = Path(out).resolve() / EXPORT_CONFIG
    where = start_folder(g)
    run = f"fedgalore run --config {config} output.dir=reproduced"
    if where is None:
        return [f"`{EXPORT_CONFIG}` is the run's saved config:", "", "```bash", run, "```"]
    return [f"`{EXPORT_CONFIG}` is the run's saved config; its relative data paths are relative to the folder the run "
            f"was started in, `{where}`:", "", "```bash", f"cd {where} && {run}", "```"]


def model_card(g: GlobalModel, out: Path, *, fmt: str, model_class: str, processor: str | None, rank: int | None = None,
               matrices: Sequence[tuple[str, LoraFactors]] = (), total: float | None = None,
               check: float | None = None, dense: Sequence[str] = (), num_labels: int | None = None,
               probe: int = 0, exact: Sequence[tuple[str, Any]] = (), adapter_bytes: int | None = None,
               dense_bytes: int | None = None, shipped: bool = False) -> str:
    """The card's Markdown (module docstring). ``model_class``: the transformers class of the
    model; ``processor``: the class of the saved tokenizer / image processor (None: none);
    ``matrices``/``total``: the extraction of ``--rank``; ``check``: the max |Δ logits| against
    the run's global model on ``probe`` test examples; ``dense``: tensors carried whole besides
    the adapters; ``num_labels``: the classifier's label count (None: no classifier); ``shipped``:
    the export carries its base model in :data:`EXPORT_BASE` (:func:`ships_base`)."""
    cfg, summary, record = g.cfg, saved_summary(g.run_dir), g.record()
    desc = g.task.describe()
    method = g.method.describe()
    opts = {k: v for k, v in method.items() if k not in ("name", "rank")}
    lib = "transformers" if fmt == "hf" else "peft"
    done, total_rounds = summary.get("rounds_completed", g.round), summary.get("rounds", cfg.federation.rounds)
    status = summary.get("status", "unknown")
    rounds_row = f"{g.round} exported; {done} completed of {total_rounds} configured"
    if g.live is not None:  # exported while a process ran the run: its summary is a moment of a run going on
        done = max(int(done or 0), g.round)
        status = "still running when exported"
        rounds_row = f"{g.round} exported; {done} of {total_rounds} completed when exported (the run was still running)"
    dead = g.live is None and run_state(g.run_dir).looks_dead
    if dead:  # summary.json still says running, but no process runs it (kill -9, a crash): as `fedgalore status` says
        status = "looks dead: its process was killed or crashed"
        rounds_row = (f"{g.round} exported; {done} completed of {total_rounds} configured (the run stopped without finishing: "
                      f"`fedgalore status {g.run_dir}` says looks dead; `fedgalore run --resume {g.run_dir}` continues it)")
    lines = ["---", f"library_name: {lib}", f"tags: [fedgalore, federated-learning, {cfg.method.name}]", "---", "",
             f"# {cfg.name}: {cfg.method.name} on {cfg.task.name}, round {g.round}", "",
             f"The global model after round {g.round} of the federated run `{g.run_dir}` ({status}, "
             f"{done}/{total_rounds} rounds), exported with `fedgalore export`.", "",
             "| | |", "|---|---|",
             f"| method | {cfg.method.name} (rank {cfg.method.rank}{'; ' + json.dumps(opts) if opts else ''}) |",
             f"| task | {cfg.task.name} ({json.dumps(dict(cfg.task.options)) if cfg.task.options else 'default options'}) |",
             f"| base model | {_base_cell(g)} |",
             f"| partition | {_partition_line(g)} |",
             f"| rounds | {rounds_row} |",
             # ε, δ and the mechanism, as spent by the exported round (privacy.json; docs/privacy.md)
             f"| privacy | {summary_line(read_privacy(g.run_dir), g.round).removeprefix('privacy: ')} |"]
    if "cum_bytes_up" in record:
        lines.append(f"| communication to round {g.round} | up {record['cum_bytes_up']:,} B, down {record['cum_bytes_down']:,} B |")
    lines += ["", "## Data and model files", ""]
    files, when = recorded_inputs(g)
    hidden = [] if _view(g).site_paths else [f for f in files if _site_input(f)]
    files = [f for f in files if f not in hidden]
    if hidden:  # the sites' data paths and file counts stay off the card under DP (fedgalore.privacy.view)
        lines.append(f"{len(hidden)} data input(s) of the sites are not listed ({_view(g).level}: the card names no "
                     "site's files or counts).")
        lines.append("")
    if files:
        lines += [f"What the run read, fingerprinted {when} (SHA-256 digests cut to 32 hex digits; no data is "
                  "copied here):", "", "| input | name | size | fingerprint |", "|---|---|---|---|"]
        lines += [_input_row(f) for f in files]
    elif not hidden:
        lines.append(f"The task's own data (no file recorded): {desc.get('n_train', '?')} training and "
                     f"{desc.get('n_test', '?')} test examples.")
    if desc.get("labels"):
        lines += ["", f"Labels: {', '.join(map(str, desc['labels']))}."]
    lines += ["", f"## Metrics at round {g.round}", ""]
    rows = _metric_rows(record)
    lines += rows if rows else [f"Round {g.round} was not evaluated (federation.eval_every={cfg.federation.eval_every})."]
    if summary.get("final") and summary.get("rounds_completed") != g.round:
        which = "newest test metrics when exported" if g.live is not None or dead else "final test metrics"
        lines += ["", f"The run's {which} (round {summary.get('rounds_completed')}): "
                  + ", ".join(f"{k}={_fmt(v)}" for k, v in summary["final"].items()) + "."]
    lines += ["", "## Load", ""]
    what = {"hf": "A Hugging Face model folder: every adapter merged into the weights.",
            "peft": "A PEFT LoRA adapter of the task's pretrained model (the head and any other trained tensor "
                    "travel whole as `modules_to_save`)."}[fmt]
    if shipped:
        what += (f" The base model travels with it in `{EXPORT_BASE}/` (no hub id names it: {base_model_name(g)[0]} is a folder "
                 "of the machine that ran the federation): the pretrained model the run started from, with the head the "
                 "adapter replaces and the run's labels in its config.json.")
    lines += [what, ""] + _load_snippet(g, out, fmt, model_class, processor, num_labels, shipped)
    if check is not None:
        lines += ["", f"Checked when exported: the loaded folder's logits on {probe} test examples differ from "
                  f"the run's global model by at most {check:.3g}."]
    if rank is not None:
        lines += ["", f"## Rank-{rank} extraction", "",
                  f"Each adapted matrix's change ΔW = W − W0 is cut to its best rank-{rank} approximation (truncated "
                  f"SVD). Total relative Frobenius error: {total:.4g}. {RANK_NOTES.get(cfg.method.name, '')}.", "",
                  "| matrix | shape | rank of ΔW | relative error |", "|---|---|---|---|"]
        for name, f in matrices:
            lines.append(f"| {name} | {f.b.shape[0]}×{f.a.shape[1]} | {f.numerical_rank} | {f.rel_error:.4g} |")
    if exact:
        kept = [(n, f) for n, f in exact if f.rank > 0]
        ranks = [f.rank for _, f in kept]
        lines += ["", "## Exact LoRA", "",
                  f"The run's update W − W0 of each adapted matrix is exactly low-rank; it is stored at its numerical rank "
                  f"(the singular values above the rounding floor of the fp32 weights; fedgalore.trained.lora_exact): ranks "
                  f"{min(ranks)}–{max(ranks)} (sum {sum(ranks)}) over {len(kept)} matrices"
                  + (f"; {len(exact) - len(kept)} unchanged matrices left out" if len(kept) < len(exact) else "") + "."]
        if adapter_bytes is not None and dense_bytes:
            lines.append(f"Adapter tensors: {adapter_bytes:,} B, against {dense_bytes:,} B for those matrices dense (fp32).")
        lines += ["", "| matrix | shape | rank | largest dropped σ (floor) | relative error |", "|---|---|---|---|---|"]
        for name, f in exact:
            lines.append(f"| {name} | {f.b.shape[0]}×{f.a.shape[1]} | {f.rank} | {f.largest_dropped:.3g} ({f.floor:.3g}) | "
                         f"{f.rel_error:.3g} |")
    if dense:
        lines += ["", "Tensors carried whole: " + ", ".join(f"`{n}`" for n in dense) + "."]
    lines += ["", "## Reproduce", ""] + _reproduce(g, out)
    if g.round != total_rounds:
        lines += ["", f"(This export is round {g.round} of that run; checkpoints of other rounds are kept by "
                  "output.keep_checkpoints.)"]
    return "\n".join(lines) + "\n"
