"""The offline tiny ViT is built the same on every machine: the pinned pretraining
(fedgalore.tasks.pretrain_vit, a child process with portable kernels, MKL's reproducible mode,
one thread, oneDNN off) gives the same model.safetensors whatever the calling process's kernels and
threads, while the unpinned one follows them. Hashes are compared between builds made here, never
with a hash recorded on another machine (tests/cli/test_study_cells.py checks the full ViT's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FORCED = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SMALL = {"epochs": 1, "max_images": 256, "batch_size": 128}
#: a parent process: builds the small ViT into argv[1] (pinned unless argv[2] == "unpinned") with argv[3] threads
PARENT = r"""
import json, sys, torch
from fedgalore.tasks.pretrain_vit import pretrain_tiny_vit
torch.set_num_threads(int(sys.argv[3]))
d = pretrain_tiny_vit(out=sys.argv[1], pinned=sys.argv[2] != "unpinned", **json.loads(sys.argv[4]))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), **json.loads((d / "pretrain.json").read_text())}))
"""


def _fashion_or_skip() -> None:
    try:
        from fedgalore.tasks.mnist import fashion_mnist_dir

        fashion_mnist_dir(None)
    except Exception as exc:  # noqa: BLE001 - any reason the data is missing
        pytest.skip(f"Fashion-MNIST not unpacked: {exc}")


def _clean_env() -> dict[str, str]:
    from fedgalore.tasks.pretrain_vit import _DROPPED_PREFIXES

    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _build_in_parent(out, env: dict[str, str], pinned: bool, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", PARENT, str(out), "pinned" if pinned else "unpinned", str(threads), json.dumps(SMALL)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pinned_env_ignores_the_parents_kernel_settings():
    from fedgalore.tasks.pretrain_vit import PINNED_ENV, pinned_env

    plain = pinned_env({"HOME": "/h", "PATH": "/bin"})
    forced = pinned_env({"HOME": "/h", "PATH": "/bin", **FORCED, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                         "MKL_CBWR": "AUTO", "KMP_AFFINITY": "compact", "DNNL_VERBOSE": "1"})
    assert plain == forced and PINNED_ENV.items() <= plain.items()
    assert plain["HOME"] == "/h" and "KMP_AFFINITY" not in forced


@pytest.mark.slow  # two small pretrainings in child processes: about 20 s
@pytest.mark.isa  # make test runs it again with the CPU kernels forced down: "this process" is then the forced-down one
def test_pinned_pretraining_is_bit_equal_whatever_the_parents_kernels_and_threads(tmp_path):
    """Built from this process (its environment: the default kernels, or the forced-down ones in
    make test's second pass, one thread) and from a parent with the other kernels and 2 threads:
    the same model.safetensors, recorded as pretrain.json's weights_sha256 with what was pinned."""
    _fashion_or_skip()
    import torch

    from fedgalore.tasks.pretrain_vit import NUMERICS_VERSION, PINNED_ENV, pretrain_tiny_vit, weights_sha256

    here = pretrain_tiny_vit(out=tmp_path / "here", **SMALL)
    info = json.loads((here / "pretrain.json").read_text())
    assert info["weights_sha256"] == weights_sha256(here)
    assert info["numerics"]["pinned"] and info["numerics"]["version"] == NUMERICS_VERSION
    assert info["numerics"]["env"] == PINNED_ENV and info["numerics"]["cpu_capability"] == "DEFAULT"
    assert info["numerics"]["threads"] == 1 and info["numerics"]["mkldnn"] is False
    forced_here = os.environ.get("ATEN_CPU_CAPABILITY") == "default"
    other_env = _clean_env() | ({} if forced_here else FORCED)
    other = _build_in_parent(tmp_path / "other", other_env, pinned=True, threads=2)
    assert (other["capability"] == "DEFAULT") != forced_here or torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    assert other["weights_sha256"] == info["weights_sha256"]


@pytest.mark.slow  # two small pretrainings in child processes: about 20 s
def test_unpinned_pretraining_follows_the_kernels(tmp_path):
    """Why the pin: unpinned, the same pretraining with torch's portable kernels and with the CPU's
    own (AVX2 / AVX-512) gives other weights. Skipped on a CPU whose own kernels are the portable ones."""
    _fashion_or_skip()
    own = _build_in_parent(tmp_path / "own", _clean_env(), pinned=False, threads=1)
    if own["capability"] == "DEFAULT":
        pytest.skip("this CPU's own ATen kernels are the portable ones: nothing to compare")
    portable = _build_in_parent(tmp_path / "portable", _clean_env() | {"ATEN_CPU_CAPABILITY": "default"}, pinned=False, threads=1)
    assert portable["capability"] == "DEFAULT" and own["numerics"]["pinned"] is False
    assert own["weights_sha256"] != portable["weights_sha256"]


def test_default_cache_folder_is_versioned_by_the_numerics(tmp_path, monkeypatch):
    """A ViT cached before the pinning (vit-tiny-fmnist04) is not the default folder, so it is never reused."""
    from fedgalore.tasks.pretrain_vit import NUMERICS_VERSION, pretrained_vit_dir

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path))
    assert pretrained_vit_dir() == tmp_path / f"vit-tiny-fmnist04-pinned{NUMERICS_VERSION}"
    assert pretrained_vit_dir("other") == tmp_path / "other"


def test_missing_data_is_a_task_error_before_any_child_starts(tmp_path):
    from fedgalore.tasks.base import TaskError
    from fedgalore.tasks.pretrain_vit import pretrain_tiny_vit

    with pytest.raises(TaskError, match="does not hold the Fashion-MNIST"):
        pretrain_tiny_vit(out=tmp_path / "vit", data_dir=str(tmp_path / "no-such-folder"), **SMALL)
    assert not (tmp_path / "vit").exists()


def test_ensure_builds_the_cached_vit_once_when_two_need_it_at_once(tmp_path, monkeypatch):
    """Two threads (as two processes: each opens the lock file itself) need the missing ViT at once:
    one pretraining, and both get the folder."""
    import threading
    import time

    from fedgalore.tasks import pretrain_vit

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path))
    built = []

    def fake(out):
        built.append(out)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"x")
        return out

    monkeypatch.setattr(pretrain_vit, "pretrain_tiny_vit", fake)
    got = []
    threads = [threading.Thread(target=lambda: got.append(pretrain_vit.ensure_pretrained_vit())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [pretrain_vit.pretrained_vit_dir()] and got == [pretrain_vit.pretrained_vit_dir()] * 2
    assert pretrain_vit.ensure_pretrained_vit() == built[0] and len(built) == 1
