"""Choose the fast tier (marker ``fast``, ``make test-fast``) from measured test durations.

Reads a pytest JUnit report (``--junitxml``; each test's time is its setup + call + teardown) of the
candidate tests and writes ``tests/fast_tier.txt``: one ``<seconds>\\t<node id>`` line per chosen test.
``tests/conftest.py`` marks exactly the listed tests ``fast`` (no test file carries the marker), and
``tests/project/test_fast_tier.py`` checks the list: every entry is a collected test, the summed
durations stay within ``BUDGET_S``, and every package of ``src/fedgalore`` keeps a test in the tier.

The rule (tests/README.md, "The fast tier"): skipped tests are left out; every test of at most
``--max-test`` seconds is kept; if the sum still exceeds ``--budget``, the slowest are dropped until it
fits — except a package's last test, which stays so every package is touched.

Measure the candidates (the current tier, one process, so the times add up to the tier's CPU time):

    .venv/bin/python -m pytest -m fast -p no:xdist -q --junitxml=/tmp/fast.xml
    .venv/bin/python scripts/select_fast_tier.py /tmp/fast.xml

To add new tests as candidates, run them with ``--junitxml`` too and pass every report.
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "fast_tier.txt"
#: summed recorded seconds the tier may take (measured one process at a time on the shared 2-core machine)
BUDGET_S = 90.0
#: a test slower than this is not in the tier (unless it is its package's only one)
MAX_TEST_S = 1.0

HEADER = """\
# The fast tier: make test-fast runs exactly these tests (tests/conftest.py marks them `fast`).
# Written by scripts/select_fast_tier.py from a JUnit report of one process; do not edit by hand.
# Columns: recorded seconds (setup + call + teardown), pytest node id. Rule and numbers: tests/README.md.
"""


def node_id(classname: str, name: str) -> str:
    """A JUnit ``classname`` / ``name`` pair as pytest's node id (``tests/a/test_b.py::[Class::]name``)."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = Path(*parts[:i]).with_suffix(".py")
        if (ROOT / path).is_file():
            return "::".join([path.as_posix(), *parts[i:], name])
    raise ValueError(f"no test file for JUnit class {classname!r}")


def read_report(path: Path) -> dict[str, float]:
    """``{node id: seconds}`` of the tests a JUnit report ran (skipped ones left out)."""
    out: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        out[node_id(case.get("classname", ""), case.get("name", ""))] = float(case.get("time", 0.0))
    return out


def package_of(node: str) -> str:
    """The ``src/fedgalore`` package a test belongs to: its folder under ``tests/`` (tests/README.md's layout)."""
    parts = node.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else "<top>"


def select(durations: dict[str, float], budget: float = BUDGET_S, max_test: float = MAX_TEST_S) -> dict[str, float]:
    """The chosen tests (module doc's rule)."""
    chosen = {n: t for n, t in durations.items() if t <= max_test}
    for pkg in {package_of(n) for n in durations} - {package_of(n) for n in chosen}:  # its fastest test stays
        n = min((n for n in durations if package_of(n) == pkg), key=durations.__getitem__)
        chosen[n] = durations[n]
    for n in sorted(chosen, key=chosen.__getitem__, reverse=True):
        if sum(chosen.values()) <= budget:
            break
        if sum(package_of(m) == package_of(n) for m in chosen) > 1:
            del chosen[n]
    return chosen


def write_list(chosen: dict[str, float], path: Path = LIST) -> None:
    """``tests/fast_tier.txt``: the header, then the chosen tests by node id."""
    lines = [f"{chosen[n]:.3f}\t{n}" for n in sorted(chosen)]
    path.write_text(HEADER + "\n".join(lines) + "\n")


def read_list(path: Path = LIST) -> dict[str, float]:
    """``{node id: recorded seconds}`` of the committed list."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            t, n = line.split("\t", 1)
            out[n] = float(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="JUnit XML reports of the candidate tests")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"summed seconds (default {BUDGET_S:g})")
    ap.add_argument("--max-test", type=float, default=MAX_TEST_S, help=f"slowest test kept (default {MAX_TEST_S:g} s)")
    ap.add_argument("--out", type=Path, default=LIST)
    args = ap.parse_args(argv)
    durations: dict[str, float] = {}
    for r in args.reports:
        durations.update(read_report(r))
    chosen = select(durations, args.budget, args.max_test)
    write_list(chosen, args.out)
    print(f"{len(chosen)} of {len(durations)} candidate tests, {sum(chosen.values()):.1f} s of "
          f"{sum(durations.values()):.1f} s recorded, {len({package_of(n) for n in chosen})} packages -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
