"""Clean failures and portable adapter bases ("a practitioner's second day"):

* a run whose task, data or model fails to build leaves no new folder behind (a resumed run's
  folder is never removed);
* an empty data file is one line naming the file and what to put in it;
* a round that fails (too few valid uploads after its retries) ends ``fedgalore run`` /
  ``compare`` with one line and exit status 3, the checkpoint kept and the resume command named;
* the model card of a run whose process was killed says what ``fedgalore status`` says;
* an exported adapter names a local copy of a hub model by its hub id, the copy as the offline fallback.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import fedgalore
from fedgalore.cli import main
from fedgalore.job.config import load_config
from fedgalore.trained.export import export_run
from fedgalore.records.liveness import LOCK_FILE, run_state
from fedgalore.engine.loop import Federation, RoundFailed
from fedgalore.jsonl import read_json
from fedgalore.methods.base import option, register
from fedgalore.methods.fedavg_full import FedAvgFull, FedAvgFullOptions
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.tasks.base import TaskError

from fedgalore_testing.runs import tiny_cfg
from fedgalore_testing.models import Run, logits_of
from fedgalore_testing.assets import TOPICS, news_rows, write


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def _err_lines(capsys) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def _news_yaml(folder: Path, model: Path, data: str = "news.csv", text_column: str = "body", rounds: int = 1) -> Path:
    (folder / "news.yaml").write_text(f"""name: news
task:
  name: text_classification
  options: {{model: {model}, data: {data}, text_column: {text_column}, label_column: topic, max_length: 16}}
method: {{name: fedit, rank: 2}}
federation: {{clients_per_round: null, rounds: {rounds}, partition: {{kind: natural, column: site}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_steps: 1}}
output: {{dir: runs, progress: quiet}}
""")
    return folder / "news.yaml"


# ============================================================================ 1. no folder until the task builds
@pytest.mark.parametrize("case", ["wrong column", "empty file", "format mismatch"])
def test_a_run_whose_data_fails_leaves_no_folder(case, tmp_path, monkeypatch, capsys, bert_dir):
    monkeypatch.chdir(tmp_path)
    write(news_rows(24), tmp_path / "news.csv")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "news.parquet").write_text((tmp_path / "news.csv").read_text())  # CSV text under a .parquet name
    data, column = {"wrong column": ("news.csv", "text"), "empty file": ("empty.csv", "body"),
                    "format mismatch": ("news.parquet", "body")}[case]
    cfg = _news_yaml(tmp_path, bert_dir, data, column)
    assert main(["run", "--config", str(cfg)]) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("fedgalore: error: "), lines
    if case == "empty file":
        assert lines[0] == ("fedgalore: error: empty.csv is empty; put a header line naming the columns, then one "
                            "comma-separated row per example in it")
    else:
        assert {"wrong column": "news.csv has no column 'text'", "format mismatch": "could not read news.parquet"}[case] in lines[0]
    assert not (tmp_path / "runs").exists()  # neither the run directory nor output.dir


def test_only_the_folders_a_failed_start_created_go(tmp_path, monkeypatch):
    """The run directory and the parents this call made go; a folder that was there stays, and a
    resumed run's folder keeps every file (the build failing is faked: Runtime raises)."""
    import fedgalore.engine.loop as loop

    done = fedgalore.run(tiny_cfg(tmp_path / "out", rounds=1))
    before = sorted(p.relative_to(done.run_dir) for p in done.run_dir.rglob("*"))

    def broken(*a, **k):
        raise TaskError("the data did not build")

    monkeypatch.setattr(loop, "Runtime", broken)
    with pytest.raises(TaskError):  # fresh, into new nested folders: all of them removed
        Federation(tiny_cfg(tmp_path / "new" / "deeper", rounds=1))
    assert not (tmp_path / "new").exists()
    with pytest.raises(TaskError):  # the default name is taken by another run: its "-2" sibling goes, the output folder stays
        Federation(tiny_cfg(tmp_path / "out", rounds=2))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [done.run_dir.name]
    (tmp_path / "mine").mkdir()
    with pytest.raises(TaskError):  # a folder that existed is not this run's to remove
        Federation(tiny_cfg(tmp_path, rounds=1), run_dir=tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()
    with pytest.raises(TaskError):  # resuming: nothing removed, nothing left locked
        Federation(load_config(done.run_dir / "config.yaml"), run_dir=done.run_dir, resume=True)
    assert sorted(p.relative_to(done.run_dir) for p in done.run_dir.rglob("*")) == before
    assert not (done.run_dir / LOCK_FILE).exists()


# ============================================================================ 2. an empty data file
@pytest.mark.parametrize("name, says", [("a.csv", "a header line naming the columns"),
                                        ("a.tsv", "tab-separated row per example"),
                                        ("a.jsonl", "one JSON record per line"),
                                        ("a.json", "an array of records"),
                                        ("a.parquet", "a table with one row per example")])
def test_an_empty_data_file_is_one_line(name, says, tmp_path, monkeypatch):
    from fedgalore.tasks.generic.data import load_sources

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("\n\n" if name.endswith((".csv", ".jsonl")) else "")  # blank lines count as empty
    with pytest.raises(TaskError) as err:
        load_sources(name)
    assert str(err.value).startswith(f"{name} is empty; put ") and says in str(err.value)
    assert "delimiter" not in str(err.value) and "\n" not in str(err.value)


# ============================================================================ 3. a failing round ends the command cleanly
@dataclass(frozen=True)
class FailFromOptions(FedAvgFullOptions):
    bad_from: int = option(1, "from this 0-based round on, every client uploads NaN")


@register
class FailFrom(FedAvgFull):
    """FedAvg-Full whose clients all send NaN from round ``bad_from`` on (every upload rejected)."""

    name = "test_clean_fail_from"
    options_class = FailFromOptions

    def client_update(self, model, broadcast, ctx):
        up = super().client_update(model, broadcast, ctx)
        if ctx.round >= self.options.bad_from:
            first = next(iter(up.entries))
            up = Payload({**up.entries, first: Dense(up[first].tensor * float("nan"))}, up.meta)
        return up


def _failing_yaml(tmp_path: Path) -> Path:
    cfg = tiny_cfg(tmp_path / "runs", "test_clean_fail_from", rounds=3)
    cfg.federation.max_round_retries = 1
    path = tmp_path / "fail.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    return path


def test_a_failed_round_is_one_line_and_exit_3(tmp_path, capsys):
    assert main(["run", "--config", str(_failing_yaml(tmp_path))]) == 3
    run_dir = next((tmp_path / "runs").iterdir())
    lines = _err_lines(capsys)
    last = lines[-1]
    assert not any("Traceback" in x for x in lines)
    assert last.startswith("fedgalore: round 2 failed 2 time(s): fewer than 1 valid uploads (first error: ")
    assert last.endswith(f"; the run stopped: its checkpoint of round 1 is kept in {run_dir}; fix the cause, then continue "
                         f"with: fedgalore run --resume {run_dir}")
    assert [x for x in lines if x.startswith("fedgalore:")] == [last]
    s = read_json(run_dir / "summary.json")
    assert (s["status"], s["rounds_completed"], s["checkpointed_round"]) == ("failed", 1, 1)
    assert s["error"].startswith("RoundFailed: round 2 failed 2 time(s)")
    assert main(["status", str(run_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{run_dir}: failed after 1/3 rounds ({s['error']}); checkpoint: round 1; fix the cause, then: "
        f"fedgalore run --resume {run_dir}")
    assert not (run_dir / LOCK_FILE).exists()
    with pytest.raises(RoundFailed, match="round 2 failed") as err:  # the API raises it (a RuntimeError)
        fedgalore.run(load_config(run_dir / "config.yaml"), resume=run_dir)
    assert isinstance(err.value, RuntimeError) and err.value.round == 2 and err.value.run_dir == run_dir


def test_a_failed_round_in_compare_is_one_line(tmp_path, capsys):
    argv = ["compare", "--config", str(_failing_yaml(tmp_path)), "--methods", "test_clean_fail_from", "--settings", "iid",
            "--seeds", "0", "--out", str(tmp_path / "cmp"), "--progress", "quiet"]
    assert main(argv) == 3
    lines = _err_lines(capsys)
    cell = tmp_path / "cmp" / "runs" / next(p.name for p in (tmp_path / "cmp" / "runs").iterdir())
    assert [x for x in lines if x.startswith("fedgalore:")] == [lines[-1]] and not any("Traceback" in x for x in lines)
    assert lines[-1].startswith("fedgalore: round 2 failed 2 time(s)") and f"(cell {cell})" in lines[-1]
    assert lines[-1].endswith("run the same fedgalore compare command again (finished cells are skipped, that cell resumes "
                              "from its last checkpoint)")
    assert read_json(cell / "summary.json")["status"] == "failed"


# ============================================================================ 4. the model card of a dead run
def test_the_model_card_of_a_killed_run_says_it_is_dead(tmp_path, capsys):
    res = fedgalore.run(tiny_cfg(tmp_path, "fedit", rounds=2))
    s = read_json(res.run_dir / "summary.json")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs: what kill -9 leaves behind
    (res.run_dir / "summary.json").write_text(json.dumps({**s, "status": "running", "rounds_completed": 1, "pid": gone.pid}))
    assert main(["status", str(res.run_dir)]) == 0
    assert f"{res.run_dir}: looks dead" in capsys.readouterr().out
    export_run(res.run_dir, tmp_path / "exp")
    card = (tmp_path / "exp" / "README.md").read_text()
    assert f"`{res.run_dir}` (looks dead: its process was killed or crashed, 1/2 rounds)" in card
    assert "(running," not in card and "still running" not in card
    assert (f"| rounds | 2 exported; 1 completed of 2 configured (the run stopped without finishing: `fedgalore status "
            f"{res.run_dir}` says looks dead; `fedgalore run --resume {res.run_dir}` continues it) |") in card


# ============================================================================ 5. portable adapter bases
def _copy_of(bert_dir: Path, dest: Path, name_or_path: str | None) -> Path:
    shutil.copytree(bert_dir, dest)
    if name_or_path is not None:
        conf = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**conf, "_name_or_path": name_or_path}))
    return dest


def test_folder_hub_id_knows_local_copies_of_hub_models(tmp_path, bert_dir):
    from fedgalore.hub import folder_hub_id
    from fedgalore.tasks import assets

    assert folder_hub_id(bert_dir) is None  # a folder of one's own
    assert folder_hub_id("someorg/some-model") is None  # a hub id, no folder
    named = _copy_of(bert_dir, tmp_path / "named", "someorg/tiny-bert")
    assert folder_hub_id(named)[0] == "someorg/tiny-bert" and "_name_or_path" in folder_hub_id(named)[1]
    assert folder_hub_id(_copy_of(bert_dir, tmp_path / "rel", "./models/bert")) is None  # a path, not a hub id
    assert folder_hub_id(_copy_of(bert_dir, tmp_path / "abs", str(bert_dir))) is None
    snap = _copy_of(bert_dir, tmp_path / "hub" / "models--someorg--cached-bert" / "snapshots" / "0123456789abcdef", None)
    assert folder_hub_id(snap) == ("someorg/cached-bert", "a snapshot of the Hugging Face cache (revision 0123456789ab)")
    try:
        minilm = assets.minilm_path()
    except assets.AssetError:
        return
    # the packaged MiniLM: its hub id, not the model it was trained from that its config.json names
    assert folder_hub_id(minilm)[0] == "sentence-transformers/all-MiniLM-L6-v2"


def test_an_adapter_of_a_local_copy_names_the_hub_id(tmp_path, monkeypatch, bert_dir):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    monkeypatch.chdir(tmp_path)
    local = _copy_of(bert_dir, tmp_path / "models" / "tiny-bert", "someorg/tiny-bert")
    write(news_rows(60), tmp_path / "news.csv")
    run = Run(load_config(_news_yaml(tmp_path, local.resolve())))
    res = export_run(run.dir, tmp_path / "ad", format="peft")
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "someorg/tiny-bert" == res.base_model  # not the absolute path
    card = (tmp_path / "ad" / "README.md").read_text()
    cell = next(x for x in card.splitlines() if x.startswith("| base model |"))
    assert cell.startswith(f"| base model | someorg/tiny-bert (this run read {local.resolve()}; its config.json names it")
    labels = dict(enumerate(run.task.label_names()))  # the run's label names, as the hf export's config.json has them
    kw = f"id2label={labels!r}, label2id={ {v: k for k, v in labels.items()}!r}, ignore_mismatched_sizes=True)"
    assert ('# or, with transformers only: base = BertForSequenceClassification.from_pretrained("someorg/tiny-bert", '
            + kw) in card
    offline = (f'# offline, from the local copy this run read: base = BertForSequenceClassification.from_pretrained('
               f'"{local.resolve()}", ' + kw)
    assert offline in card
    assert res.shipped_base is None and not (tmp_path / "ad" / "base").exists()  # a hub id names the base: not shipped
    # the offline line, as the card writes it, loads the adapter to the run's logits and labels
    base = AutoModelForSequenceClassification.from_pretrained(local.resolve(), id2label=labels,
                                                              label2id={v: k for k, v in labels.items()},
                                                              ignore_mismatched_sizes=True)
    model = PeftModel.from_pretrained(base, tmp_path / "ad")
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    assert model.config.id2label == labels and set(labels.values()) == set(TOPICS)
