"""What a study cell ran on (benchmarks/_study_cells.py): every cell records the model and data
files' hashes and the backbone's weights hash, a study refuses cells from two backbones, and the
committed small cell (benchmarks/_repro_cell.py) reproduces on this checkout: the same pinned
backbone, bit for bit, and the metrics within the stated tolerance."""
from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def cells_lib(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_study_cells")


@pytest.fixture()
def repro(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    yield importlib.import_module("_repro_cell")
    torch.set_flush_denormal(False)  # run_cell turns it on for the process; torch's default is off


def _cell(h: str | None) -> dict:
    return {"version": 1, "config": {}, "test_last": 0.5} | ({"backbone": {"weights_sha256": h}} if h else {})


def test_one_backbone_accepted_and_historical_cells_too(cells_lib):
    assert cells_lib.check_one_backbone({"a": _cell("f" * 64), "b": _cell("f" * 64)}) == "f" * 64
    assert cells_lib.check_one_backbone({"a": _cell(None), "b": _cell(None)}) is None  # all from before: as they were
    assert cells_lib.check_one_backbone({}) is None


def test_two_backbones_refused_naming_two_cells(cells_lib):
    with pytest.raises(cells_lib.BackboneMismatch, match=r"cells a_s1 and b_s1 ran on different backbones \(aaaaaaaaaaaa vs bbbbbbbbbbbb\)"):
        cells_lib.check_one_backbone({"a_s1": _cell("a" * 64), "b_s1": _cell("b" * 64), "c_s1": _cell("a" * 64)})


def test_recorded_and_unrecorded_backbones_refused(cells_lib, tmp_path):
    (tmp_path / "old_s1.json").write_text(json.dumps(_cell(None)))
    (tmp_path / "new_s1.json").write_text(json.dumps(_cell("c" * 64)))
    with pytest.raises(cells_lib.BackboneMismatch, match=r"cells old_s1 \(backbone not recorded.*\) and new_s1 \(backbone cccccccccccc\)"):
        cells_lib.check_one_backbone(tmp_path.glob("*.json"))
    assert list(cells_lib.load_cells(tmp_path)) == ["new_s1", "old_s1"]


def _fashion_or_skip() -> None:
    try:
        from fedgalore.tasks.mnist import fashion_mnist_dir

        fashion_mnist_dir(None)
    except Exception as exc:  # noqa: BLE001 - any reason the data is missing
        pytest.skip(f"Fashion-MNIST not unpacked: {exc}")


@pytest.mark.isa  # make test runs it again with the CPU kernels forced down: the tolerance must hold there too
def test_committed_cell_reproduces(repro, cells_lib, tmp_path):
    """Re-run the committed small cell's config here (the first run on a machine pretrains the tiny
    ViT, about 1.5 min on one core; seconds after): the backbone's weights hash and the data files'
    hash are the committed ones (the pinned build is the same on every machine), and the per-round
    train and test loss and accuracy are within ``TOLERANCE``. A cell written beside one from
    another backbone is refused."""
    _fashion_or_skip()
    committed = json.loads(repro.CELL.read_text())
    assert committed["config"] == repro.config() and committed["version"] == repro.CELL_VERSION
    new = repro.run(tmp_path / "cells" / "small.json", tmp_path / "run")
    assert new["backbone"]["weights_sha256"] == committed["backbone"]["weights_sha256"], \
        "the pinned tiny ViT built here differs from the committed cell's (fedgalore.tasks.pretrain_vit)"
    assert new["backbone"]["numerics"]["version"] == committed["backbone"]["numerics"]["version"]
    assert new["inputs"]["task.reads.data"]["sha256"] == committed["inputs"]["task.reads.data"]["sha256"]
    assert len(new["rounds"]) == len(committed["rounds"]) == repro.config()["federation"]["rounds"]
    tol = repro.TOLERANCE
    for a, b in zip(new["rounds"], committed["rounds"]):
        for key, t in (("train_loss", tol["loss"]), ("test_loss", tol["loss"]), ("test_accuracy", tol["accuracy"])):
            assert math.isfinite(a[key]) and abs(a[key] - b[key]) <= t, (a["round"], key, a[key], b[key])
    assert abs(new["test_last"] - committed["test_last"]) <= tol["accuracy"]

    from fedgalore.job.config import FederatedConfig

    other = dict(committed, backbone={**committed["backbone"], "weights_sha256": "0" * 64})
    (tmp_path / "cells" / "other.json").write_text(json.dumps(other))
    cfg = FederatedConfig.from_dict({**repro.config(), "output": {"dir": str(tmp_path / "run")}})
    with pytest.raises(cells_lib.BackboneMismatch, match="other and small ran on different backbones"):
        cells_lib._write(tmp_path / "cells" / "small.json", dict(new), cfg)
