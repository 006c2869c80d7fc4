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

Deterministic: initial weights and batch order come from local generators seeded by ``seed``
(no global RNG is reseeded); with the same torch build and thread count the result is identical.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.assets import cache_dir
from fedgalore.tasks.base import TaskError
from fedgalore.tasks.mnist import load_fashion_mnist, to_pixels

__all__ = ["tiny_vit_config", "pretrained_vit_dir", "pretrain_tiny_vit", "init_vit_weights", "main"]

log = logging.getLogger(__name__)

PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
PRETRAIN_POOL = 30000  # pretraining uses training images [0, 30000); fine-tuning uses [30000, 60000)


def tiny_vit_config(num_labels: int = 10, hidden_size: int = 64, num_layers: int = 4, patch_size: int = 7):
    """The offline tasks' ViT: 28×28×1 input, ``patch_size`` patches, ``hidden_size`` width,
    ``num_layers`` blocks, 4 heads, MLP 4×hidden, no dropout."""
    from transformers import ViTConfig

    return ViTConfig(
        image_size=28, patch_size=patch_size, num_channels=1, hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=4 * hidden_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels,
    )


def pretrained_vit_dir(name: str = "vit-tiny-fmnist04") -> Path:
    """Cache folder of the centrally pretrained tiny ViT (``config.json`` + ``model.safetensors``)."""
    return cache_dir() / name


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
) -> Path:
    """Pretrain the tiny ViT on Fashion-MNIST classes 0–4 and cache it; returns the folder.

    ``max_images`` caps the pretraining images (tests). The defaults run 3 epochs of ≈ 117
    steps (batch 128) on a 0.2 M-parameter model; wall and CPU seconds are recorded in
    ``pretrain.json``.
    """
    from transformers import ViTForImageClassification

    out = Path(out) if out is not None else pretrained_vit_dir()
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
    (tmp / "pretrain.json").write_text(json.dumps(info, indent=2) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m fedgalore.tasks.pretrain_vit [--out DIR] [--epochs N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m fedgalore.tasks.pretrain_vit", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: <cache>/vit-tiny-fmnist04)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="folder with the Fashion-MNIST idx.gz files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = pretrain_tiny_vit(out=args.out, epochs=args.epochs, seed=args.seed, data_dir=args.data_dir)
    except TaskError as exc:
        print(f"error: {exc}")
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
