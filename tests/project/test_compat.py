"""The compatibility table (fedgalore.compat) agrees with what the library does.

Every registered method × every feature, and every feature × feature, runs one round of a tiny
run (``tiny_text``, 4 sites, one local epoch) — ``Federation(...)``: the config's validation,
the method's options, the runtime (model, data, the client-side stages), the server's stages and
their start; then ``run()`` — and the code's answer (accepted, or the ``ConfigError`` it raised,
or a crash in the round) must be the declared verdict: ✓ accepted as it is; ✓ with settings: refused without them and accepted with
them, and refused without any one of them; ✗ refused. A feature × feature pair runs on the first method the table says runs both.

The sequential backend is told it has SecAgg+ (``backend.secure_aggregation``): that feature's
own place (Flower deployments) is declared as ``Feature.where``, not a method's or a feature's
verdict; a combination with secure aggregation is built, not run (its rounds need Flower).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Mapping

import pytest

from fedgalore import compat
from fedgalore.compat import FEATURES, NOT_FEATURES, method_verdict, pair_verdict
from fedgalore.engine.backends import make_backend
from fedgalore.engine.events import ProgressSink
from fedgalore.engine.loop import Federation
from fedgalore.engine.stages import REGISTRY
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.methods.base import Method, available_methods, method_class
from fedgalore.methods.traits import declares_traits

BASE: dict[str, Any] = {
    "name": "compat", "seed": 0,
    "task": {"name": "tiny_text", "options": {"n_train": 48, "n_test": 16, "hidden_size": 16, "num_layers": 1, "seq_len": 8}},
    "method": {"name": "fedavg_full", "rank": 4, "options": {}},
    "federation": {"num_clients": 4, "clients_per_round": 4, "rounds": 1, "eval_every": 1,
                   "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 2}},
    # local_epochs, not local_steps, and the default weight decay: the settings some features need are the table's
    "train": {"lr": 1.0e-3, "batch_size": 16, "local_epochs": 1},
    "output": {"progress": "quiet"},
    "diagnostics": False,
}
NAMES = [f.name for f in FEATURES]
METHODS = available_methods()


def _set(d: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[last] = value


def _config(method: str, *overrides: Mapping[str, Any]) -> dict[str, Any]:
    import copy

    d = copy.deepcopy(BASE)
    d["method"]["name"] = method
    for ov in overrides:
        for k, v in ov.items():
            _set(d, k, copy.deepcopy(v))
    return d


_ANSWERS: dict[str, str | None] = {}


def code_says(tmp: Path, method: str, *overrides: Mapping[str, Any]) -> str | None:
    """None when the library runs the combination's first round, else its one-line refusal (or,
    for a crash in the round, what crashed). Under secure aggregation the run is built, not run:
    its rounds need Flower's SecAgg+ (module doc)."""
    d = _config(method, *overrides)
    key = repr(d)
    if key not in _ANSWERS:
        run_dir = tmp / f"run{len(_ANSWERS)}"
        d["output"]["dir"] = str(tmp)
        backend = make_backend("sequential", {})
        backend.secure_aggregation = True
        try:
            fed = Federation(FederatedConfig.from_dict(d), run_dir=run_dir, backend=backend, progress=ProgressSink())
        except ConfigError as exc:
            _ANSWERS[key] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return _ANSWERS[key]
        try:
            if d["federation"].get("secure_aggregation") is None:
                fed.run()
            _ANSWERS[key] = None
        except ConfigError as exc:
            _ANSWERS[key] = "in round 1: " + (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - a crash is the code's answer too, said in one line
            _ANSWERS[key] = f"crashed in round 1: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            del fed
    return _ANSWERS[key]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compat")


def _agree(tmp: Path, label: str, verdict: compat.Verdict, method: str, *enable: Mapping[str, Any]) -> None:
    if verdict.kind == "no":
        assert code_says(tmp, method, *enable) is not None, f"{label}: declared ✗ ({'; '.join(verdict.reasons)}), but the code accepts it"
        return
    keys = [k for ov in enable for k in ov]
    if verdict.kind == "with" and len(keys) == len(set(keys)):  # two features of one section: no "without"
        for key in verdict.fix:  # each declared setting is needed: without it (the others given), refused
            others = {k: v for k, v in verdict.fix.items() if k != key}
            assert code_says(tmp, method, *enable, others) is not None, (
                f"{label}: declared ✓ only with {key}={verdict.fix[key]!r} ({'; '.join(verdict.reasons)}), but the code "
                f"accepts it without that setting")
    said = code_says(tmp, method, *enable, verdict.fix)
    assert said is None, f"{label}: declared ✓{' with ' + str(dict(verdict.fix)) if verdict.fix else ''}, but the code refuses: {said}"


@pytest.mark.parametrize("method", METHODS)
def test_base_runs(tmp: Path, method: str) -> None:
    assert code_says(tmp, method) is None, f"the tiny base config itself is refused for {method}: {code_says(tmp, method)}"


@pytest.mark.parametrize("method,name", list(itertools.product(METHODS, NAMES)))
def test_method_feature(tmp: Path, method: str, name: str) -> None:
    _agree(tmp, f"method {method} × feature {name}", method_verdict(method, name), method, compat.feature(name).enable)


def _host(a: str, b: str) -> tuple[str, dict[str, Any]] | None:
    """The first method the table says runs both features (fedavg_full first), with their settings."""
    for m in ["fedavg_full", *METHODS]:
        va, vb = method_verdict(m, a), method_verdict(m, b)
        if va.ok and vb.ok:
            return m, {**va.fix, **vb.fix}
    return None


@pytest.mark.parametrize("a,b", list(itertools.combinations(NAMES, 2)))
def test_feature_pair(tmp: Path, a: str, b: str) -> None:
    host = _host(a, b)
    if host is None:
        pytest.skip(f"no method runs both {a} and {b}")
    method, fix = host
    _agree(tmp, f"features {a} × {b} (method {method})", pair_verdict(a, b), method,
           compat.feature(a).enable, compat.feature(b).enable, fix)


def test_every_stage_declared() -> None:
    covered = {s for f in FEATURES for s in f.stages} | set(NOT_FEATURES)
    for cls in REGISTRY:
        assert cls.name in covered, (f"stage {cls.name!r} ({cls.__module__}) is in no feature of fedgalore.compat.FEATURES: "
                                     "declare a Feature (enable, needs, conflicts) whose stages name it, or add it to NOT_FEATURES "
                                     "with the reason")
    assert covered <= {cls.name for cls in REGISTRY}, "fedgalore.compat names a stage the registry no longer has"


@pytest.mark.parametrize("method", METHODS)
def test_every_method_declares(method: str) -> None:
    """The table reads a method only through its declared traits (and options): a class that
    declares none would get the defaults' verdicts without anyone deciding them."""
    cls = method_class(method)
    assert any(declares_traits(c) for c in cls.__mro__ if c is not Method), (
        f"method {method!r} ({cls.__qualname__}) declares no traits: set traits = MethodTraits(...) on its class "
        "(fedgalore.methods.traits); the compatibility table derives its row from them")


def test_every_conflict_names_a_feature() -> None:
    for f in FEATURES:
        for c in f.conflicts:
            assert c.other in NAMES and c.other != f.name, f"feature {f.name}: conflict with unknown feature {c.other!r}"


def test_docs_page_is_generated() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "compat.md"
    assert page.is_file() and page.read_text(encoding="utf-8") == compat.render_markdown(), (
        f"docs/compat.md differs from the declarations in fedgalore.compat; regenerate it: {compat.REGENERATE}")


def test_cli_prints_the_tables(capsys) -> None:
    """``fedgalore methods --compat`` prints the tables of every registered method."""
    from fedgalore.cli import main

    assert main(["methods", "--compat"]) == 0
    out = capsys.readouterr().out
    assert out == compat.render_markdown(available_methods())
    assert "| `fedit` |" in out and "`site_ranks`" in out
