"""The ``fedgalore`` command: user errors, progress sinks, listing commands, and end to end on a
tiny pipeline (run -> report, compare with restart, resume)."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from fedgalore.cli import main
from fedgalore.progress import PlainProgress, QuietProgress, RichProgress, make_progress
from fedgalore_testing.cmdline import TINY, _error, cli, tiny_config


# ----------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "override, expect",
    [
        ("method.name=nope", "unknown method 'nope'"),
        ("task.name=nope", "unknown task 'nope'"),
        ("federation.bogus=1", "unknown config key federation.bogus"),
        ("federation.rounds=abc", "federation.rounds must be an integer"),
        ("federation.partition.alpha=0", "alpha"),
        ("federation.clients_per_round=9", "clients_per_round=9"),
        ("train.lr=-1", "train.lr"),
        ("method.rank=1000", "rank"),
        ("rounds5", "key=value"),
    ],
)
def test_run_user_errors_exit_2_with_one_line(tmp_path, capsys, override, expect) -> None:
    line = _error(capsys, ["run", "--config", str(tiny_config(tmp_path)), override, "--progress", "quiet"])
    assert expect in line


def test_missing_files_and_names(tmp_path, capsys) -> None:
    assert "not found" in _error(capsys, ["run", "--config", str(tmp_path / "missing.yaml")])
    assert "does not exist" in _error(capsys, ["report", str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    assert "no run directories" in _error(capsys, ["report", str(tmp_path / "empty")])
    assert "no such run directory" in _error(capsys, ["run", "--resume", str(tmp_path / "nope")])
    assert "needs --config" in _error(capsys, ["run"])
    assert "unknown experiment" in _error(capsys, ["repro", "nope"])
    assert "unknown benchmark" in _error(capsys, ["bench", "nope"])
    cfg = str(tiny_config(tmp_path))
    assert "unknown method 'zzz'" in _error(capsys, ["compare", "--config", cfg, "--methods", "fedavg_full,zzz"])
    assert "alpha" in _error(capsys, ["compare", "--config", cfg, "--methods", "fedavg_full", "--settings", "dirichlet:-1"])
    assert "unknown partition setting" in _error(capsys, ["compare", "--config", cfg, "--methods", "fedavg_full", "--settings", "skewed"])
    assert "--seeds" in _error(capsys, ["compare", "--config", cfg, "--methods", "fedavg_full", "--seeds", "a"])
    assert "--method-options" in _error(capsys, ["compare", "--config", cfg, "--methods", "fedavg_full", "--method-options", "x.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.format(rounds=1, out=tmp_path) + "compare: {colour: red}\n")
    assert "compare.colour" in _error(capsys, ["compare", "--config", str(bad)])


class _MissingData:
    def __init__(self, **_: object) -> None:
        raise FileNotFoundError(2, "No such file or directory; set task.options.data_dir", "/data/bbc.csv")


def test_missing_data_path_and_offline_package(tmp_path, capsys, monkeypatch) -> None:
    from fedgalore.tasks import TASKS

    mod = types.ModuleType("fg_cli_test_tasks")
    mod.MissingData = _MissingData
    monkeypatch.setitem(sys.modules, "fg_cli_test_tasks", mod)
    monkeypatch.setitem(TASKS, "missing_data", "fg_cli_test_tasks:MissingData")
    monkeypatch.setitem(TASKS, "offline_pkg", "fg_cli_package_that_is_not_installed.tasks:Task")
    cfg = str(tiny_config(tmp_path))
    assert "/data/bbc.csv" in _error(capsys, ["run", "--config", cfg, "task.name=missing_data", "--progress", "quiet"])
    assert "not installed" in _error(capsys, ["run", "--config", cfg, "task.name=offline_pkg", "--progress", "quiet"])


def test_debug_shows_traceback(tmp_path, capsys) -> None:
    rc = main(["--debug", "run", "--config", str(tiny_config(tmp_path)), "method.name=nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "fedgalore: error: unknown method" in err


def test_usage_errors_and_help(capsys) -> None:
    assert main(["run", "--progress", "bogus"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "compare" in capsys.readouterr().out


def test_tensorboard_message_when_not_installed(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    try:
        import torch.utils.tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed")
    except ImportError:
        pass
    from fedgalore_testing.reports import write_run

    run = write_run(tmp_path, "fedgalore", "iid", 0, 0.5)
    line = _error(capsys, ["report", str(run), "--no-plots", "--tensorboard", str(tmp_path / "tb")])
    assert "fedgalore[tensorboard]" in line


def test_listing_commands(capsys) -> None:
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "fedgalore" in out and "fedavg_full" in out
    listed = {line.split()[0] for line in out.splitlines() if line and not line[0].isspace()}
    assert {"fedex_lora", "fedsa_lora", "fed_sb", "flexlora", "hetlora"} <= listed, listed
    from fedgalore.methods.base import method_class

    ours = {m for m in listed if m != "options" and method_class(m).__module__.startswith("fedgalore.")}  # not other tests' plugins
    ranked = {line.split()[0] for line in out.splitlines() if line.endswith("[site ranks]")} & ours
    assert ranked and ranked == {m for m in ours if method_class(m).traits.site_ranks}  # listed as declared
    assert main(["tasks"]) == 0
    assert "tiny_text" in capsys.readouterr().out
    assert main(["repro", "--list"]) == 0
    assert main(["bench", "--list"]) == 0


def test_bench_dispatch_runs_script_with_args(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "echo_args.py").write_text("import sys\nprint('ARGS', sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--list"]) == 0
    assert "echo_args" in capsys.readouterr().out
    r = cli("bench", "echo_args", "--n", "5", cwd=tmp_path)
    assert r.returncode == 3 and "ARGS ['--n', '5']" in r.stdout


def test_bench_all_skips_staged_studies(tmp_path) -> None:
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "quick.py").write_text("print('QUICK RAN')\n")
    (bench / "study.py").write_text("# fedgalore-bench: not-in-all\nimport sys\nsys.exit('needs a stage')\n")
    r = cli("bench", "all", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "QUICK RAN" in r.stdout and "skipped: study" in r.stdout
    r = cli("bench", "study", cwd=tmp_path)  # by name it runs (and fails as written)
    assert r.returncode == 1 and "needs a stage" in r.stderr


def test_repro_dispatch(monkeypatch, capsys) -> None:
    calls = []
    mod = types.ModuleType("fedgalore.experiments.fake_study")
    mod.main = lambda args: calls.append(args) or 0
    monkeypatch.setitem(sys.modules, "fedgalore.experiments.fake_study", mod)
    monkeypatch.setattr("fedgalore.cli._experiments", lambda: ["fake_study"])
    assert main(["repro", "fake_study", "--steps", "3"]) == 0
    assert calls == [["--steps", "3"]]


# ----------------------------------------------------------------------------- progress
EVENTS_REC = {"round": 1, "clients": [0, 2], "train_loss": 0.5, "eval/accuracy": 0.75, "eval/loss": 0.6,
              "bytes_up": 2048, "bytes_down": 4096, "cum_bytes_up": 2048, "cum_bytes_down": 4096, "time_round": 1.5}


def _drive(sink) -> None:
    sink.start(2, {"run_name": "demo", "method": "fedgalore", "task": "tiny_text", "start_round": 0})
    sink.round_start(0, [0, 2])
    for c in (0, 2):
        sink.client_start(0, c, 3)
        for t in range(3):
            sink.client_step(0, c, t, 3, 1.0 - 0.1 * t)
        sink.client_end(0, c, {"time": 0.1})
    sink.round_end(0, EVENTS_REC)
    sink.message("client 1 dropped")
    sink.finish({"name": "demo", "final": {"accuracy": 0.75}, "wall_time": 3.0})
    sink.close()


def test_plain_progress_one_line_per_round() -> None:
    buf = io.StringIO()
    _drive(PlainProgress(buf))
    lines = buf.getvalue().splitlines()
    rnd = [line for line in lines if line.startswith("round ")]
    assert len(rnd) == 1
    assert "round 1/2" in rnd[0] and "clients 0,2" in rnd[0] and "accuracy=0.7500" in rnd[0]
    assert "up 2.00 KiB down 4.00 KiB (round, 2 clients)" in rnd[0]  # the round's total over its clients, said so
    assert "eta" in rnd[0] and any("client 1 dropped" in line for line in lines) and "done demo" in lines[-1]


def test_rich_progress_renders() -> None:
    from rich.console import Console

    buf = io.StringIO()
    sink = RichProgress(Console(file=buf, force_terminal=True, width=160))
    _drive(sink)
    out = buf.getvalue()
    assert "round 1/2" in out and "accuracy=0.7500" in out and "client 1 dropped" in out and "done" in out


def test_make_progress_modes(monkeypatch) -> None:
    assert isinstance(make_progress("plain"), PlainProgress)
    assert isinstance(make_progress("quiet"), QuietProgress)
    assert isinstance(make_progress("rich"), RichProgress)
    assert isinstance(make_progress("auto", io.StringIO()), PlainProgress)  # not a TTY
    with pytest.raises(ValueError):
        make_progress("loud")


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_run_then_report_then_resume(tmp_path, capsys) -> None:
    cfg = tiny_config(tmp_path)
    r = cli("run", "--config", str(cfg), "method.name=fedavg_full", "--progress", "plain")
    assert r.returncode == 0, r.stderr
    assert "round 2/2" in r.stdout and "final (2/2 rounds, finished): accuracy=" in r.stdout
    run_dir = tmp_path / "runs" / "tiny-fedavg_full-dirichlet0.5-s0"
    assert f"run dir: {run_dir}" in r.stdout
    summary = json.loads((run_dir / "summary.json").read_text())

    # report and resume in-process (main() is the CLI; saves two interpreter start-ups)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    said = capsys.readouterr().out
    assert "4 plots" in said and "diagnostics (one figure each, with what good looks like)" in said
    md = (tmp_path / "rep" / "table.md").read_text()
    assert f"| FedAvg-Full | {100 * summary['final']['accuracy']:.1f} |" in md
    assert (tmp_path / "rep" / "table.tex").read_text().count(r"\\") >= 3
    for name in ("curves", "partition", "diagnostics/drift_mean", "comm_vs_metric"):
        assert (tmp_path / "rep" / "plots" / f"{name}.png").stat().st_size > 1000

    # interrupt after round 1 (drop the last checkpoint, mark running), then resume via the CLI
    shutil.rmtree(run_dir / "checkpoints" / "round_0002")
    summary["status"] = "running"
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert main(["run", "--resume", str(run_dir), "--progress", "plain"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "round 2/2" in out and "round 1/2" not in out
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["status"] == "finished" and again["final"] == summary["final"]  # deterministic resume
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_compare_grid_skips_finished_cells(tmp_path, capsys) -> None:
    cfg = tiny_config(tmp_path, rounds=1)
    out = tmp_path / "cmp"
    opts = tmp_path / "opts.yaml"
    opts.write_text("fedavg_full: {}\n")
    argv = ["compare", "--config", str(cfg), "--methods", "fedgalore,fedavg_full", "--settings", "iid,dirichlet:0.5",
            "--out", str(out), "--method-options", str(opts), "--progress", "plain"]
    assert main(argv) == 0, capsys.readouterr().err
    first = capsys.readouterr().out
    assert first.count(": running ->") == 4
    cells = sorted((out / "runs").iterdir())
    assert len(cells) == 4 and len(list((out / "configs").glob("*.yaml"))) == 4
    grid = json.loads((out / "grid.json").read_text())
    assert {c["label"] for c in grid["cells"]} == {"fedgalore", "fedavg_full"}
    stamps = {c.name: (c / "summary.json").stat().st_mtime_ns for c in cells}
    md = (out / "table.md").read_text()
    assert "| FedAvg-Full |" in md and "| FedGaLore |" in md and "tiny_text Δ" in md
    assert (out / "table.tex").is_file() and (out / "plots" / "iid_vs_noniid.png").stat().st_size > 1000

    # restart: nothing runs (the report was checked above; skip rebuilding it)
    argv += ["--no-report"]
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert second.count("complete, skipped") == 4 and "running ->" not in second and "round 1/1" not in second
    assert {c.name: (c / "summary.json").stat().st_mtime_ns for c in cells} == stamps

    # an unfinished cell is resumed, not restarted
    victim = out / "runs" / "fedavg_full-iid-s0"
    s = json.loads((victim / "summary.json").read_text())
    s["status"] = "running"
    (victim / "summary.json").write_text(json.dumps(s))
    assert main(argv) == 0
    third = capsys.readouterr().out
    assert third.count("complete, skipped") == 3 and third.count(": resuming ->") == 1
    assert json.loads((victim / "summary.json").read_text())["status"] == "finished"

    # the same out dir with a different budget is refused
    assert main(argv + ["train.lr=0.5"]) == 2
    assert "different config" in capsys.readouterr().err


# ----------------------------------------------------------------------------- grid planning
def test_plan_grid_budgets_options_and_aliases(tmp_path) -> None:
    from fedgalore.compare import plan_grid
    from fedgalore.job.config import ConfigError, load_config
    from fedgalore.methods.base import MethodError

    base = load_config(tiny_config(tmp_path), ["method.options.update_proj_gap=7", "federation.partition.min_size=3"])
    opts = {"fedavg_full": {}, "galore_tau2": {"method": "fedgalore", "update_proj_gap": 2}}
    cells = plan_grid(base, ["fedavg_full", "fedgalore", "galore_tau2"], ["iid", "dirichlet:0.1"], [0, 1], tmp_path / "g", opts)
    assert len(cells) == 12
    by = {(c.label, c.setting, c.seed): c for c in cells}
    full, gal, tau2 = by[("fedavg_full", "iid", 0)], by[("fedgalore", "dirichlet:0.1", 1)], by[("galore_tau2", "iid", 0)]
    assert full.cfg.method.name == "fedavg_full" and full.cfg.method.options == {}  # fedgalore options not applied
    assert gal.cfg.method.options == {"update_proj_gap": 7} and gal.cfg.seed == 1
    assert gal.cfg.federation.partition.kind == "dirichlet" and gal.cfg.federation.partition.alpha == 0.1
    assert gal.cfg.federation.partition.min_size == 3  # other partition fields kept
    assert tau2.cfg.method.name == "fedgalore" and tau2.cfg.method.options == {"update_proj_gap": 2}
    assert full.cfg.federation.partition.kind == "iid" and full.name == "fedavg_full-iid-s0"
    assert full.cfg.output.dir == str(tmp_path / "g" / "runs") and full.cfg.output.run_name == full.name
    # identical budgets: only method, partition, seed and output differ from the base
    for c in cells:
        d, b = c.cfg.to_dict(), base.to_dict()
        for key in ("method", "seed", "output"):
            d.pop(key), b.pop(key)
        d["federation"].pop("partition"), b["federation"].pop("partition")
        assert d == b
    with pytest.raises(MethodError, match="unknown method 'nope'"):
        plan_grid(base, ["nope"], ["iid"], None, tmp_path, {})
    # options for a registered method outside the grid are fine (one options file serves any subset) ...
    assert len(plan_grid(base, ["fedgalore"], ["iid"], None, tmp_path, {"fedit": {"lora_alpha": 4}})) == 1
    # ... a name that can never be a row (no such method, no `method` key) is a typo
    with pytest.raises(ConfigError, match="'fedti', which is neither a registered method"):
        plan_grid(base, ["fedgalore"], ["iid"], None, tmp_path, {"fedti": {}})
    with pytest.raises(MethodError, match="bogus"):
        plan_grid(base, ["fedit"], ["iid"], None, tmp_path, {"fedit": {"bogus": 1}})
    with pytest.raises(ConfigError, match="duplicates"):
        plan_grid(base, ["fedgalore", "fedgalore"], ["iid"], None, tmp_path, {})


def test_compare_section_in_config(tmp_path) -> None:
    from fedgalore.cli import _load_config

    path = tmp_path / "c.yaml"
    path.write_text(TINY.format(rounds=1, out=tmp_path) + "compare: {methods: [fedgalore], seeds: [0, 1],"
                    " method_options: {fedgalore: {update_proj_gap: 3}}}\n")
    cfg, section = _load_config(str(path), ["federation.rounds=2", "compare.seeds=[4]"])
    assert cfg.federation.rounds == 2 and section["methods"] == ["fedgalore"] and section["seeds"] == [4]
    assert section["method_options"] == {"fedgalore": {"update_proj_gap": 3}}


def test_config_difference_ignores_schema_changes_and_the_display() -> None:
    from fedgalore.job.config import config_difference

    old = {"train": {"lr": 1e-3}, "federation": {"rounds": 2}, "output": {"progress": "rich"}}
    assert config_difference(old, {"train": {"lr": 1e-3}, "federation": {"rounds": 2, "new_key": 5}}) is None
    assert config_difference(old, {"train": {"lr": 1e-3}, "federation": {"rounds": 2}, "output": {"progress": "quiet"}}) is None
    # the checkpoint cadence does not change a run's result: resuming with another one is the same run
    assert config_difference(old, {"train": {"lr": 1e-3}, "federation": {"rounds": 2},
                                   "output": {"checkpoint_every": "auto", "checkpoint_budget": 0.1, "keep_checkpoints": 1}}) is None
    assert config_difference(old, {"train": {"lr": 5e-4}, "federation": {"rounds": 2}}) == "train.lr: 0.001 -> 0.0005"


def test_plan_grid_per_row_train_overrides(tmp_path) -> None:
    """A row's ``train`` mapping changes only that row's train section (e.g. a per-method lr)."""
    from fedgalore.compare import plan_grid
    from fedgalore.job.config import ConfigError, load_config

    base = load_config(tiny_config(tmp_path))
    opts = {"fedit": {"train": {"lr": 5e-3}}, "galore_hi": {"method": "fedgalore", "scale": 1.0, "train": {"lr": 2e-3, "warmup_ratio": 0.1}}}
    cells = {c.label: c for c in plan_grid(base, ["fedavg_full", "fedit", "galore_hi"], ["iid"], [0], tmp_path / "g", opts)}
    assert cells["fedavg_full"].cfg.train.lr == base.train.lr == 1e-3
    assert cells["fedit"].cfg.train.lr == 5e-3 and cells["fedit"].cfg.method.options == {}
    hi = cells["galore_hi"].cfg
    assert hi.train.lr == 2e-3 and hi.train.warmup_ratio == 0.1 and hi.method.options == {"scale": 1.0}
    assert hi.train.local_steps == base.train.local_steps and hi.train.batch_size == base.train.batch_size  # budget kept
    with pytest.raises(ConfigError, match="unknown train key 'lrr'"):
        plan_grid(base, ["fedit"], ["iid"], [0], tmp_path / "g", {"fedit": {"train": {"lrr": 1.0}}})
    with pytest.raises(ConfigError, match="train must be a mapping"):
        plan_grid(base, ["fedit"], ["iid"], [0], tmp_path / "g", {"fedit": {"train": 0.1}})


@pytest.mark.slow
def test_compare_shards_split_cells_and_last_writes_report(tmp_path, capsys) -> None:
    cfg = tiny_config(tmp_path, rounds=1)
    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(cfg), "--methods", "fedavg_full,fedgalore", "--settings", "iid",
            "--seeds", "0,1", "--out", str(out), "--progress", "quiet"]
    assert main(argv + ["--shard", "1/2"]) == 0, capsys.readouterr().err
    done = sorted(p.name for p in (out / "runs").iterdir() if not p.name.startswith("."))
    assert done == ["fedavg_full-iid-s1", "fedgalore-iid-s1"]  # cells 2 and 4 of 4 (grid order)
    assert not (out / "table.md").exists()  # other shard still pending
    assert main(argv + ["--shard", "0/2"]) == 0
    assert len([p for p in (out / "runs").iterdir() if not p.name.startswith(".")]) == 4 and (out / "table.md").is_file()
    assert not any((out / ".claims").iterdir())  # claims released
    assert "--shard" in _error(capsys, argv + ["--shard", "2/2"])
    assert "--shard" in _error(capsys, argv + ["--shard", "x"])


@pytest.mark.slow
def test_compare_workers_skip_cells_claimed_by_a_live_process(tmp_path, capsys) -> None:
    """Two workers on one grid never run a cell twice: a live claim is skipped (and the report
    waits for it), a claim left by a dead process is taken over."""
    cfg = tiny_config(tmp_path, rounds=1)
    out = tmp_path / "cmp"
    claims = out / ".claims"
    claims.mkdir(parents=True)
    (claims / "fedavg_full-iid-s0").write_text(str(os.getppid()))  # a live process holds it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (claims / "fedgalore-iid-s0").write_text(str(dead.pid))  # its holder has exited
    argv = ["compare", "--config", str(cfg), "--methods", "fedavg_full,fedgalore", "--settings", "iid",
            "--out", str(out), "--progress", "plain"]
    assert main(argv) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "fedavg_full iid seed=0: claimed by another worker, skipped" in text
    assert not (out / "runs" / "fedavg_full-iid-s0").exists() and (out / "runs" / "fedgalore-iid-s0" / "summary.json").is_file()
    assert not (out / "table.md").exists() and "report not written yet" in text
    assert (claims / "fedavg_full-iid-s0").is_file() and not (claims / "fedgalore-iid-s0").exists()
