"""``offline_vision_domains``: the styles are the transformations they claim to be, the domain
assignment is balanced and seeded, the ``domain`` / ``domain_label`` columns drive the partitions,
and the per-domain test accuracies add up to the overall accuracy."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fedgalore.tasks import get_task  # noqa: E402
from fedgalore.tasks.base import TaskError  # noqa: E402
from fedgalore.tasks.domains import DEFAULT_DOMAINS, STYLES, assign_domains, render  # noqa: E402


def _fashion_available() -> bool:
    try:
        from fedgalore.tasks.mnist import fashion_mnist_dir

        return (fashion_mnist_dir(None) / "train-images-idx3-ubyte.gz").is_file()
    except Exception:
        return False


needs_fashion = pytest.mark.skipif(not _fashion_available(), reason="Fashion-MNIST not unpacked: run `python -m fedgalore.tasks.assets debian`")


def _images(n: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


def test_styles_are_the_transformations_they_name():
    x = _images()
    assert np.array_equal(render(x, "photo"), x)
    neg = render(x, "negative")
    assert np.array_equal(neg.astype(int), 255 - x.astype(int)) and np.array_equal(render(neg, "negative"), x)
    r = x
    for _ in range(4):  # four quarter turns are the identity, one is not
        r = render(r, "rotated")
        if _ == 0:
            assert not np.array_equal(r, x) and np.array_equal(r[0], np.rot90(x[0]))
    assert np.array_equal(r, x)
    # mosaic: every 7x7 tile of the output is one tile of the input, all 16 used once, the same
    # permutation for every image
    m = render(x, "mosaic")
    tiles = lambda a: a.reshape(len(a), 4, 7, 4, 7).transpose(0, 1, 3, 2, 4).reshape(len(a), 16, 49)  # noqa: E731
    tin, tout = tiles(x), tiles(m)
    perm = [next(j for j in range(16) if np.array_equal(tout[0, i], tin[0, j])) for i in range(16)]
    assert sorted(perm) == list(range(16)) and perm != list(range(16))
    assert all(np.array_equal(tout[k], tin[k][perm]) for k in range(len(x)))
    # sketch: a constant image has no edges; a vertical step has its edge at the step only
    flat = np.full((1, 28, 28), 90, np.uint8)
    assert render(flat, "sketch").max() == 0
    step = np.zeros((1, 28, 28), np.uint8)
    step[:, :, 14:] = 200
    s = render(step, "sketch")[0]
    assert s.max() == 255 and set(np.flatnonzero(s.max(0))) == {13, 14}
    # blur keeps the mean of a smooth image and lowers its variation; noise is seeded
    b = render(x, "blurred").astype(float)
    assert b.std() < 0.5 * x.astype(float).std()
    assert np.array_equal(render(x, "noisy", seed=3), render(x, "noisy", seed=3))
    assert not np.array_equal(render(x, "noisy", seed=3), render(x, "noisy", seed=4))
    assert np.array_equal(render(x, "elastic"), render(x, "elastic"))  # constant fields
    for style in STYLES:
        out = render(x, style)
        assert out.dtype == np.uint8 and out.shape == x.shape


def test_render_refuses_what_it_cannot_draw():
    with pytest.raises(TaskError, match="unknown style 'cartoon'; styles: photo, sketch"):
        render(_images(), "cartoon")
    with pytest.raises(TaskError, match="uint8 images of shape N×28×28"):
        render(np.zeros((2, 32, 32), np.uint8), "photo")


def test_domain_assignment_is_balanced_and_seeded():
    a = assign_domains(103, 5, seed=1)
    assert sorted(np.bincount(a).tolist()) == [20, 20, 21, 21, 21]
    assert np.array_equal(a, assign_domains(103, 5, seed=1)) and not np.array_equal(a, assign_domains(103, 5, seed=2))


def test_options_are_checked():
    with pytest.raises(TaskError, match="unknown style 'oil'"):
        get_task("offline_vision_domains", domains=["photo", "oil"])
    with pytest.raises(TaskError, match="at least two different styles"):
        get_task("offline_vision_domains", domains=["photo", "photo"])
    with pytest.raises(TaskError, match="n_train=0 must be >= 1"):
        get_task("offline_vision_domains", n_train=0)


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    if not _fashion_available():
        pytest.skip("Fashion-MNIST not unpacked")
    from fedgalore.tasks.pretrain_vit import pretrain_tiny_vit

    ckpt = pretrain_tiny_vit(out=tmp_path_factory.mktemp("ckpt") / "vit", epochs=1, max_images=256, batch_size=128)
    return get_task("offline_vision_domains", n_train=600, n_test=250, checkpoint=str(ckpt))


@needs_fashion
def test_columns_and_images_follow_the_domains(small_task):
    task = small_task
    dom = task.partition_values("domain")
    assert sorted(np.unique(dom, return_counts=True)[1].tolist()) == [120] * 5
    assert set(dom.tolist()) == set(DEFAULT_DOMAINS)
    dl = task.partition_values("domain_label")
    labels = task.partition_labels()
    assert all(v == f"{d}/{task.label_names()[c]}" for v, d, c in zip(dl[:50], dom[:50], labels[:50]))
    with pytest.raises(TaskError, match="columns are domain and domain_label"):
        task.partition_values("site")
    # negative images have a bright background, photo images a dark one (the corner pixel, in [-1, 1])
    x = task.train_set().columns["pixel_values"][:, 0]
    corner = x[:, 0, 0].numpy()
    assert corner[dom == "negative"].min() > 0.9 and corner[dom == "photo"].max() < -0.9
    # the same seed draws the same images; another seed another assignment
    again = get_task("offline_vision_domains", n_train=600, n_test=250, checkpoint=str(task.checkpoint))
    assert torch.equal(again.train_set().columns["pixel_values"], task.train_set().columns["pixel_values"])
    other = get_task("offline_vision_domains", n_train=600, n_test=250, seed=1, checkpoint=str(task.checkpoint))
    assert not np.array_equal(other.partition_values("domain"), dom)


@needs_fashion
def test_per_domain_accuracies_make_up_the_accuracy(small_task):
    task = small_task
    model = task.build_model()
    m = task.evaluate(model, task.test_set(), batch_size=100)
    per = [m[f"accuracy_{d}"] for d in task.domains]
    counts = np.bincount(task.domain_of_test(), minlength=len(task.domains))
    assert counts.sum() == 250 and counts.max() - counts.min() <= 1
    assert m["accuracy"] == pytest.approx(float(np.dot(per, counts) / counts.sum()), abs=1e-9)
    # a subset (a client's own examples) gets the overall metrics only
    from fedgalore.tasks.base import subset_examples

    sub = task.evaluate(model, subset_examples(task.test_set(), range(40)), batch_size=100)
    assert set(sub) == {"accuracy", "macro_f1", "loss"}


@needs_fashion
def test_one_domain_per_client_split(small_task):
    from fedgalore.job.clients import split_clients
    from fedgalore.job.config import FederatedConfig

    cfg = FederatedConfig.from_dict({
        "task": {"name": "offline_vision_domains", "options": {"n_train": 600, "n_test": 250}},
        "federation": {"num_clients": 10, "clients_per_round": 2, "rounds": 1,
                       "partition": {"kind": "pathological", "classes_per_client": 1, "by": "domain"}},
    }).validate()
    clients = split_clients(cfg, small_task)
    dom = small_task.partition_values("domain")
    held = [set(dom[p].tolist()) for p in clients.parts]
    assert all(len(h) == 1 for h in held) and set().union(*held) == set(DEFAULT_DOMAINS)
    assert sum(len(p) for p in clients.parts) == 600
