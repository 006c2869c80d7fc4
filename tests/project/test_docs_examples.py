"""The documentation's examples run as written: every command in the ``bash`` blocks of
README.md, docs/cli.md, docs/scale-out.md and examples/flower/README.md, and their Python and
YAML examples, at a tiny budget (docs/remedies.md's commands are covered here and run in
tests/federated/test_fedprox_scaffold.py).

A tiny budget means: budget overrides appended (``task.options.limit=80 ...`` and few rounds on
the offline text pipeline — 2 per comparison cell, at most 5 per run, 3 when a run sets none; a
tiny random model for the paper pipelines), ``--seeds 0`` for a seed list, 4 rounds for extending
a run (of 3), and a temporary folder for absolute output paths. Every command is classified; a
command in the docs that no rule covers fails :func:`test_every_documented_command_is_covered`,
so new examples get a test. Commands that take hours (the staged studies) are checked to exist;
the multi-machine Flower deployment is checked against the options its programs accept.
"""
from __future__ import annotations

import json

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedgalore.cli import main
from fedgalore_testing import REPO, TINY_TEXT, minilm_or_skip
from fedgalore_testing.docs import _tiny, blocks, commands, kind

DOCS = ["README.md", "docs/cli.md", "docs/scale-out.md", "examples/flower/README.md", "docs/remedies.md"]


def test_every_documented_command_is_covered() -> None:
    found = {doc: commands(doc) for doc in DOCS}
    assert sum(len(c) for c in found.values()) > 40
    uncovered = [(doc, c) for doc, cs in found.items() for c in cs if kind(c) == "uncovered"]
    assert not uncovered, f"documented commands without a test rule: {uncovered}"


def test_static_examples_hold() -> None:
    """Environment commands: the venv's activate script, the pip extras, the Flower example folder;
    no reference to a DESIGN.md outside the repository or to a `fedgalore resume` command."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for doc in DOCS:
        for cmd in commands(doc):
            if kind(cmd) == "venv":
                assert (REPO / ".venv" / "bin" / "activate").is_file() or not (REPO / ".venv").exists()
            if kind(cmd) == "extra":
                assert re.search(r"\[(\w+)\]", cmd).group(1) in extras, cmd
            if kind(cmd) == "cd":
                assert (REPO / "examples" / "flower" / "pyproject.toml").is_file()
        text = (REPO / doc).read_text()
        assert "fedgalore resume" not in text, doc
    for path in [*REPO.glob("docs/*.md"), REPO / "README.md", REPO / "src/fedgalore/compare.py", REPO / "src/fedgalore/methods/base.py"]:
        assert "DESIGN.md" not in path.read_text(), path


def test_long_studies_exist(capsys) -> None:
    """`fedgalore repro NAME` / `fedgalore bench NAME ...` (hours) name real experiments and benchmarks."""
    assert main(["repro", "--list"]) == 0
    experiments = set(capsys.readouterr().out.split())
    assert main(["bench", "--list"]) == 0
    benches = set(capsys.readouterr().out.split())
    for doc in DOCS:
        for cmd in commands(doc):
            if kind(cmd) == "long":
                _, what, name = cmd.split()[:3]
                assert name in (experiments if what == "repro" else benches | {"all"}), cmd


@pytest.mark.slow
@pytest.mark.assets
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("doc", ["README.md", "docs/cli.md", "docs/scale-out.md"])
def test_documented_cli_commands_run(doc, tmp_path, monkeypatch, capsys) -> None:
    """Every `fedgalore ...` command of README.md, docs/cli.md and docs/scale-out.md, in the doc's
    order, one working folder per doc (so `report` and `--resume` find what the doc's earlier
    commands wrote; each doc stands on its own, as a reader starting at it would)."""
    minilm_or_skip()
    pytest.importorskip("ray")
    import torch

    (tmp_path / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(blocks("docs/cli.md", "yaml")[0])  # "Save this as tiny.yaml"
    ran = 0
    for doc in (doc,):
        for cmd in commands(doc):
            if kind(cmd) != "cli":
                continue
            argv = shlex.split(cmd)[1:]
            if "conf/pipeline/glue_roberta.yaml" in argv and not torch.cuda.is_available():
                # as written (device: cuda) on a CPU-only torch: one line naming the fix
                assert main(argv) == 2, cmd
                assert "device=cuda but this torch" in capsys.readouterr().err
            rc = main(_tiny(argv, tmp_path))
            captured = capsys.readouterr()
            assert rc == 0, f"{doc}: {cmd}\n{captured.err[-2000:]}"
            ran += 1
    assert ran >= {"README.md": 5, "docs/cli.md": 20, "docs/scale-out.md": 3}[doc]
    if doc == "docs/cli.md":
        import json

        assert json.loads((tmp_path / "runs" / "long" / "summary.json").read_text())["rounds_completed"] == 4  # extended


@pytest.mark.slow
@pytest.mark.assets
def test_readme_python_api_example(tmp_path, monkeypatch) -> None:
    """README's Python block, at a tiny budget (the 2-round run, the optimizer on its own, the imports)."""
    minilm_or_skip()
    (tmp_path / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path)
    code = blocks("README.md", "python")[0]
    assert '["federation.rounds=2"]' in code
    code = code.replace('["federation.rounds=2"]', repr(["federation.rounds=2", "output.progress=quiet", *TINY_TEXT]))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the documentation's own example
    assert scope["result"].summary["rounds_completed"] == 2 and "accuracy" in scope["result"].summary["final"]
    assert set(scope["update"]) == {n for n, p in scope["model"].named_parameters() if p.ndim == 2}


def _own_data_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Your own data")
    return text[start:text.index("\n## ", start + 1)]


def _bbc_news_csv(path: Path, per_topic: int = 12, sites: int = 3) -> None:
    """``body, topic, site``: the first ``per_topic`` offline BBC News articles of each topic, one
    site after another."""
    import csv

    from fedgalore.tasks.assets import bbc_news_dir

    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["body", "topic", "site"])
        for folder in sorted(p for p in bbc_news_dir().iterdir() if p.is_dir()):
            for i, f in enumerate(sorted(folder.glob("*.txt"))[:per_topic]):
                out.writerow([" ".join(f.read_text(errors="replace").split()), folder.name, f"site{i % sites}"])


@pytest.mark.assets
def test_readme_own_data_as_written(tmp_path, monkeypatch, capsys) -> None:
    """README "Your own data": its YAML saved as news.yaml beside a 60-row news.csv (offline BBC
    News, 3 sites), then its three commands as written: the run (clients = sites), the export and
    the load with plain transformers in a fresh process."""
    minilm_or_skip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))  # the tokenised-set cache; MiniLM is a package
    section = _own_data_section()
    (yaml,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(yaml.strip().splitlines()) <= 15  # the YAML a user copies stays short
    Path("news.yaml").write_text(yaml)
    _bbc_news_csv(tmp_path / "news.csv")
    cmds = [c for c in commands("README.md") if kind(c) == "own-data"]
    assert len(cmds) == 4 and all(c in section for c in cmds)
    for cmd in cmds:
        argv = shlex.split(cmd)
        if argv[0] == "fedgalore":
            rc = main(argv[1:] + (["--progress", "quiet"] if argv[1] == "run" else []))
            assert rc == 0, f"{cmd}\n{capsys.readouterr().err[-2000:]}"
            if argv[1] == "tune":  # the recommendation, from the held-out seeds
                report = json.loads((tmp_path / "runs" / "tune-news" / "tune_report.json").read_text())
                assert report["heldout"][0]["seeds"] == [1] and report["heldout"][0]["rows"]
                assert "run **" in (tmp_path / "runs" / "tune-news" / "tune_report.md").read_text()
        else:
            assert argv[:2] == ["python", "-c"], cmd
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # transformers alone, no fedgalore
            done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, env=env, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.strip().splitlines()[-1] == "{0: 'business', 1: 'entertainment', 2: 'politics', 3: 'sports', 4: 'tech'}"
    run = tmp_path / "runs" / "news-fedgalore-naturalsite-s0"

    part = json.loads((run / "partition.json").read_text())
    assert part["client_names"] == ["site0", "site1", "site2"] and sum(part["sizes"]) == 50  # round(0.2 · 12) = 2 per topic held out
    rounds = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    exported = json.loads((tmp_path / "exported" / "news" / "fedgalore_export.json").read_text())
    assert exported["round"] == 3 and exported["check_max_abs_logit_diff"] < 1e-4

    # docs/cli.md's commands on this run and export (evaluate --by site, predict), as written; new.csv:
    # the rows to predict, news.csv without its labels
    import pandas as pd

    pd.read_csv("news.csv").drop(columns=["topic"]).to_csv("new.csv", index=False)
    more = [c for c in commands("docs/cli.md") if kind(c) == "own-data"]
    assert sum("--by site" in c for c in more) == 2 and sum(c.startswith("fedgalore predict") for c in more) == 2
    for cmd in more:
        argv = shlex.split(cmd)[1:]
        rc = main(argv + (["--progress", "quiet"] if argv[0] == "predict" else []))
        out = capsys.readouterr()
        assert rc == 0, f"{cmd}\n{out.err[-2000:]}"
        if "--by" in argv and "--json" not in argv:
            assert "by site (3 groups):" in out.out and "worst site (by the task's primary metric): site" in out.out
    pred = pd.read_csv("predictions.csv")
    assert len(pred) == 60 and {"body", "site", "predicted_label", "prob_business"} <= set(pred.columns)
    assert len(Path("predictions.jsonl").read_text().splitlines()) == 60


def test_cli_md_option_examples(tmp_path) -> None:
    """docs/cli.md's method-options file and `compare:` section plan a valid grid."""
    from fedgalore.cli import _load_config, _read_method_options
    from fedgalore.compare import plan_grid

    yaml_blocks = blocks("docs/cli.md", "yaml")
    opts_file = tmp_path / "method-options.yaml"
    opts_file.write_text(yaml_blocks[1])
    opts = _read_method_options(str(opts_file))
    base, _ = _load_config(str(REPO / "conf/pipeline/offline_text.yaml"), [])
    cells = {c.label: c for c in plan_grid(base, list(opts), ["iid"], [0], tmp_path / "g", opts)}
    assert cells["fedit_lr5e-3"].cfg.train.lr == 5e-3 and cells["fedgalore_tau10"].cfg.method.options["update_proj_gap"] == 10
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text((REPO / "conf/pipeline/offline_text.yaml").read_text() + yaml_blocks[2].split("\n", 1)[1])
    cfg, section = _load_config(str(pipeline), [])
    assert section["methods"] == ["fedavg_full", "fedit", "fedgalore"] and section["seeds"] == [0, 1, 2]
    assert len(plan_grid(cfg, section["methods"], section["settings"], section["seeds"], tmp_path / "s",
                         section["method_options"])) == 18


def test_flower_deployment_commands_use_real_options() -> None:
    """The SuperLink/SuperNode commands of examples/flower/README.md: every option exists."""
    pytest.importorskip("flwr")
    for cmd in commands("examples/flower/README.md"):
        if not cmd.startswith("flower-super"):
            continue
        prog = cmd.split()[0]
        exe = shutil.which(prog) or str(Path(sys.executable).parent / prog)
        helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120).stdout
        for opt in re.findall(r"(--[a-z-]+)", cmd):
            assert opt in helptext, (prog, opt)


def _local_superlinks() -> list[str]:
    r = subprocess.run(["pgrep", "-f", "flower-superlink --insecure --simulation"], capture_output=True, text=True)
    return r.stdout.split()


def _ours(pids: list[str], flwr_home: Path) -> list[str]:
    """The processes among ``pids`` started with this test's ``FLWR_HOME`` (a Flower test on the
    other test worker runs SuperExecs of its own, which are not this test's to judge)."""
    mine = f"FLWR_HOME={flwr_home}".encode()
    out = []
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if mine in env:
            out.append(pid)
    return out


@pytest.mark.slow
@pytest.mark.assets
def test_flower_readme_simulation_as_written(tmp_path) -> None:
    """examples/flower/README.md end to end: `python -m fedgalore.flower . local ...` completes and
    exits 0 (tiny pipeline), the same command again exits 1 with the one-line reason, and the
    documented `kill $(pgrep ...)` leaves no local SuperLink behind."""
    pytest.importorskip("flwr")
    if shutil.which("pgrep") is None:
        pytest.skip("needs pgrep")
    if _local_superlinks():
        pytest.skip("a local Flower SuperLink is already running (not ours to stop)")
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", "FLWR_HOME": str(tmp_path / "flwr"),
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    cmd = next(c for c in commands("examples/flower/README.md") if kind(c) == "flower" and "fedgalore.flower" in c)
    argv = shlex.split(cmd)
    argv[0] = sys.executable
    overrides = f'overrides="task.name=tiny_text task.options=null federation.rounds=2 output.dir={tmp_path / "runs"}"'
    argv += ["--run-config", overrides]
    cwd = REPO / "examples" / "flower"
    try:
        first = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert "round 2/2 | clients" in first.stdout and "final (2/2 rounds, finished)" in first.stdout
        assert f"run dir: {tmp_path / 'runs'}" in first.stdout
        again = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
        assert again.returncode == 1
        assert "already holds this run (complete, 2/2 rounds" in again.stderr.strip().splitlines()[-1]
        assert _ours(_local_superlinks(), tmp_path / "flwr")  # it keeps running in the background, as the README says
    finally:
        for stop in (c for c in commands("examples/flower/README.md") if c.startswith("kill $(pgrep")):
            # typed into a shell, as a user does: under `sh -c` the shell's own command line holds the
            # pattern, pgrep lists the shell too, and where its pid is the lower one (pids wrap at
            # pid_max) `kill` ends the shell before it signals the SuperLink
            subprocess.run(["bash"], input=stop, text=True, env=env, timeout=60)
    import time

    home = tmp_path / "flwr"

    def execs() -> list[str]:  # (another test's SuperExecs may be running beside this one: _ours keeps this one's)
        return _ours(subprocess.run(["pgrep", "-f", "flower-superexec --insecure"], capture_output=True, text=True).stdout.split(),
                     home)

    for _ in range(40):  # the SuperExec exits after its SuperLink, not at the same instant (a loaded machine: seconds)
        if not _ours(_local_superlinks(), home) and not execs():
            break
        time.sleep(0.5)
    assert not _ours(_local_superlinks(), home)
    assert not execs()


@pytest.mark.slow
def test_flower_readme_python_example(tmp_path, monkeypatch, capsys) -> None:
    """examples/flower/README.md's `run_simulation` block, on the tiny task: it prints the rounds,
    the result and the run directory."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    code = blocks("examples/flower/README.md", "python")[0]
    tiny = ["federation.rounds=2", "task.name=tiny_text", "task.options=null"]
    assert '["federation.rounds=2"]' in code
    exec(compile(code.replace('["federation.rounds=2"]', repr(tiny)), "examples/flower/README.md", "exec"), {})  # noqa: S102
    out = capsys.readouterr().out
    assert "round 2/2 | clients" in out and "final (2/2 rounds, finished)" in out
    assert f"run dir: {(tmp_path / 'runs' / 'flower').resolve()}" in out


def test_fsdp_example_as_written() -> None:
    """docs/scale-out.md's FSDP2 example, as written (2 gloo processes): it trains and its exported
    record rebuilds the trained weights."""
    [cmd] = [c for doc in DOCS for c in commands(doc) if kind(c) == "fsdp"]
    argv = shlex.split(cmd)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([str(torchrun), *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    errs = [float(x) for x in re.findall(r"\|W0 \+ record - W_T\| = (\S+)", out.stdout)]
    assert len(errs) == 3 and max(errs) < 1e-5, out.stdout
    losses = [float(x) for x in re.findall(r"loss (\S+)", out.stdout)]
    assert losses[-1] < losses[0], out.stdout
