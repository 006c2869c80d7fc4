"""Every built-in method behaves as recorded in tests/golden/tiny_methods.json (two rounds on the
tiny task): per-round metrics, diagnostics and ledger bytes — bitwise (and the final server state's
SHA-256) on a machine with the recording's CPU kernel set and torch, within 1e-3 relative
elsewhere (float kernels differ across CPUs in the last digits). A refactor must keep this green;
a deliberate behaviour change re-records it (scripts/check_equivalence.py record ...) and says why."""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_equivalence  # noqa: E402


def test_nine_methods_match_the_recording():
    expected = json.loads((ROOT / "tests" / "golden" / "tiny_methods.json").read_text())
    got = check_equivalence.record_all()
    assert sorted(got["methods"]) == sorted(check_equivalence.METHODS) == sorted(expected["methods"])
    exact = (expected["cpu_capability"], expected["torch"]) == (torch.backends.cpu.get_cpu_capability(), torch.__version__)
    diffs = check_equivalence.compare(expected, got, exact=exact, rel=1e-3)
    assert not diffs, "\n".join(diffs[:20])


def test_the_comparison_sees_a_changed_number():
    rec = {"methods": {"m": {"metrics": [{"eval/loss": 1.0}], "state_sha256": "a"}}}
    moved = {"methods": {"m": {"metrics": [{"eval/loss": 1.0 + 2e-3}], "state_sha256": "b"}}}
    assert check_equivalence.compare(rec, moved, exact=False, rel=1e-3)
    assert check_equivalence.compare(rec, moved, exact=True)
    same = {"methods": {"m": {"metrics": [{"eval/loss": 1.0 + 1e-12}], "state_sha256": "b"}}}
    assert not check_equivalence.compare(rec, same, exact=False, rel=1e-3)  # hashes only compared bitwise
