"""The offline tasks' tiny ViT: its config, its cache folder and its central pretraining
(``python -m fedgalore.tasks.pretrain_vit``).

The offline vision tasks (``offline_vision``, ``offline_vision_mnist``) fine-tune a pretrained
backbone, as the paper fine-tunes ViT-base. No ViT weights ship in any registry package, so this
module pretrains a small one (:func:`tiny_vit_config`) on
the Fashion-MNIST training images with index < 30,000 and class 0–4 (≈ 15 k images, 5-way
cross-entropy), with AdamW (lr 1e-3, weight decay 0.05, batch 128, 3 epochs, linear warmup
5 % then cosine), and writes ``config.json`` + ``model.safetensors`` (+ ``pretrain.json`` with the
settings, time and held-out accuracy on the test images of classes 0–4) atomically to
``<cache>/vit-tiny-fmnist04/``.

Built the same on every machine. Initial weights and batch order come from local generators
seeded by ``seed`` (no global RNG is reseeded), and the float arithmetic is pinned: the pretraining
runs in a child process (:func:`pretrain_tiny_vit`, ``pinned=True``, the default) whose
environment is :data:`PINNED_ENV`, because what a CPU kernel computes depends on the machine:

* ``ATEN_CPU_CAPABILITY=default``: torch's portable kernels (layer norm, softmax, GELU, the
  reductions, the AdamW step) instead of the AVX2/AVX-512 ones the CPU would pick, whose lane
  widths and FMAs change the rounding;
* ``MKL_CBWR=COMPATIBLE`` (MKL's conditional numerical reproducibility: the same bits on every
  x86 CPU for one MKL version and thread count), with ``MKL_ENABLE_INSTRUCTIONS`` capped, for the
  matrix products (the linear layers, attention and the patch embedding's im2col product);
* one thread (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``torch.set_num_threads(1)``), since a
  threaded reduction adds in another order;
* oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``, ``ONEDNN_MAX_CPU_ISA`` capped as
  well): the patch-embedding ``Conv2d`` takes the im2col + MKL path instead of a oneDNN kernel
  chosen per ISA; ``torch.use_deterministic_algorithms(True)``; flush-denormal off.

A parent's own settings (forced-down kernels, its thread count) do not reach the child.
``pretrain.json`` records what was pinned (``numerics``, :data:`NUMERICS_VERSION`) and
``weights_sha256`` (of ``model.safetensors``), which every study cell that ran on the ViT records
(``benchmarks/_study_cells.py``). The same torch / transformers / MKL versions are assumed (the
lock file's). The pins cost time: the full pretraining took 75 s on one core pinned against 29 s
unpinned (an AMD EPYC with AVX-512, load 1-2; about 85 s and 35 s with the process start).
The cache folder's name carries :data:`NUMERICS_VERSION` (``vit-tiny-fmnist04-pinned1``), so a
ViT cached before the pinning (``vit-tiny-fmnist04``, machine-dependent) is never reused.
``pinned=False`` trains in the calling process, with its kernels and threads (tests only).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.assets import cache_dir
from fedgalore.tasks.base import TaskError
from fedgalore.tasks.mnist import fashion_mnist_dir, load_fashion_mnist, to_pixels

__all__ = ["tiny_vit_config", "pretrained_vit_dir", "pretrain_tiny_vit", "init_vit_weights", "weights_sha256",
           "ensure_pretrained_vit", "pinned_env", "PINNED_ENV", "NUMERICS_VERSION", "main"]

log = logging.getLogger(__name__)

PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
PRETRAIN_POOL = 30000  # pretraining uses training images [0, 30000); fine-tuning uses [30000, 60000)

#: version of the pinned numerics (module doc); part of the cache folder's name, bumped when a pin changes
NUMERICS_VERSION = 1
#: the pretraining child's environment (module doc): portable ATen kernels, MKL's reproducible mode, one thread
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
}
#: environment variables of the parent that the child does not inherit (they would change its kernels)
_DROPPED_PREFIXES = ("ATEN_", "MKL_", "KMP_", "OMP_", "ONEDNN_", "DNNL_", "MKLDNN_")
_ERROR_MARK = "fedgalore-pretrain-error:"


def tiny_vit_config(num_labels: int = 10, hidden_size: int = 64, num_layers: int = 4, patch_size: int = 7):
    """The offline tasks' ViT: 28×28×1 input, ``patch_size`` patches, ``hidden_size`` width,
    ``num_layers`` blocks, 4 heads, MLP 4×hidden, no dropout."""
    from transformers import ViTConfig

    return ViTConfig(
        image_size=28, patch_size=patch_size, num_channels=1, hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=4 * hidden_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )


def pretrained_vit_dir(name: str | None = None) -> Path:
    """Cache folder of the centrally pretrained tiny ViT (``config.json`` + ``model.safetensors``):
    ``<cache>/vit-tiny-fmnist04-pinned<NUMERICS_VERSION>`` (module doc) unless ``name`` is given."""
    return cache_dir() / (name or f"vit-tiny-fmnist04-pinned{NUMERICS_VERSION}")


def weights_sha256(folder: str | Path) -> str:
    """sha256 of ``<folder>/model.safetensors`` (hex): which backbone a run fine-tuned."""
    h = hashlib.sha256()
    with open(Path(folder) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def init_vit_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded ViT initialisation (as transformers' ``_init_weights``, from a local generator):
    Linear/Conv weights and the CLS/position embeddings ~ TruncNormal(0, std²) on [−2std, 2std],
    biases 0, LayerNorm weight 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # LayerNorm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.nn.init.trunc_normal_(torch.empty(p.shape), std=std, a=-2 * std, b=2 * std, generator=g))


def pretrain_tiny_vit(
    out: str | Path | None = None,
    epochs: int = 3,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    max_images: int | None = None,
    data_dir: str | None = None,
    hidden_size: int = 64,
    num_layers: int = 4,
    pinned: bool = True,
) -> Path:
    """Pretrain the tiny ViT on Fashion-MNIST classes 0–4 and cache it; returns the folder.

    ``max_images`` caps the pretraining images (tests). The defaults run 3 epochs of ≈ 117
    steps (batch 128) on a 0.2 M-parameter model; wall and CPU seconds are recorded in
    ``pretrain.json``. ``pinned`` (default): in a child process with the pinned numerics (module
    doc), the same bits on every machine; ``False``: in this process, with its kernels and threads.
    A :class:`~fedgalore.tasks.base.TaskError` (:class:`~fedgalore.tasks.assets.AssetError` for
    missing data) when the pretraining fails.
    """
    out = Path(out) if out is not None else pretrained_vit_dir()
    args = {"out": str(Path(out).resolve()), "epochs": epochs, "batch_size": batch_size, "lr": lr,
            "weight_decay": weight_decay, "seed": seed, "max_images": max_images, "data_dir": data_dir,
            "hidden_size": hidden_size, "num_layers": num_layers}
    fashion_mnist_dir(data_dir)  # the data's errors here, not from the child
    old = pretrained_vit_dir("vit-tiny-fmnist04")
    if out == pretrained_vit_dir() and (old / "model.safetensors").is_file():
        log.warning("the tiny ViT cached in %s was built with this machine's own kernels and is no longer used; "
                    "building %s with pinned numerics", old, out)
    if not pinned:
        return _train(**args, numerics={"version": NUMERICS_VERSION, "pinned": False, **_kernels()})
    return _run_pinned_child(args)


def ensure_pretrained_vit() -> Path:
    """The default cache folder (:func:`pretrained_vit_dir`), pretrained (pinned) first when it holds
    no ``model.safetensors``. Under a file lock beside it, so two processes that need it at once
    (two test workers, two study shards) build it once and neither reads it half-replaced."""
    d = pretrained_vit_dir()
    if (d / "model.safetensors").is_file():
        return d
    try:
        import fcntl
    except ImportError:  # no POSIX locks: build without one
        fcntl = None
    with open(d.with_name(f".{d.name}.lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "model.safetensors").is_file():
            pretrain_tiny_vit(out=d)
    return d


def pinned_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) without the variables that choose kernels or threads, plus
    :data:`PINNED_ENV`, and a ``PYTHONPATH`` under which the child imports this fedgalore."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(_DROPPED_PREFIXES)}
    env.update(PINNED_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _run_pinned_child(args: dict) -> Path:
    from fedgalore.tasks.assets import AssetError

    code = "import sys, json; from fedgalore.tasks.pretrain_vit import _pinned_child; _pinned_child(json.loads(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=pinned_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr.splitlines():
        if line.startswith(_ERROR_MARK):
            kind, _, msg = line[len(_ERROR_MARK):].partition(" ")
            raise (AssetError if kind == "AssetError" else TaskError)(msg)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
        raise TaskError(f"pretraining the tiny ViT failed in its pinned child process: {tail[0]}")
    for line in proc.stderr.splitlines():
        if line.startswith("pretrain"):
            log.info("%s", line)
    return Path(args["out"])


def _kernels() -> dict:
    """What this process's kernels are (recorded in ``pretrain.json``'s ``numerics``)."""
    import transformers

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "mkldnn": bool(torch.backends.mkldnn.enabled), "torch": torch.__version__, "transformers": transformers.__version__}


def _pinned_child(args: dict) -> None:
    """The child process of a pinned pretraining (module doc); errors as one marked line on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    torch.set_flush_denormal(False)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            numerics = {"version": NUMERICS_VERSION, "pinned": True, "env": dict(PINNED_ENV),
                        "deterministic_algorithms": True, **_kernels()}
            _train(**args, numerics=numerics)
    except TaskError as exc:
        print(f"{_ERROR_MARK}{type(exc).__name__} {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _train(out: str | Path, epochs: int, batch_size: int, lr: float, weight_decay: float, seed: int,
           max_images: int | None, data_dir: str | None, hidden_size: int, num_layers: int, numerics: dict) -> Path:
    """The pretraining itself, in this process (:func:`pretrain_tiny_vit`)."""
    from transformers import ViTForImageClassification

    out = Path(out)
    x, y = load_fashion_mnist("train", data_dir)
    keep = np.flatnonzero(np.isin(y[:PRETRAIN_POOL], PRETRAIN_CLASSES))
    if max_images is not None:
        keep = keep[: int(max_images)]
    xs, ys = to_pixels(x[keep]), torch.from_numpy(y[keep])
    xt, yt = load_fashion_mnist("test", data_dir)
    tkeep = np.flatnonzero(np.isin(yt, PRETRAIN_CLASSES))[:2000]
    xv, yv = to_pixels(xt[tkeep]), torch.from_numpy(yt[tkeep])

    cfg = tiny_vit_config(num_labels=len(PRETRAIN_CLASSES), hidden_size=hidden_size, num_layers=num_layers)
    model = ViTForImageClassification(cfg)
    init_vit_weights(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed + 1)
    steps_per_epoch = math.ceil(len(ys) / batch_size)
    total, warm = epochs * steps_per_epoch, max(1, int(0.05 * epochs * steps_per_epoch))
    t0, c0, step = time.perf_counter(), time.process_time(), 0
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(ys), generator=g)
        running = 0.0
        for start in range(0, len(ys), batch_size):
            idx = order[start : start + batch_size]
            factor = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total - warm, 1)))
            for group in opt.param_groups:
                group["lr"] = lr * factor
            loss = nn.functional.cross_entropy(model(pixel_values=xs[idx]).logits, ys[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            running += float(loss.detach()) * len(idx)
            step += 1
        log.info("pretrain epoch %d/%d: loss %.4f (%.0f s)", epoch + 1, epochs, running / len(ys), time.perf_counter() - t0)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model.eval()
    with torch.no_grad():
        acc = float((torch.cat([model(pixel_values=xv[i : i + 500]).logits.argmax(-1) for i in range(0, len(yv), 500)]) == yv).float().mean())
    log.info("pretrained tiny ViT: held-out accuracy %.4f on Fashion-MNIST test classes 0-4, %.0f s", acc, seconds)

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    info = {
        "data": "Fashion-MNIST train images [0, 30000) with class in 0-4",
        "n_images": int(len(ys)), "epochs": epochs, "batch_size": batch_size, "lr": lr,
        "weight_decay": weight_decay, "seed": seed, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
        "threads": torch.get_num_threads(), "heldout_accuracy_classes_0_4": acc,
        "params": int(sum(p.numel() for p in model.parameters())),
    }
    info["numerics"] = numerics
    info["weights_sha256"] = weights_sha256(tmp)
    (tmp / "pretrain.json").write_text(json.dumps(info, indent=2) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m fedgalore.tasks.pretrain_vit [--out DIR] [--epochs N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m fedgalore.tasks.pretrain_vit", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: <cache>/vit-tiny-fmnist04-pinned1)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST idx.gz files")
    parser.add_argument("--unpinned", action="store_true",
                        help="train in this process with this machine's kernels and threads (not the same bits everywhere)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = pretrain_tiny_vit(out=args.out, epochs=args.epochs, seed=args.seed, data_dir=args.data_dir,
                                 pinned=not args.unpinned)
    except TaskError as exc:
        print(f"error: {exc}")
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
