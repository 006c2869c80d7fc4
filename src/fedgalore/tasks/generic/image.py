"""``image_classification``: any ``AutoModelForImageClassification`` checkpoint on your images.

A front end over :class:`~fedgalore.tasks.paper_vision.ImageClassificationTask` (its
loss, collate and metrics: ``accuracy`` (primary), ``macro_f1``). Images come from an image
folder (one sub-folder per class; ``train/`` + ``test/`` folders, or ``test_fraction``) or from a
data set's ``image_column`` (image files' paths — relative ones to the data file's folder — or a
``datasets`` ``Image`` column) with a ``label_column``. They are read lazily, converted to the
checkpoint's channels (RGB, or grayscale when ``config.num_channels`` is 1) and preprocessed by
the checkpoint's image processor — or, for a folder without one (the offline tiny ViT), by a ViT
processor resizing to ``config.image_size`` and normalising with mean 0.5, std 0.5 (said once).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks.base import TaskError, task_option
from fedgalore.tasks.generic.architectures import (classifier_head_modules, load_config, load_with_head, pick_target_modules,
                                                   quiet_transformers, skeleton)
from fedgalore.tasks.generic.common import FileTask, FileTaskOptions
from fedgalore.tasks.generic.data import LabelSet, Rows, is_missing
from fedgalore.tasks.paper_vision import ImageClassificationTask
from fedgalore.typed import to_plain

__all__ = ["ImageClassificationOptions", "ImageExamples", "GenericImageClassificationTask"]


@dataclass(frozen=True)
class ImageClassificationOptions(FileTaskOptions):
    """Options of ``image_classification`` (docs/data.md)."""

    model: str | None = task_option(None, "local folder or hub id of an AutoModelForImageClassification checkpoint; "
                                          "null: the offline tiny ViT (python -m fedgalore.tasks.pretrain_vit)")
    image_column: str = task_option("image", "column holding the image (a file path or a `datasets` Image); an image folder's is 'image'")
    label_column: str = task_option("label", "column holding the class (strings or integers); an image folder's is 'label'")
    labels: tuple[str, ...] | None = task_option(
        None, "the classes in id order (null: the training rows' distinct labels, sorted); needed when the server "
              "never sees a row (Flower with site-local data) or a site may lack a class")
    new_head: bool | None = task_option(
        None, "null: create a head when the checkpoint has none, keep one whose labels are the data's; "
              "true: a fresh seeded head; false: keep the checkpoint's head of the right size")
    verify_images: bool = task_option(
        True, "open every image once at start (PIL verify), so a broken file is one error line before training")


@dataclass
class ImageExamples:
    """Images read on access: ``images[i]`` is a file path or a ``{"bytes", "path"}`` record;
    :meth:`batch` opens, converts (``mode``: ``RGB`` or ``L``) and preprocesses them together
    (``processor``: a transformers image processor) into ``pixel_values`` and ``labels``."""

    images: list
    labels: np.ndarray
    processor: Any
    mode: str = "RGB"

    def __len__(self) -> int:
        return len(self.images)

    def _open(self, i: int):
        from PIL import Image

        src = self.images[i]
        if isinstance(src, dict):
            src = io.BytesIO(src["bytes"]) if src.get("bytes") is not None else src["path"]
        with Image.open(src) as im:
            return im.convert(self.mode)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """``pixel_values`` (B×C×H×W float) and ``labels`` (int64) of the examples at ``indices``."""
        idx = [int(i) for i in indices]
        pixels = self.processor(images=[self._open(i) for i in idx], return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels.float(), "labels": torch.as_tensor(self.labels[idx], dtype=torch.long)}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.batch([i]).items()}


def _check_image(src: Any, rows: Rows, i: int, shown: Any) -> None:
    """Open ``src`` (a path or a ``{"bytes", "path"}`` record) far enough to know it is an image
    PIL can decode (its header and, for PNG, its checksums: ``Image.verify``) — so a broken file is
    one line before any training, not a client failing every round."""
    from PIL import Image

    try:
        if isinstance(src, dict):
            src = io.BytesIO(src["bytes"]) if src.get("bytes") is not None else src["path"]
        with Image.open(src) as im:
            im.verify()
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds; each is the same user error
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}" if str(exc).strip() else type(exc).__name__
        raise TaskError(f"{rows.name}: the image of row {rows.row(i)} ({shown!r}) cannot be read ({why}); replace or "
                        "remove it (task.options.verify_images: false skips this check at start)") from None


def _image_sources(rows: Rows, column: str, verify: bool = True) -> list:
    """The column's images without decoding them: paths (resolved against the data file's folder,
    checked to exist) or ``{"bytes", "path"}`` records of a ``datasets`` ``Image`` column; with
    ``verify`` each one is checked to be a readable image (:func:`_check_image`)."""
    import datasets

    rows.require(column, "image_column")
    feature = rows.data.features[column]
    if isinstance(feature, datasets.Image):
        values = rows.data.cast_column(column, datasets.Image(decode=False))[column]
    else:
        values = rows.data[column]
    out = []
    for i, v in enumerate(values):
        if is_missing(v) or (isinstance(v, dict) and v.get("bytes") is None and not v.get("path")):
            raise TaskError(f"{rows.name}: row {rows.row(i)} has no image in column {column!r}; fill or drop it")
        if isinstance(v, dict):
            if verify:
                _check_image(v, rows, i, v.get("path") or "an image in the data set")
            out.append(v)
            continue
        if not isinstance(v, str):
            raise TaskError(f"{rows.name}: column {column!r} must hold image file paths or images, row {rows.row(i)} holds {v!r}")
        path = Path(v).expanduser()
        if not path.is_absolute() and rows.folder_of(i) is not None:
            path = rows.folder_of(i) / path
        if not path.is_file():
            raise TaskError(f"{rows.name}: the image of row {rows.row(i)} ({v!r}) is not a file "
                            "(relative paths are relative to the data file's folder)")
        if verify:
            _check_image(str(path), rows, i, v)
        out.append(str(path))
    return out


class GenericImageClassificationTask(FileTask, ImageClassificationTask):
    """``image_classification``: an image classifier on your image folder or image column (module
    doc). Classes are fixed by the training rows (sorted folder names / label values) and written
    into the model's ``id2label``; an unseen test label is an error. Head and target modules:
    :mod:`fedgalore.tasks.generic.architectures` (ViT: query, value, attention output, MLP)."""

    name = "image_classification"
    options_class = ImageClassificationOptions

    def __init__(self, options: ImageClassificationOptions | None = None, /, **fields: Any) -> None:
        from transformers import AutoModelForImageClassification

        self.options = opts = options if options is not None else ImageClassificationOptions(**fields)
        self.model_id = self._model_to_load(opts)  # an adapter folder's base (self.adapter)
        self.seed = opts.seed
        config = load_config(self.model_id)
        raw = self._read_rows(opts, [(opts.label_column, "label_column", "label")], present=[(opts.image_column, "image_column")])
        self._require_labels_without_rows(opts)
        self._rows = self._split_rows(opts, raw, opts.label_column)
        train = self._rows["train"]
        self.label_set = LabelSet.given(opts.labels) if opts.labels else LabelSet.from_rows(train, opts.label_column)
        self.classes = list(self.label_set.names)
        if len(self.classes) < 2:
            raise TaskError(f"{train.name}: column {opts.label_column!r} holds one class ({self.classes[0]!r}); a classifier needs at least 2")
        self.image_processor = self._processor(config)
        mode = "L" if int(getattr(config, "num_channels", 3)) == 1 else "RGB"
        self._sets = {split: ImageExamples(_image_sources(rows, opts.image_column, opts.verify_images),
                                           self.label_set.encode(rows, opts.label_column, train.name), self.image_processor, mode)
                      for split, rows in self._rows.items()}
        self._train, self._test = self._sets["train"], self._sets["test"]
        self._checkpoint_labels = [str(config.id2label[i]) for i in sorted(config.id2label)] if config.id2label else None
        config.num_labels = len(self.classes)
        skel = skeleton(AutoModelForImageClassification, config)
        self.head_modules = classifier_head_modules(skel)
        self.target_modules = pick_target_modules(skel, config.model_type, self._adapter_targets(opts), exclude=self.head_modules)
        self.model_type = config.model_type

    @staticmethod
    def default_model() -> Path:
        """The offline tiny ViT folder (:func:`fedgalore.tasks.pretrain_vit.pretrained_vit_dir`),
        pretrained on first use as ``offline_vision`` does (once, about 1.5 minutes on one CPU core,
        from the offline Fashion-MNIST; said in the log); an
        :class:`~fedgalore.tasks.assets.AssetError` when the data to make it is not installed."""
        import logging

        from fedgalore.tasks.pretrain_vit import ensure_pretrained_vit, pretrained_vit_dir

        d = pretrained_vit_dir()
        if not (d / "model.safetensors").is_file():
            logging.getLogger(__name__).warning(
                "image_classification: the offline tiny ViT is not in %s: pretraining it now (once, about 1.5 minutes on "
                "one CPU core; `python -m fedgalore.tasks.pretrain_vit` does this ahead; task.options.model picks another)", d)
            ensure_pretrained_vit()
        return d

    def _processor(self, config: Any) -> Any:
        """The checkpoint's image processor; for a local folder without one, a ViT processor
        (``config.image_size``, mean 0.5, std 0.5 per channel — the offline ViT's convention)."""
        from transformers import AutoImageProcessor

        path = Path(self.model_id).expanduser()
        if path.is_dir() and not (path / "preprocessor_config.json").is_file():
            try:
                from transformers import ViTImageProcessorPil as fallback
            except ImportError:  # pragma: no cover - older transformers
                from transformers import ViTImageProcessor as fallback
            size, channels = int(getattr(config, "image_size", 224)), int(getattr(config, "num_channels", 3))
            self._say_once("processor", "image_classification: %s has no preprocessor_config.json: images are resized to %dx%d and "
                           "normalised with mean 0.5, std 0.5 (save an image processor there to change this)", self.model_id, size, size)
            return fallback(size={"height": size, "width": size}, image_mean=[0.5] * channels, image_std=[0.5] * channels)
        try:
            with quiet_transformers():
                return AutoImageProcessor.from_pretrained(self.model_id)
        except (OSError, ValueError) as exc:
            raise TaskError(f"could not load the image processor of {self.model_id!r} ({str(exc).splitlines()[0][:160]})") from None

    def validation_set(self) -> ImageExamples | None:
        return self._sets.get("validation")

    def processor(self) -> Any:
        """The image processor the images are preprocessed with (saved with an export)."""
        return self.image_processor

    def partition_labels(self) -> np.ndarray:
        return np.asarray(self._train.labels)

    def build_model(self) -> nn.Module:
        """The checkpoint with its head (kept, or created seeded:
        :func:`~fedgalore.tasks.generic.architectures.load_with_head`) and ``id2label`` set."""
        from transformers import AutoModelForImageClassification

        model, created = load_with_head(AutoModelForImageClassification, self.model_id, self.classes,
                                        head_modules=self.head_modules, checkpoint_labels=self._checkpoint_labels,
                                        new_head=self.options.new_head, seed=10_007 + self.seed, dtype=torch.float32)
        if created:
            self._say_once("head", "image_classification: %s gets a new classification head for %d classes (%s; seeded by "
                           "task.options.seed=%d)", self.model_id, len(self.classes), ", ".join(self.head_modules), self.seed)
        return self._apply_adapter(model)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(self.data_description(), model=self.model_id, model_type=self.model_type, label_kind=self.label_set.kind,
                 image_column=self.options.image_column, label_column=self.options.label_column,
                 target_modules=list(self.target_modules), head_modules=list(self.head_modules), options=to_plain(self.options))
        return d

    def prediction_examples(self, rows: Rows) -> ImageExamples:
        """The images of ``rows``' ``image_column`` as model inputs, preprocessed as the task's own
        (placeholder labels: the label column may be absent), for ``fedgalore predict``."""
        sources = _image_sources(rows, self.options.image_column, self.options.verify_images)
        return ImageExamples(sources, np.zeros(len(sources), dtype=np.int64), self.image_processor, self._train.mode)
