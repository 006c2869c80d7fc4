"""Every built-in method behaves as recorded in tests/golden/tiny_methods.json (two rounds on the
tiny task): keys, shapes, entry kinds, ranks and byte counts exactly, floats within the tolerance
of scripts/check_equivalence.py (its module doc says why those numbers). The recording is made
with the CPU kernels forced down (``ATEN_CPU_CAPABILITY=default``, MKL and oneDNN at most AVX2),
so on a machine with AVX2 or AVX-512 this test checks a recording of other kernels, and
``make test`` runs it again under the recording's own (marker ``isa``).

A refactor must keep this green; a deliberate behaviour change re-records with
``python scripts/check_equivalence.py record tests/golden/tiny_methods.json`` and says why.
The tolerance is shown to pass rounding-scale perturbations and to fail real changes of the
arithmetic (a different learning-rate decay rule, GaLore's weight decay ×10) — those compare
with this process's own run, so they hold whatever the recording's state."""
import copy
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "tiny_methods.json"
sys.path.insert(0, str(ROOT / "scripts"))

import check_equivalence as ce  # noqa: E402

pytestmark = pytest.mark.isa
RECORD = "python scripts/check_equivalence.py record tests/golden/tiny_methods.json"


@pytest.fixture(scope="module")
def here() -> dict:
    """All nine methods run in this process (with this machine's kernels)."""
    return ce.record_all()


def _floats(obj, fn):
    """``obj`` with every float ``x`` replaced by ``fn(x)``."""
    if isinstance(obj, dict):
        return {k: _floats(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_floats(v, fn) for v in obj]
    return fn(obj) if isinstance(obj, float) else obj


def test_nine_methods_match_the_recording(here):
    expected = json.loads(GOLDEN.read_text())
    assert sorted(here["methods"]) == sorted(ce.METHODS) == sorted(expected["methods"])
    diffs = ce.compare(expected, here)
    assert not diffs, (f"{len(diffs)} difference(s) from the recording (made on {expected['cpu_capability']}, "
                       f"checked on {here['cpu_capability']}); after a deliberate change: {RECORD}\n" + "\n".join(diffs[:20]))


def test_the_recording_is_made_with_the_kernels_forced_down():
    expected = json.loads(GOLDEN.read_text())
    assert expected["cpu_capability"] == "DEFAULT" and expected["env"] == ce.LOW_ISA_ENV, (
        f"re-record without --native: {RECORD}")


def test_rounding_scale_perturbations_pass_and_structure_is_exact(here):
    rng = random.Random(0)
    ulp32 = 2.0**-23
    # every float moved by up to 8 fp32 ulps (relative), the size of one kernel's rounding
    jittered = {"methods": _floats(here["methods"], lambda x: x * (1 + rng.randint(-8, 8) * ulp32))}
    assert ce.compare(here, jittered) == []
    # ... and numbers that are rounding noise themselves (the tail energy of a rank-r update) by their own size
    noise = {"methods": _floats(here["methods"], lambda x: 2 * x if abs(x) < 1e-6 else x)}
    assert ce.compare(here, noise) == []
    # a float beyond the tolerance, a byte, a shape, a kind: each is one difference
    moved = copy.deepcopy(here)
    m = moved["methods"]["fedgalore"]
    m["metrics"][1]["eval/loss"] *= 1 + 3 * ce.RTOL
    m["metrics"][1]["bytes_up"] += 1
    name = next(k for k in m["state"]["tensors"] if k.startswith("p/"))
    m["state"]["tensors"][name][1][0] += 1
    m["ledger"]["up"]["tensor_bytes"]["factored"] = 0
    diffs = ce.compare(here, moved)
    assert [d.split(":")[0] for d in diffs] == [
        "methods.fedgalore.ledger.up.tensor_bytes.factored",
        "methods.fedgalore.metrics[1].bytes_up",
        "methods.fedgalore.metrics[1].eval/loss",
        f"methods.fedgalore.state.tensors.{name}[1][0]",
    ]
    # the state hash is compared only bitwise (a recording of this machine and environment)
    other = copy.deepcopy(here)
    other["methods"]["fedit"]["state_sha256"] = "0" * 64
    assert ce.compare(here, other) == [] and len(ce.compare(here, other, exact=True)) == 1
    assert ce.compare(here, here, exact=True) == []


def test_a_different_lr_decay_rule_fails_the_check(here, monkeypatch):
    """Another learning-rate decay rule (linear for cosine, cosine for any other): the check sees it
    in the losses and the final state of both methods."""
    import fedgalore.federated.client as client

    factor = client.lr_factor
    monkeypatch.setattr(client, "lr_factor", lambda step, total, warmup, schedule: factor(
        step, total, warmup, "linear" if schedule == "cosine" else "cosine"))
    methods = ["fedit", "fedgalore"]
    got = ce.record_all(methods)
    for m in methods:
        diffs = ce.compare({"methods": {m: here["methods"][m]}}, {"methods": {m: got["methods"][m]}})
        assert any("train_loss" in d for d in diffs) and any("state.tensors" in d for d in diffs), (m, diffs)


def test_a_changed_weight_decay_constant_fails_the_check(here, monkeypatch):
    """GaLore's decoupled weight decay ×10 (``W ← (1 − 10·lr·wd) W − ...``): FedGaLore fails."""
    import fedgalore.optim.kernels as kernels

    step = kernels.decay_back_project
    monkeypatch.setattr(kernels, "decay_back_project", lambda w, u, basis, side, decay, coef: step(
        w, u, basis, side, 1.0 - 10 * (1.0 - decay), coef))
    got = ce.record_all(["fedgalore"])
    assert ce.compare({"methods": {"fedgalore": here["methods"]["fedgalore"]}}, got)


def test_close_is_relative_with_an_absolute_floor():
    assert ce.close(1.0, 1.0 + 0.9e-3) and not ce.close(1.0, 1.0 + 1.2e-3)
    assert ce.close(0.0, 0.9e-5) and not ce.close(0.0, 1.1e-5)
    assert ce.close(float("nan"), float("nan")) and not ce.close(float("nan"), 1.0)
    assert ce.close(float("inf"), float("inf")) and not ce.close(float("inf"), 1e308)
