"""Typed task options: every registered task declares its options (a TaskOptions dataclass whose
fields are its constructor's parameters, with the same defaults and a doc each); a misspelled or
bad option is one line naming the task and listing its options; `fedgalore tasks` prints them."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import get_type_hints

import pytest

from fedgalore.cli import main
from fedgalore.tasks import TASKS, TaskError, get_task, parse_task_options, resolved_task_options, task_class
from fedgalore.tasks.base import TaskOptions
from fedgalore.tasks.synthetic import TinyTextOptions, TinyTextTask


TINY = """\
name: tiny
task: {name: tiny_text, options: {n_train: 48, n_test: 16, hidden_size: 16, num_layers: 1, seq_len: 8}}
method: {name: fedgalore, rank: 4}
federation: {num_clients: 3, clients_per_round: 2, rounds: 1, partition: {kind: iid}}
train: {lr: 1.0e-3, batch_size: 16, local_steps: 2}
output: {dir: OUT, progress: quiet}
"""


#: options without a default that a task needs before it resolves (the file-based tasks)
REQUIRED = {"text_classification": {"data": "d.csv"}, "image_classification": {"data": "images"},
            "causal_lm": {"data": "d.jsonl", "prompt_column": "prompt", "response_column": "response"}}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_declares_its_constructor_options(name) -> None:
    cls = task_class(name)
    opts = cls.options_class
    assert opts is not None and issubclass(opts, TaskOptions) and opts.__dataclass_params__.frozen
    sig = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = {f.name: f.default for f in dataclasses.fields(opts)}
    if [p.kind for p in sig] == [inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_KEYWORD]:
        pass  # the file-based tasks: TaskClass(options) or TaskClass(**fields), the options parsed by the dataclass
    else:
        params = {p.name: p.default for p in sig}
        assert fields == params  # same names, same defaults: the constructor keeps working as before
    hints = get_type_hints(opts)
    for f in dataclasses.fields(opts):
        assert f.metadata.get("doc") and f.name in hints
    # "absent" and "default" resolve equal; the resolution is complete (the file-based tasks need their data named)
    need = REQUIRED.get(name, {})
    first = next(k for k in fields if k not in need)
    assert resolved_task_options(name, need) == resolved_task_options(name, {**need, first: fields[first]})
    assert set(resolved_task_options(name, need)) == set(fields)


def _error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_misspelled_or_bad_task_option_is_one_line_through_the_cli(tmp_path, capsys) -> None:
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY.replace("OUT", str(tmp_path / "runs")))
    line = _error(capsys, ["run", "--config", str(cfg), "task.name=offline_text", "task.options={}", "task.options.max_lenght=64"])
    assert line == ("fedgalore: error: task 'offline_text' has no option 'max_lenght'; its options are: max_length, seed, "
                    "limit, dropout, model_path, test_fraction (`fedgalore tasks` lists them with defaults)")
    line = _error(capsys, ["run", "--config", str(cfg), "task.name=offline_text", "task.options={}", "task.options.test_fraction=1.5"])
    assert "task 'offline_text': task.options.test_fraction=1.5 must be in (0, 1); its options are: max_length" in line
    line = _error(capsys, ["run", "--config", str(cfg), "task.options.n_train=many"])
    assert "task 'tiny_text': task.options.n_train must be an integer, got 'many'" in line
    assert not (tmp_path / "runs").exists()  # refused before anything was built


def test_options_checks_run_in_code_too_and_objects_record_their_options() -> None:
    from fedgalore.tasks.paper_text.bbc import OfflineBBCNewsTask

    with pytest.raises(TaskError, match=r"test_fraction=1.5 must be in \(0, 1\)"):
        OfflineBBCNewsTask(test_fraction=1.5)  # the options' check, before any asset is read
    with pytest.raises(TaskError, match="vocab_size=10 must exceed"):
        TinyTextTask(vocab_size=10)
    task = TinyTextTask(8, n_train=20, n_test=8)  # positional and keyword arguments, defaults filled in
    assert task.options == TinyTextOptions(num_classes=8, n_train=20, n_test=8)
    assert task.reported_options() == dataclasses.asdict(TinyTextOptions(num_classes=8, n_train=20, n_test=8))
    built = get_task("tiny_text", n_train=20, n_test=8, num_classes=8)
    assert built.options == task.options and parse_task_options("tiny_text", {"n_train": 20}).n_train == 20

    class Wider(TinyTextTask):  # a subclass whose constructor is not its options: nothing recorded
        def __init__(self, extra: int = 1, **kw) -> None:
            super().__init__(**kw)

    assert Wider(n_train=20, n_test=8).options is None and Wider(n_train=20, n_test=8).reported_options() == {}


def test_tasks_command_prints_options_with_types_defaults_and_docs(capsys) -> None:
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(x.split()[:3]) for x in out.splitlines() if x.startswith("    ")}
    assert ("max_length", "int", "128") in lines and ("model_path", "str", "|") in lines  # "str | None  null"
    assert "    test_fraction          float              0.2                share of each topic's articles" in out
    assert "    image_mean             tuple[float, ...]  [0.5, 0.5, 0.5]" in out
    assert "    model                  str                google/vit-base-patch16-224-in21k  hub id" in out
    assert "options go in task.options" in out
    for name in TASKS:  # every task's options are listed under it
        for f in dataclasses.fields(task_class(name).options_class):
            assert f"    {f.name} " in out
    # docs/cli.md shows an excerpt: every line of it is what the command prints
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    excerpt = doc.split("An excerpt of `fedgalore tasks`:")[1].split("```text\n")[1].split("```")[0]
    shown = [x for x in excerpt.splitlines() if x.strip() and x.strip() != "..."]
    assert len(shown) >= 4 and all(x in out.splitlines() for x in shown), [x for x in shown if x not in out.splitlines()]
