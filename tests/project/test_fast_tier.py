"""The fast tier is chosen by rule, not by hand (tests/README.md, "The fast tier"):

* ``tests/fast_tier.txt`` (written by scripts/select_fast_tier.py from measured durations) names
  collected tests only, and exactly those carry the marker ``fast`` — no test file marks itself;
* its summed recorded durations stay within the budget, no listed test exceeds the per-test cap
  unless it is its package's only one, and every package of ``src/fedgalore`` keeps a test in it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import select_fast_tier as sft  # noqa: E402



def _listed() -> dict[str, float]:
    return sft.read_list()


def test_the_list_is_within_budget_and_touches_every_package():
    listed = _listed()
    assert listed and sum(listed.values()) <= sft.BUDGET_S
    packages = {p.name for p in (ROOT / "src" / "fedgalore").iterdir() if (p / "__init__.py").is_file()}
    touched = {sft.package_of(n) for n in listed}
    assert packages <= touched, f"packages without a fast test: {sorted(packages - touched)}"
    for n, t in listed.items():
        if t > sft.MAX_TEST_S:
            assert sum(sft.package_of(m) == sft.package_of(n) for m in listed) == 1, n


def test_no_test_file_marks_itself_fast():
    marked = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^\s*(@pytest\.mark\.fast\b|pytestmark\s*=.*mark\.fast\b)", p.read_text(), re.M)
              and p.name != "test_fast_tier.py"]
    assert marked == [], f"the tier is tests/fast_tier.txt (scripts/select_fast_tier.py), not a marker in: {marked}"


def test_the_marker_is_applied_exactly_per_the_list():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fast", "-p", "no:xdist",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    collected = {line for line in out.stdout.splitlines() if "::" in line}
    listed = set(_listed())
    assert listed - collected == set(), f"listed but not collected (renamed or removed?): {sorted(listed - collected)[:5]}"
    assert collected == listed


def test_the_rule_keeps_a_packages_only_test_and_drops_the_slowest_first():
    durations = {"tests/a/test_x.py::t1": 0.2, "tests/a/test_x.py::t2": 0.9, "tests/a/test_x.py::t3": 5.0,
                 "tests/b/test_y.py::t1": 3.0}
    assert sft.select(durations, budget=10.0, max_test=1.0) == {"tests/a/test_x.py::t1": 0.2, "tests/a/test_x.py::t2": 0.9,
                                                               "tests/b/test_y.py::t1": 3.0}
    assert sft.select(durations, budget=3.5, max_test=1.0) == {"tests/a/test_x.py::t1": 0.2, "tests/b/test_y.py::t1": 3.0}
