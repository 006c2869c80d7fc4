"""``offline_vision_domains``: feature skew on a CPU — Fashion-MNIST drawn in several visual domains.

The paper's image study (§6, DomainNet) is *feature* skew: the same classes seen in different visual
domains (real photos, sketches, clipart, paintings, ...). No such data set ships offline, so this
task builds the established stand-in (rotated / coloured / styled MNIST in the domain-generalisation
and FL literature, e.g. FedBN's digit domains): every Fashion-MNIST image is rendered in one of a
few fixed **styles**, and the style is a column (``domain``) a partition can split by.

* training pool: Fashion-MNIST training images with index ≥ 30,000 (never seen by the pretrained
  tiny ViT), subsampled to ``n_train`` (seeded); each image is given one domain — a seeded,
  balanced assignment (the ``i``-th image of a seeded permutation gets domain ``i mod D``) — and is
  drawn in that domain's style;
* test: ``n_test`` official test images, assigned and drawn the same way (balanced over domains),
  so the primary ``accuracy`` weighs every domain equally; ``evaluate`` on the test set also
  reports ``accuracy_<domain>`` per domain;
* model: the cached tiny ViT pretrained on *photo* (unstyled) Fashion-MNIST classes 0–4
  (:mod:`fedgalore.tasks.pretrain_vit`), fine-tuned with a fresh head on all 10 classes — like an
  ImageNet backbone fine-tuned on DomainNet, the backbone knows one domain only.

Columns a partition can use (``federation.partition``): ``by: domain`` / ``column: domain``
(``pathological:1@domain``: every client holds one domain; ``dirichlet:0.1@domain``: a Dirichlet
mix of domains per client; ``natural:domain``: one client per domain) and ``domain_label``
(``<domain>/<class>``: label and domain skew together, ``dirichlet:0.3@domain_label``).

Styles (:data:`STYLES`; ``domains`` chooses and orders them; the DomainNet domain each one plays
in brackets): ``photo`` — the image as it is (real); ``sketch`` — Sobel edge magnitude, scaled to
0–255 per image (sketch); ``negative`` — 255 − x (a photographic negative: white background);
``rotated`` — a quarter turn counter-clockwise; ``mosaic`` — the sixteen 7×7 tiles (the ViT's
patches) in one fixed permutation; ``noisy`` — Gaussian noise of σ = 64 grey levels, clipped;
``blurred`` — a Gaussian blur of σ = 1.5 px; ``elastic`` — an elastic deformation (Simard et al.
2003: α = 34, σ = 4). Every style is deterministic: the fixed permutation and the elastic fields
come from constant seeds, the noise from the task's seed, so one seed gives the same images on
every machine.

Your own domains: the generic ``image_classification`` task (docs/data.md) with a column naming
each image's domain, partitioned with ``@<column>`` exactly as here.

Provenance: the images are the Debian package ``dataset-fashion-mnist`` (MIT; Xiao et al. 2017),
installed by ``scripts/setup.sh`` like the other offline assets; the styles are computed here, at
load time (about a second for 12,000 images), and nothing new is downloaded or stored.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import ArrayDataset, TaskError, TaskOptions, task_option
from fedgalore.tasks.mnist import FASHION_MNIST_CLASSES, fashion_mnist_dir, load_fashion_mnist, to_pixels
from fedgalore.tasks.paper_vision import OfflineVitOptions, _OfflineVitTask, _subsample

__all__ = ["STYLES", "DEFAULT_DOMAINS", "render", "assign_domains", "OfflineVisionDomainsTask", "VisionDomainsOptions"]


def _photo(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return x.copy()


def _sketch(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    from scipy import ndimage

    f = x.astype(np.float32)
    mag = np.hypot(ndimage.sobel(f, axis=1), ndimage.sobel(f, axis=2))
    peak = mag.reshape(len(x), -1).max(1).reshape(-1, 1, 1)
    return np.round(255.0 * mag / np.maximum(peak, 1e-6)).astype(np.uint8)


def _negative(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (255 - x).astype(np.uint8)


def _rotated(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.ascontiguousarray(np.rot90(x, 1, axes=(1, 2)))


#: the mosaic's tile order: a fixed permutation of the 4 × 4 tiles of 7 × 7 pixels (constant seed)
_MOSAIC_ORDER = np.random.default_rng(7).permutation(16)


def _mosaic(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = len(x)
    tiles = x.reshape(n, 4, 7, 4, 7).transpose(0, 1, 3, 2, 4).reshape(n, 16, 7, 7)[:, _MOSAIC_ORDER]
    return np.ascontiguousarray(tiles.reshape(n, 4, 4, 7, 7).transpose(0, 1, 3, 2, 4).reshape(n, 28, 28))


def _noisy(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.round(x.astype(np.float32) + rng.normal(0.0, 64.0, size=x.shape)), 0, 255).astype(np.uint8)


def _blurred(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    from scipy import ndimage

    return np.round(ndimage.gaussian_filter(x.astype(np.float32), sigma=(0, 1.5, 1.5))).clip(0, 255).astype(np.uint8)


def _elastic(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Simard et al. (2003): displacement fields of uniform noise in [−1, 1], smoothed by a Gaussian
    of σ = 4 px and scaled by α = 34, drawn from a constant seed per image position in the set (so the
    same image index is deformed alike on every machine), bilinear resampling."""
    from scipy import ndimage

    n = len(x)
    field_rng = np.random.default_rng(11)
    out = np.empty_like(x)
    yy, xx = np.meshgrid(np.arange(28), np.arange(28), indexing="ij")
    for i in range(n):
        dy = ndimage.gaussian_filter(field_rng.uniform(-1, 1, (28, 28)), 4.0) * 34.0
        dx = ndimage.gaussian_filter(field_rng.uniform(-1, 1, (28, 28)), 4.0) * 34.0
        warped = ndimage.map_coordinates(x[i].astype(np.float32), [yy + dy, xx + dx], order=1, mode="constant")
        out[i] = np.round(warped).clip(0, 255).astype(np.uint8)
    return out


#: style name -> (render(uint8 N×28×28, rng) -> uint8 N×28×28, one-line description)
STYLES: dict[str, tuple[Callable[[np.ndarray, np.random.Generator], np.ndarray], str]] = {
    "photo": (_photo, "the image as it is (DomainNet's real)"),
    "sketch": (_sketch, "Sobel edge magnitude, 0-255 per image (sketch)"),
    "negative": (_negative, "255 - x: white background, dark garment"),
    "rotated": (_rotated, "a quarter turn counter-clockwise"),
    "mosaic": (_mosaic, "the sixteen 7x7 tiles (the ViT's patches) in one fixed permutation"),
    "noisy": (_noisy, "Gaussian noise of sigma 64 grey levels, clipped"),
    "blurred": (_blurred, "Gaussian blur of sigma 1.5 px"),
    "elastic": (_elastic, "elastic deformation (alpha 34, sigma 4)"),
}

#: the default domains: five, as DomainNet's six without a second photographic one
DEFAULT_DOMAINS = ("photo", "sketch", "negative", "rotated", "mosaic")


def render(images: np.ndarray, style: str, seed: int = 0) -> np.ndarray:
    """``images`` (uint8 N×28×28) drawn in ``style`` (:data:`STYLES`); ``seed`` draws the noise of
    ``noisy`` (the other styles do not depend on it)."""
    if style not in STYLES:
        raise TaskError(f"unknown style {style!r}; styles: {', '.join(STYLES)}")
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise TaskError(f"render needs uint8 images of shape N×28×28, got {images.dtype} {images.shape}")
    return STYLES[style][0](images, np.random.default_rng(seed))


def assign_domains(n: int, num_domains: int, seed: int) -> np.ndarray:
    """A balanced seeded assignment of ``n`` images to ``num_domains`` domains: the ``i``-th index
    of a seeded permutation gets domain ``i mod num_domains`` (sizes differ by at most one)."""
    codes = np.empty(n, dtype=np.int64)
    codes[np.random.default_rng(seed).permutation(n)] = np.arange(n) % num_domains
    return codes


def _draw(x: np.ndarray, codes: np.ndarray, domains: Sequence[str], seed: int) -> np.ndarray:
    out = np.empty_like(x)
    for d, style in enumerate(domains):
        idx = np.flatnonzero(codes == d)
        if idx.size:
            out[idx] = render(x[idx], style, seed * 1000 + d)
    return out


@dataclass(frozen=True)
class VisionDomainsOptions(OfflineVitOptions):
    """Options of ``offline_vision_domains``."""

    n_train: int | None = task_option(10000, "training images (a seeded subset of the 30,000 not used in pretraining); null: all")
    n_test: int | None = task_option(2000, "test images (a seeded subset of the official 10,000, balanced over domains); null: all")
    domains: tuple[str, ...] = task_option(DEFAULT_DOMAINS, "the visual domains, in order (styles: " + ", ".join(STYLES) + ")")
    data_dir: str | None = task_option(None, "folder of the Fashion-MNIST idx.gz files; null: the Debian package's")

    def __post_init__(self) -> None:
        for key in ("n_train", "n_test"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise TaskError(f"task.options.{key}={getattr(self, key)} must be >= 1 (or null for all)")
        doms = list(self.domains)
        unknown = [d for d in doms if d not in STYLES]
        if unknown:
            raise TaskError(f"task.options.domains: unknown style {unknown[0]!r}; styles: {', '.join(STYLES)}")
        if len(doms) < 2 or len(set(doms)) != len(doms):
            raise TaskError(f"task.options.domains={doms} must name at least two different styles "
                            f"(e.g. [{', '.join(DEFAULT_DOMAINS)}])")


class OfflineVisionDomainsTask(_OfflineVitTask):
    """``offline_vision_domains``: the pretrained tiny ViT fine-tuned on Fashion-MNIST drawn in
    ``domains`` (module doc); partition by ``domain`` for feature skew."""

    name = "offline_vision_domains"
    options_class = VisionDomainsOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The tiny ViT and, unless ``data_dir`` is given, the Fashion-MNIST folder."""
        reads = super().input_paths(options)
        return reads if getattr(options, "data_dir", None) else reads | {"data": fashion_mnist_dir(None)}

    def __init__(self, n_train: int | None = 10000, n_test: int | None = 2000, domains: Sequence[str] = DEFAULT_DOMAINS,
                 seed: int = 0, data_dir: str | None = None, checkpoint: str | None = None, auto_pretrain: bool = True) -> None:
        super().__init__(seed, checkpoint, auto_pretrain)
        self.classes = list(FASHION_MNIST_CLASSES)
        self.domains = [str(d) for d in domains]
        x, y = load_fashion_mnist("train", data_dir)
        x, y = x[30000:], y[30000:]
        idx = _subsample(len(y), n_train, 100 + self.seed)
        self._train_domains = assign_domains(len(idx), len(self.domains), 400 + self.seed)
        drawn = _draw(x[idx], self._train_domains, self.domains, 600 + self.seed)
        self._train = ArrayDataset({"pixel_values": to_pixels(drawn), "labels": torch.from_numpy(y[idx])})
        xt, yt = load_fashion_mnist("test", data_dir)
        idx = _subsample(len(yt), n_test, 200 + self.seed)
        self._test_domains = assign_domains(len(idx), len(self.domains), 500 + self.seed)
        drawn = _draw(xt[idx], self._test_domains, self.domains, 700 + self.seed)
        self._test = ArrayDataset({"pixel_values": to_pixels(drawn), "labels": torch.from_numpy(yt[idx])})

    def partition_values(self, column: str | None = None) -> np.ndarray:
        """``None``: the labels; ``domain``: each training image's domain name; ``domain_label``:
        ``<domain>/<class name>`` (label and domain skew together)."""
        if column is None:
            return super().partition_values(None)
        if column == "domain":
            return np.asarray(self.domains, dtype=object)[self._train_domains]
        if column == "domain_label":
            labels = self.partition_labels()
            return np.asarray([f"{self.domains[d]}/{self.classes[c]}" for d, c in zip(self._train_domains, labels)], dtype=object)
        raise TaskError(f"task {self.name!r} has no column {column!r} to partition by; its columns are domain and "
                        "domain_label (or leave the column out for the label)")

    def domain_of_test(self) -> np.ndarray:
        """The domain code (index into :attr:`domains`) of every test image."""
        return self._test_domains.copy()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: Sequence, batch_size: int) -> dict[str, float]:
        """``accuracy``, ``macro_f1``, ``loss``; on the task's own test set also
        ``accuracy_<domain>`` for every domain (the test images drawn in it)."""
        outputs = self.example_outputs(model, examples, batch_size)
        metrics = self.metrics_of_outputs(outputs)
        if examples is self._test:
            from fedgalore.tasks.grouped import accuracy_of

            for d, name in enumerate(self.domains):
                sel = self._test_domains == d
                metrics[f"accuracy_{name}"] = accuracy_of(outputs["pred"][sel], outputs["gold"][sel])
        return metrics

    def describe(self) -> dict[str, Any]:
        counts = np.bincount(self._train_domains, minlength=len(self.domains))
        return {**super().describe(), "domains": list(self.domains),
                "train_per_domain": {d: int(c) for d, c in zip(self.domains, counts)}}
