"""A run's identity (fedgalore.records.identity): a changed option, model or data file is never
mistaken for a finished run — on `run`, `--resume` and `compare` — while an option written with
its default value is the same run; run directories from before identities still resume and skip;
a task object passed in code is recorded as what it is."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fedgalore
from fedgalore.cli import main
from fedgalore.job.config import ConfigError, load_config
from fedgalore.records.identity import IDENTITY_FILE, compare_with_saved, run_identity
from fedgalore.tasks import fingerprint
from fedgalore.tasks.fingerprint import data_fingerprint, fingerprint_path
from fedgalore.tasks.synthetic import TinyTextTask


TINY = """\
name: idt
seed: 0
task: {name: tiny_text, options: {n_train: 48, n_test: 16, hidden_size: 16, num_layers: 1, seq_len: 8}}
method: {name: fedgalore, rank: 4}
federation: {num_clients: 3, clients_per_round: 2, rounds: 1, partition: {kind: iid}}
train: {lr: 1.0e-3, batch_size: 16, local_steps: 2}
output: {dir: OUT, progress: quiet}
"""
TINY_TASK = dict(n_train=48, n_test=16, hidden_size=16, num_layers=1, seq_len=8)


def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(TINY.replace("OUT", str(tmp_path / "runs")))
    return path


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([*argv, "--progress", "plain"] if argv[0] in ("run", "compare") else list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def texts(diffs) -> list[str]:
    return [str(d) for d in diffs]


# ----------------------------------------------------------------------------- fingerprints
def test_fingerprints_hash_contents_cheaply_and_name_what_changed(tmp_path, monkeypatch) -> None:
    f = tmp_path / "config.json"
    f.write_text('{"hidden_size": 16}')
    first = fingerprint_path(f)
    assert first["hash"] == "full" and first["size"] == 19
    os.utime(f, (1, 1))  # a new modification time (a copy) is the same file
    assert fingerprint_path(f) == first
    f.write_text('{"hidden_size": 17}')  # same size, other bytes
    assert fingerprint_path(f)["sha256"] != first["sha256"]

    # a big file is sampled: its head (a weights header) and blocks spread over it
    monkeypatch.setattr(fingerprint, "FULL_HASH_MAX", 1000)
    monkeypatch.setattr(fingerprint, "HEAD_BYTES", 100)
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 50)
    monkeypatch.setattr(fingerprint, "SAMPLE_BLOCKS", 4)  # blocks at 0, 3316, 6633, 9950 of 10,000 bytes
    big = tmp_path / "model.safetensors"
    data = bytearray(torch.randint(256, (10_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy())
    big.write_bytes(bytes(data))
    sampled = fingerprint_path(big)
    assert sampled["hash"] == "sampled"
    data[6640] ^= 1  # inside a sampled block: seen
    big.write_bytes(bytes(data))
    assert fingerprint_path(big)["sha256"] != sampled["sha256"]
    data[6640] ^= 1
    data[5000] ^= 1  # between blocks: not seen (the documented cost of never reading GBs)
    big.write_bytes(bytes(data))
    assert fingerprint_path(big)["sha256"] == sampled["sha256"]

    # a folder: names, sizes, hashes; hidden entries and __pycache__ do not count
    before = fingerprint_path(tmp_path)
    assert before["kind"] == "folder" and set(before["listing"]) == {"config.json", "model.safetensors"}
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x").write_text("y")
    assert fingerprint_path(tmp_path) == before
    assert fingerprint_path(tmp_path / "nothing") is None
    # in-memory data: a changed element changes the fingerprint
    x = torch.arange(12).reshape(3, 4)
    assert data_fingerprint({"a": x, "b": ["s", 1.5]}) == data_fingerprint({"b": ["s", 1.5], "a": x.clone()})
    y = x.clone()
    y[2, 3] = 0
    assert data_fingerprint({"a": y, "b": ["s", 1.5]}) != data_fingerprint({"a": x, "b": ["s", 1.5]})


# ----------------------------------------------------------------------------- resolved configs
def test_absent_equals_default_and_anything_else_differs(tmp_path) -> None:
    path = tiny_config(tmp_path)

    def diff(old: list[str], new: list[str]) -> list[str]:
        return texts(run_identity(load_config(path, old)).differences(run_identity(load_config(path, new))))

    same = ["method.options.moment_protocol=aligned", "task.options.seed=0", "task.options.vocab_size=64",
            "output.progress=rich", "output.checkpoint_every=auto", f"output.dir={tmp_path / 'elsewhere'}"]
    assert diff([], same) == []  # defaults written out; display, cadence and place do not count
    assert diff([], ["task.options.seed=9"]) == ["task.options.seed: 0 -> 9"]
    assert "method.options.moment_protocol: 'aligned' -> 'paper'" in diff([], ["method.options.moment_protocol=paper"])
    # the LoRA baselines' lora_alpha defaults to 2·rank: absent and 8 are the same run (rank 4), 16 is not
    fedit = ["method.name=fedit"]
    assert diff(fedit, [*fedit, "method.options.lora_alpha=8"]) == []
    assert diff(fedit, [*fedit, "method.options.lora_alpha=16"]) == ["method.options.lora_alpha: 8.0 -> 16.0"]
    assert diff([], ["train.lr=0.5"]) == ["train.lr: 0.001 -> 0.5"]


# ----------------------------------------------------------------------------- run and --resume
@pytest.mark.slow
def test_run_and_resume_compare_identities(tmp_path, capsys) -> None:
    path = str(tiny_config(tmp_path))
    base = tmp_path / "runs" / "idt-fedgalore-iid-s0"
    assert cli(capsys, "run", "--config", path)[0] == 0
    ident = json.loads((base / IDENTITY_FILE).read_text())
    assert ident["schema"] == 1 and ident["config"]["method"]["options"]["moment_protocol"] == "aligned"
    assert ident["config"]["task"]["options"]["vocab_size"] == 64 and ident["inputs"] == {}  # tiny_text reads no file

    # the same run, its defaults written out: refused, "already holds this run"
    rc, _, err = cli(capsys, "run", "--config", path, "method.options.moment_protocol=aligned", "task.options.seed=0")
    assert rc == 2 and f"{base} already holds this run (complete, 1/1 rounds: accuracy=" in err
    # an option the saved config did not name: another run, in its own directory, said once
    rc, out, _ = cli(capsys, "run", "--config", path, "task.options.seed=9")
    assert rc == 0
    said = [x for x in out.splitlines() if "holds a run" in x]
    assert said == [f"{base} holds a run with another config (task.options.seed: 0 -> 9); this run goes to {base}-2"]
    # --resume (Python API) with a changed option is refused naming it
    with pytest.raises(ConfigError, match=r"cannot resume .* with another config or inputs \(method\.options\.moment_protocol: "
                                          r"'aligned' -> 'paper'"):
        fedgalore.run(load_config(path, ["method.options.moment_protocol=paper"]), resume=base)

    # a run directory from before identities: judged by its config.yaml with defaults filled in —
    # of a method whose rule did not change since (FedIT; FedGaLore's and FedGaLore⁻'s did: issues 33 and 40, below)
    fedit = ["method.name=fedit"]
    assert cli(capsys, "run", "--config", path, *fedit)[0] == 0
    old = base.with_name(base.name.replace("fedgalore", "fedit"))
    (old / IDENTITY_FILE).unlink()
    rc, _, err = cli(capsys, "run", "--config", path, *fedit, "method.options.lora_alpha=8")  # the default (2 x rank 4)
    assert rc == 2 and f"{old} already holds this run" in err and "(note: " in err and "written before run identities" in err
    rc, out, _ = cli(capsys, "run", "--resume", str(old))  # complete: returned as is, with the note
    assert rc == 0 and "note: " in out and "written before run identities" in out and not (old / IDENTITY_FILE).exists()
    # a FedGaLore run from before identities ran the rule before issue 33's fixes: not this version's run
    (base / IDENTITY_FILE).unlink()
    with pytest.raises(ConfigError, match=r"method\.behaviour: 1 -> 3"):
        fedgalore.run(load_config(path), resume=base)
    # FedGaLore⁻ before issue 40's epoch schedule: not this version's run either
    minus = ["method.name=fedgalore_minus"]
    assert cli(capsys, "run", "--config", path, *minus)[0] == 0
    old_minus = base.with_name(base.name.replace("fedgalore", "fedgalore_minus"))
    (old_minus / IDENTITY_FILE).unlink()
    with pytest.raises(ConfigError, match=r"method\.behaviour: 1 -> 2"):
        fedgalore.run(load_config(path, minus), resume=old_minus)


def _tiny_bert(folder: Path, seed: int) -> None:
    """A tiny random-weight BERT classifier (2 labels) with a word-level tokenizer, saved to ``folder``."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    cfg = BertConfig(vocab_size=5 + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)


WORDS = ["good", "great", "fine", "bad", "awful", "poor", "the", "movie", "was", "plot"]


def _sst2(folder: Path) -> None:
    folder.mkdir()
    for split, n in (("train", 24), ("validation", 8)):
        rows = ["sentence,label"] + [f"the movie was {WORDS[i % 6]},{int(i % 6 < 3)}" for i in range(n)]
        (folder / f"{split}.csv").write_text("\n".join(rows) + "\n")


@pytest.mark.slow
def test_a_model_folder_changed_under_the_same_path_is_another_run(tmp_path, capsys) -> None:
    model, data = (tmp_path / "my-model").resolve(), (tmp_path / "my-data").resolve()  # messages name resolved paths
    _tiny_bert(model, seed=0)
    _sst2(data)
    path = str(tiny_config(tmp_path))
    task = ["task.name=glue", "task.options={}", f"task.options.model={model}", f"task.options.data_dir={data}",
            "task.options.max_length=16", "task.options.cache=false", "method.rank=2"]
    base = tmp_path / "runs" / "idt-fedgalore-iid-s0"
    assert cli(capsys, "run", "--config", path, *task)[0] == 0
    inputs = json.loads((base / IDENTITY_FILE).read_text())["inputs"]
    assert set(inputs) == {"task.options.model", "task.options.data_dir"}
    assert {"model.safetensors", "config.json", "vocab.txt", "tokenizer_config.json"} <= set(inputs["task.options.model"]["listing"])
    assert cli(capsys, "run", "--config", path, *task)[0] == 2  # unchanged: the same run

    _tiny_bert(model, seed=1)  # other weights, same path, same shapes
    rc, out, _ = cli(capsys, "run", "--config", path, *task)
    assert rc == 0 and (f"{base} holds a run with other inputs (task.options.model ({model}): model.safetensors changed); "
                        f"this run goes to {base}-2") in out
    rc, _, err = cli(capsys, "run", "--resume", str(base))
    assert rc == 2 and err.strip() == (
        f"fedgalore: error: cannot resume {base} with another config or inputs (task.options.model ({model}): "
        f"model.safetensors changed); a resumed run keeps its saved config.yaml and the model and data files it started "
        f"with, and only federation.rounds may change (to extend it); start a new run instead: fedgalore run --config "
        f"{base / 'config.yaml'} output.run_name=<new name>")
    # a data file changed under the same folder
    with open(data / "train.csv", "a") as fh:
        fh.write("the plot was great,1\n")
    diffs = texts(compare_with_saved(base.with_name(base.name + "-2"), run_identity(load_config(path, task)))[0])
    assert diffs == [f"task.options.data_dir ({data}): train.csv changed"]


# ----------------------------------------------------------------------------- compare
@pytest.mark.slow
def test_compare_skips_only_cells_of_the_same_identity(tmp_path, capsys) -> None:
    path = str(tiny_config(tmp_path))
    out = tmp_path / "cmp"
    argv = ["compare", "--config", path, "--methods", "fedgalore", "--settings", "iid", "--out", str(out), "--no-report"]
    cell = out / "runs" / "fedgalore-iid-s0"
    assert cli(capsys, *argv)[0] == 0
    rc, text, _ = cli(capsys, *argv, "method.options.moment_protocol=aligned")  # a default written out
    assert rc == 0 and "[cell 1/1] fedgalore iid seed=0: complete, skipped" in text
    first = json.loads((cell / "summary.json").read_text())

    rc, _, err = cli(capsys, *argv, "method.options.moment_protocol=paper")  # a changed option: refused, nothing run
    assert rc == 2 and err.strip() == (
        f"fedgalore: error: 1 cell(s) in {out} already ran with a different config or inputs: fedgalore-iid-s0 "
        f"(method.options.moment_protocol: 'aligned' -> 'paper'; method.options.moment_transfer: 'squared' -> 'linear'; "
        f"and 1 more); re-run them with --rerun-changed (their old runs move to {out / '.superseded'}), or use another output "
        f"directory (--out)")
    assert json.loads((cell / "summary.json").read_text()) == first

    rc, text, _ = cli(capsys, *argv, "method.options.moment_protocol=paper", "--rerun-changed")
    assert rc == 0 and main(["report", str(out), "--no-plots"]) == 0
    assert (f"[cell 1/1] fedgalore iid seed=0: ran with another config or inputs (method.options.moment_protocol: "
            f"'aligned' -> 'paper'; method.options.moment_transfer: 'squared' -> 'linear'; method.options.view_basis: "
            f"'consensus' -> 'seeded'); old run moved to "
            f"{out / '.superseded' / 'fedgalore-iid-s0-1'}") in text
    assert "[cell 1/1] fedgalore iid seed=0: running ->" in text
    assert json.loads((out / ".superseded" / "fedgalore-iid-s0-1" / "summary.json").read_text()) == first  # kept
    comp = json.loads((out / "comparison.json").read_text())
    assert [r["run_dir"] for r in comp["runs"]] == ["runs/fedgalore-iid-s0"]  # the old run is never reported
    assert json.loads((cell / IDENTITY_FILE).read_text())["config"]["method"]["options"]["moment_protocol"] == "paper"

    # a FedGaLore cell from before identities ran the rule before issue 33's fixes: refused, naming it
    (cell / IDENTITY_FILE).unlink()
    rc, _, err = cli(capsys, *argv, "method.options.moment_protocol=paper")
    assert rc == 2 and "fedgalore-iid-s0 (method.behaviour: 1 -> 3)" in err


# ----------------------------------------------------------------------------- a task object in code
@pytest.mark.slow
def test_a_task_object_is_recorded_as_what_it_is(tmp_path, capsys) -> None:
    cfg = load_config(tiny_config(tmp_path), ["task.name=offline_text", "task.options={}"])  # not the task that runs
    result = fedgalore.run(cfg, task=TinyTextTask(**TINY_TASK))
    run_dir = result.run_dir
    saved = load_config(run_dir / "config.yaml")
    assert saved.task.name == "tiny_text" and saved.task.object == "fedgalore.tasks.synthetic:TinyTextTask"
    assert saved.task.options == {**TinyTextTask(**TINY_TASK).reported_options()} and saved.task.options["n_train"] == 48
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"] == "tiny_text (TinyTextTask object)"
    obj = summary["task_object"]
    assert obj["object"] == saved.task.object and set(obj["data"]) == {"train", "test", "partition"}
    assert main(["report", str(run_dir), "--no-plots"]) == 0
    assert "| tiny_text (TinyTextTask object) |" in (run_dir / "table.md").read_text()
    capsys.readouterr()

    with pytest.raises(ConfigError, match="already holds this run"):  # the same object again
        fedgalore.run(cfg, task=TinyTextTask(**TINY_TASK))
    other = TinyTextTask(**TINY_TASK)
    other.train_set().columns["labels"][0] = 1 - other.train_set().columns["labels"][0]  # same options, other data
    with pytest.raises(ConfigError, match=r"cannot resume .* \(task\.data\.partition: .*; task\.data\.train: "):
        fedgalore.run(cfg, resume=run_dir, task=other)
    assert fedgalore.run(cfg, resume=run_dir, task=TinyTextTask(**TINY_TASK)).summary["status"] == "finished"
    rc, _, err = cli(capsys, "run", "--resume", str(run_dir))  # the config alone cannot rebuild it
    assert rc == 2 and ("the task of this run is an object passed in code (fedgalore.tasks.synthetic:TinyTextTask), "
                        "which the config cannot rebuild") in err
    moved = fedgalore.run(cfg, task=other)
    assert moved.run_dir == run_dir.with_name(run_dir.name + "-2")


def test_a_method_whose_rule_was_fixed_is_not_the_same_run(tmp_path) -> None:
    """Issue 33 changed what FedGaLore computes for the same options (paper mode as written, the
    cold cap, evidence pooling), and issue 40 again (the epoch schedule by default, AJIVE weighted
    by evidence): a FedGaLore run saved without a behaviour version (every run made before issue
    33) differs from this version's (``method.behaviour: 1 -> 3``), a FedGaLore⁻ run too since
    issue 40's schedule (``1 -> 2``); FedAvg-Full, whose results did not change, does not."""
    import yaml

    from fedgalore.records.identity import compare_with_saved, run_identity

    for method, differs in (("fedgalore", "1 -> 3"), ("fedgalore_minus", "1 -> 2"), ("fedavg_full", None)):
        cfg = load_config(tiny_config(tmp_path), [f"method.name={method}"])
        old = tmp_path / f"old-{method}"
        old.mkdir()
        (old / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))  # a run directory from before identities
        diffs, note = compare_with_saved(old, run_identity(cfg))
        assert [str(d) for d in diffs] == ([f"method.behaviour: {differs}"] if differs else []), method
        assert note and "before run identities" in note
