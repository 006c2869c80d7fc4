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
     "dropped": [{"name": site, "size": n}, ...] (sites federation.partition.min_client_size dropped)}

The categories are the column ``federation.partition.by`` names, else the task's label (its
``label_names``); the sizes count the examples each client trains on.
"""
from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from fedgalore.job.clients import Clients, resolve_clients, split_clients
from fedgalore.job.config import FederatedConfig
from fedgalore.federated.checkpoint import atomic_write_text
from fedgalore.federated.partition import label_histograms
from fedgalore.tasks.base import Task

__all__ = ["partition_record", "write_partition_files", "partition_figure", "format_partition", "preview_partition",
           "wrap_label"]


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
    return rec


def partition_figure(rec: dict[str, Any]) -> Any:
    """Clients × categories counts (heat map) under the clients' sizes (bars; held-out parts
    stacked on top when ``client_eval`` split them off), as a matplotlib ``Figure`` (Agg)."""
    from matplotlib.figure import Figure

    h = np.asarray(rec["histograms"], dtype=float).reshape(len(rec["sizes"]), -1)
    m, k = h.shape
    cnames, names = rec["client_names"], rec["label_names"]
    ystep = max(1, k // 30)
    ylabels = [wrap_label(n) for n in names[::ystep]]
    lines = max((t.count("\n") + 1 for t in ylabels), default=1)
    # constrained layout makes room for every tick label (wrapped, never cut: wrap_label)
    fig = Figure(figsize=(min(max(5.0, 0.3 * m + 2.5), 16.0), min(max(3.8, (0.1 + 0.12 * lines) * len(ylabels) + 2.6), 14.0)),
                 layout="constrained")
    turn = max(map(len, map(str, cnames))) * min(m, 40) > 60  # long tick labels: turned
    top, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    x = np.arange(m)
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
    fig.colorbar(im, ax=[top, ax], label="examples", shrink=0.8, pad=0.02)
    return fig


@functools.lru_cache(maxsize=8)
def _png(text: str) -> bytes:
    """The PNG of a ``partition.json`` text. Drawing takes ~0.1-0.2 s; the runs of a comparison
    (every method on one setting and seed) share their split, so it is drawn once per process."""
    buf = io.BytesIO()
    partition_figure(json.loads(text)).savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def write_partition_files(rec: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write ``partition.json`` and ``partition.png`` into ``directory``; returns both paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    text = json.dumps(rec)
    atomic_write_text(d / "partition.json", text)
    (d / "partition.png").write_bytes(_png(text))
    return [d / "partition.json", d / "partition.png"]


def format_partition(rec: dict[str, Any], limit: int = 30) -> str:
    """A short table of the split: per client its size (and held-out size) and largest categories."""
    test = rec.get("test_sizes")
    width = max(6, *(len(str(c["name"])) for c in rec["clients"][:limit]))
    lines = [f"partition {rec['setting']}: {len(rec['clients'])} clients, {sum(rec['sizes'])} training examples"
             + (f", {rec['validation_size']} held out for validation" if rec["validation_size"] else "")
             + ((f", {sum(test)} test rows of the sites' own" if rec.get("kind") == "files" else
                 f", {sum(test)} held out for per-client evaluation") if test else ""),
             f"{'client':<{width}} {'train':>6}" + (f" {'test':>5}" if test else "") + f"  {rec['by'] or 'label'} (largest)"]
    for c in rec["clients"][:limit]:
        top = sorted(c["histogram"].items(), key=lambda kv: -kv[1])[:3]
        share = ", ".join(f"{name} {v / max(c['size'], 1):.0%}" for name, v in top)
        lines.append(f"{str(c['name']):<{width}} {c['size']:>6}" + (f" {test[c['id']]:>5}" if test else "") + f"  {share}")
    if len(rec["clients"]) > limit:
        lines.append(f"... {len(rec['clients']) - limit} more clients (partition.json has them all)")
    sizes = np.asarray(rec["sizes"])
    lines.append(f"sizes: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}")
    if rec.get("dropped"):
        shown = ", ".join(f"{d['name']} ({d['size']})" for d in rec["dropped"][:10])
        more = f" and {len(rec['dropped']) - 10} more" if len(rec["dropped"]) > 10 else ""
        lines.append(f"dropped (min_client_size {rec['options'].get('min_client_size')}): {shown}{more}")
    return "\n".join(lines)


def preview_partition(cfg: FederatedConfig, out: str | Path | None = None, task: Task | None = None) -> tuple[dict[str, Any], Path]:
    """The split ``fedgalore run`` would train on, without building the model or training:
    ``(partition.json record, directory)``, with ``partition.json`` and ``partition.png`` written
    to ``out`` (default ``<output.dir>/partitions/<name>-<setting>-s<seed>``)."""
    from fedgalore.tasks import get_task

    cfg = cfg.validate()
    task = task if task is not None else get_task(cfg.task.name, **cfg.task.options)
    clients = split_clients(cfg, task)
    cfg = resolve_clients(cfg, clients)
    rec = partition_record(cfg, task, clients)
    d = Path(out) if out is not None else Path(cfg.output.dir) / "partitions" / (
        f"{cfg.name}-{cfg.setting_label().replace(':', '')}-s{cfg.seed}")
    write_partition_files(rec, d)
    return rec, d
