"""Methods declare their traits, and nothing outside ``fedgalore.methods`` reads a method any other way.

What the engine, its stages and backends, the Flower apps, ``plan``, ``export`` and the reports may
rely on about a method is its :class:`~fedgalore.methods.traits.MethodTraits` (``Method.traits``,
``Method.traits_for(options)``, ``method.run_traits``) and the operator protocols of
``fedgalore/methods/traits.py``. Checked here on the sources, as tests/project/test_layering.py checks
the imports:

* every registered method class of the package declares ``traits = MethodTraits(...)`` itself (an
  inherited declaration would describe its parent);
* no ``getattr(...)`` / ``hasattr(...)`` outside ``src/fedgalore/methods`` takes a method as its
  object (an expression naming ``method``: ``method``, ``self.method``, ``rt.method``, ``method_class(m)``);
* no comparison outside ``src/fedgalore/methods`` tests a value against a registered method's name
  (``m == "fedgalore"``, ``m in ("fedit", "flora")``, ``m.startswith("fedgalore")``): behaviour
  follows the traits, not the name. Names in messages and docs are fine.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fedgalore.methods  # noqa: F401  (registers the built-in methods)
from fedgalore.methods.base import available_methods, method_class, registration
from fedgalore.methods.traits import MethodTraits, declares_traits

SRC = Path(__file__).resolve().parents[2] / "src" / "fedgalore"
METHODS_DIR = SRC / "methods"
_METHODISH = re.compile(r"method(?!s\b)", re.IGNORECASE)  # method, run.method, method_class; not the package fedgalore.methods

#: getattr / hasattr sites outside methods/ whose object names a method but is not one (file, line text); none
ALLOWED_GETATTR: set[tuple[str, str]] = set()


def builtin_methods() -> list[str]:
    """The registered names whose class is the package's own (tests register their own classes too)."""
    return [n for n in available_methods() if registration(n).cls.__module__.startswith("fedgalore.methods.")]


def undeclared(classes: list[type] | None = None) -> list[str]:
    """One line per method class (default: the built-in ones) that declares no traits of its own."""
    out = []
    classes = sorted({method_class(n) for n in builtin_methods()}, key=lambda c: c.__name__) if classes is None else classes
    for cls in classes:
        if not declares_traits(cls):
            out.append(f"{cls.__name__} declares no traits: add traits = MethodTraits(...) to it "
                       "(fedgalore/methods/traits.py says what each field means)")
    return out


def _outside_methods() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if METHODS_DIR not in p.parents]


def _names_a_method(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        ident = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if ident is not None and _METHODISH.search(ident):
            return True
    return False


def getattr_sites(root: Path = SRC) -> list[str]:
    """``file:line: text`` of every getattr / hasattr on a method outside ``methods/`` under ``root``."""
    out = []
    files = [p for p in sorted(root.rglob("*.py")) if "methods" not in p.relative_to(root).parts[:1]]
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and _names_a_method(node.args[0])):
                rel = str(path.relative_to(root.parent))
                if (rel, lines[node.lineno - 1].strip()) not in ALLOWED_GETATTR:
                    out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def _constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _constants(e)]
    return []


def name_comparisons(root: Path = SRC, names: list[str] | None = None) -> list[str]:
    """``file:line: text`` of every comparison with a registered method's name outside ``methods/``."""
    names = set(builtin_methods() if names is None else names)
    out = []
    files = [p for p in sorted(root.rglob("*.py")) if "methods" not in p.relative_to(root).parts[:1]]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                operands = list(node.comparators)
                if not (isinstance(node.ops[0], (ast.In, ast.NotIn)) and isinstance(node.left, ast.Constant)):
                    operands.append(node.left)  # ("key" in mapping: a key looked up, e.g. the payload header's "fedgalore")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith")):
                operands = list(node.args)
            else:
                continue
            hits = sorted({c for o in operands for c in _constants(o) if c in names})
            if hits:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)} (names {', '.join(hits)})")
    return out


#: the traits each built-in class declares, as recorded when the declarations replaced the attributes the
#: engine read by getattr (equal, name by name and with sync / aggregation options, to what those gave): one
#: record of what each method supports; the other tests derive their method lists from the traits
DECLARED = {
    "fed_sb": MethodTraits(dp_aggregate="mean", coordinate_uploads=True),
    "fedavg_full": MethodTraits(dp_aggregate="mean", coordinate_uploads=True, uploads_dense_deltas=True),
    "fedex_lora": MethodTraits(downlink="factored"),
    "fedgalore": MethodTraits(downlink="factored", moments="uploaded", decay_in_upload=True, dp_aggregate="mean",
                              site_ranks=True, optimizer="galore_adamw", exact_low_rank=True, upload_follows_steps=True),
    "fedit": MethodTraits(dp_aggregate="mean", explicit_adapters=True, exact_low_rank=True),
    "fedsa_lora": MethodTraits(keeps_client_state=True, dp_aggregate="mean", optimizer="sgd"),
    "ffa_lora": MethodTraits(dp_aggregate="mean", optimizer="sgd", explicit_adapters=True, exact_low_rank=True),
    "flexlora": MethodTraits(site_ranks=True),
    "flora": MethodTraits(downlink="factored", site_ranks=True, exact_low_rank=True),
    "fr_lora": MethodTraits(downlink="factored", dp_aggregate="mean", exact_low_rank=True),
    "hetlora": MethodTraits(site_ranks=True),
    "lora_fair": MethodTraits(optimizer="sgd", explicit_adapters=True, exact_low_rank=True),
}


def test_the_declarations_are_the_recorded_ones() -> None:
    classes = {n: method_class(n) for n in builtin_methods() if method_class(n).name == n}  # presets share a class
    assert {n: c.traits for n, c in classes.items()} == DECLARED


@pytest.mark.parametrize("name,options,expect", [
    ("fedgalore", {}, {"moments": "uploaded", "per_client_downlink": True}),
    ("fedgalore_minus", {}, {"moments": "none"}),
    ("fedgalore", {"sync": "aggregate"}, {"moments": "from_aggregate"}),
    ("fedgalore", {"downlink": "dense"}, {"per_client_downlink": False}),
    ("hetlora", {}, {"dp_aggregate": "individual"}),
    ("hetlora", {"aggregation": "weights"}, {"dp_aggregate": "mean", "secure_aggregation": True}),
    ("fed_sb", {}, {"robust_rules": ("trimmed_mean", "median", "krum", "norm_filter")}),
    ("fedit", {}, {"robust_rules": ("krum", "norm_filter"), "per_client_downlink": False}),
])
def test_traits_that_follow_the_options(name, options, expect) -> None:
    from fedgalore.methods.base import get_method

    t = get_method(name, rank=4, **options).run_traits
    assert {k: getattr(t, k) for k in expect} == expect


def test_every_builtin_method_declares_its_traits() -> None:
    assert builtin_methods(), "no built-in method registered"
    assert not undeclared(), "\n".join(undeclared())


def test_a_method_that_declares_nothing_is_told_what_to_declare() -> None:
    from fedgalore.methods.fedit import FedIT

    class Undeclared(FedIT):  # inherits FedIT's traits, declares none of its own
        pass

    assert undeclared([Undeclared, FedIT]) == [
        "Undeclared declares no traits: add traits = MethodTraits(...) to it (fedgalore/methods/traits.py says what "
        "each field means)"]


def test_no_getattr_on_a_method_outside_methods() -> None:
    sites = getattr_sites()
    assert not sites, ("read the method's declared traits (method.traits / method.run_traits, "
                       "fedgalore/methods/traits.py) or its protocols instead of:\n" + "\n".join(sites))


def test_no_branching_on_a_method_name_outside_methods() -> None:
    sites = name_comparisons()
    assert not sites, ("ask the method's traits (fedgalore/methods/traits.py) instead of its name:\n" + "\n".join(sites))


def test_the_checks_see_what_they_look_for(tmp_path) -> None:
    """The detectors flag the old forms (a getattr on a method, a name comparison) in a scratch tree."""
    pkg = tmp_path / "fedgalore"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "methods").mkdir()
    (pkg / "engine" / "x.py").write_text(
        "def f(run, m, q):\n"
        "    a = getattr(run.method, 'needs_client_state', False)\n"
        "    b = getattr(q, 'quant_method', None)\n"
        "    c = m == 'fedit' or m in ('flora', 'x') or m.startswith('fedgalore')\n")
    (pkg / "methods" / "y.py").write_text("def g(method):\n    return getattr(method, 'x', None) or method.name == 'fedit'\n")
    assert [s.split(": ")[0] for s in getattr_sites(pkg)] == ["fedgalore/engine/x.py:2"]
    found = name_comparisons(pkg, ["fedit", "flora", "fedgalore"])
    assert len(found) == 3 and all(s.startswith("fedgalore/engine/x.py:4") for s in found)
