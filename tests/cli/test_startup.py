"""What a command imports before it does anything (every command took ~10 s at load 5 when each imported torch).

Not timed: the tests check the import structure that makes ``fedgalore --help`` and ``fedgalore
methods`` fast (neither imports torch), that the listing ``methods`` prints without the method
classes is the registry's, and that modules on a run's start path leave scikit-learn, SciPy and
``torch.distributed.tensor`` to the code that uses them. ``benchmarks/startup.py`` measures the times.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedgalore_testing import REPO


HEAVY = ("torch", "transformers", "peft", "flwr", "ray", "opacus", "sklearn", "scipy", "matplotlib", "datasets")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _loaded_after(code: str, modules: tuple[str, ...] = HEAVY) -> tuple[list[str], str]:
    """The ``modules`` in ``sys.modules`` after running ``code`` in a fresh interpreter, and its stdout."""
    proc = _python(f"{code}\nimport sys\nprint('LOADED', [m for m in {modules!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    out, _, loaded = proc.stdout.rpartition("LOADED ")
    return eval(loaded), out  # noqa: S307 - the list literal printed just above


def test_help_and_parser_import_nothing_heavy() -> None:
    loaded, out = _loaded_after("import contextlib, io\nfrom fedgalore.cli import main, build_parser\nbuild_parser()\n"
                                "with contextlib.redirect_stdout(io.StringIO()) as buf:\n    rc = main(['--help'])\n"
                                "print(rc, 'run' in buf.getvalue() and 'methods' in buf.getvalue())")
    assert loaded == [] and out.split() == ["0", "True"], (loaded, out)


def test_methods_lists_without_torch_and_as_the_registry_does(capsys, monkeypatch) -> None:
    loaded, cold = _loaded_after("from fedgalore.cli import main\nmain(['methods'])")
    assert loaded == [], loaded
    # the same text as the live registry's listing of the built-in methods (this process may hold other tests' methods)
    import fedgalore.cli as cli
    from fedgalore.methods.listing import builtin_names, describe_methods

    ours = describe_methods(builtin_names())
    monkeypatch.setattr(cli, "_method_listing", lambda: ours)
    cli.cmd_methods(None)
    assert cold == capsys.readouterr().out
    assert cold.startswith("fed_sb ") and "\nfedgalore_minus " in cold and "    options: as fedgalore\n" in cold


def test_catalog_is_the_registrys_listing() -> None:
    """``methods/catalog.json`` is generated: after changing a method's summary or options, run
    ``python -m fedgalore.methods.listing``."""
    from fedgalore.methods.listing import CATALOG, builtin_names, describe_methods

    assert json.loads(CATALOG.read_text(encoding="utf-8")) == describe_methods(builtin_names()), \
        "src/fedgalore/methods/catalog.json is stale: regenerate it with `python -m fedgalore.methods.listing`"


def test_run_start_modules_leave_metrics_and_dtensor_libraries_to_their_use() -> None:
    """Importing the optimizer, the methods and the metrics (a run's start) pulls in neither
    scikit-learn / SciPy (the first metric does) nor ``torch.distributed.tensor`` (FSDP does)."""
    loaded, _ = _loaded_after("import fedgalore.methods, fedgalore.optim, fedgalore.tasks.metrics, fedgalore.progress",
                              ("sklearn", "scipy", "torch.distributed.tensor", "sympy", "matplotlib"))
    assert loaded == [], loaded
    from fedgalore.tasks.metrics import accuracy, spearman

    assert accuracy([1, 2, 3], [1, 2, 0]) == pytest.approx(2 / 3) and spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_a_classification_evaluation_imports_no_scikit_learn() -> None:
    """Accuracy and macro-F1 — what every classification evaluation reports (an image or text
    ``evaluate``, each run's evaluation) — are numpy: scikit-learn (~0.5 s) is left to the GLUE metrics."""
    loaded, out = _loaded_after("from fedgalore.tasks.metrics import accuracy, macro_f1\n"
                                "print(accuracy([0, 1, 1], [0, 1, 0]), macro_f1([0, 1, 1], [0, 1, 0]))", ("sklearn", "scipy"))
    assert loaded == [] and [float(x) for x in out.split()] == pytest.approx([2 / 3, 2 / 3]), (loaded, out)


def test_sharded_sees_dtensors_once_imported() -> None:
    """``is_sharded`` does not import ``torch.distributed.tensor``, and still recognises a DTensor."""
    proc = _python("import sys, torch\nfrom fedgalore.optim.sharded import is_sharded\n"
                   "a = is_sharded(torch.zeros(2))\nprint(a, 'torch.distributed.tensor' in sys.modules)\n"
                   "from torch.distributed.tensor import DTensor\n"
                   "class Fake(DTensor):\n    pass\n"
                   "print(is_sharded(torch.Tensor._make_subclass(Fake, torch.zeros(2))))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True"], proc.stdout
