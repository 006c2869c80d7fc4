"""Your model and your data in, a Hugging Face model out (issue 31, as a user meets it): the generic
file-based tasks (docs/data.md) through `fedgalore run` with clients = sites and per-client
evaluation, `fedgalore export` of each generic task loaded back with plain transformers / PEFT (the
run's logits and final metric), `fedgalore evaluate --data FILE`, and the run identity of the
files and default model folders they read.

Everything runs on the tiny random checkpoints of conftest.py (``bert_dir``, ``llama_dir``,
``vit_dir``) and on data written here with column names that are not the defaults. The reference
model is the engine's own: the :class:`Federation` object's global model after the run (tests/
fedgalore_testing/models.py's :class:`Run`), never rebuilt through the export code.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import fedgalore
from fedgalore.cli import main
from fedgalore.job.config import load_config
from fedgalore.trained.export import ExportError, export_run
from fedgalore.trained.global_model import load_global_model
from fedgalore.records.identity import run_identity
from fedgalore.jsonl import read_jsonl
from fedgalore_testing.models import Run, logits_of, same_metrics
from fedgalore_testing.assets import TOPICS, news_rows, save_tiny_bert, write

SITES = ["s0", "s1", "s2", "s3"]
NEWS_YAML = """\
name: news
task:
  name: text_classification
  options: {{model: {model}, data: news.csv, text_column: body, label_column: topic, max_length: 16}}
method: {{name: fedgalore, rank: 4}}
federation: {{clients_per_round: null, rounds: 2, client_eval: true, partition: {{kind: natural, column: site}}}}
train: {{lr: 1.0e-3, batch_size: 8, local_steps: 2}}
output: {{dir: runs, progress: quiet}}
"""


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def site_run(tmp_path_factory, bert_dir):
    """`text_classification` on ``news.csv`` (body, topic, site; relative paths, as a user writes
    them), clients = the 4 sites, per-client evaluation, FedGaLore, 2 rounds."""
    root = tmp_path_factory.mktemp("sites")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("FEDGALORE_CACHE", str(root / "cache"))
        write(news_rows(60), root / "news.csv")
        (root / "news.yaml").write_text(NEWS_YAML.format(model=bert_dir))
        run = Run(load_config("news.yaml"))
    run.dir = root / run.dir  # relative to where it ran
    return root, run


def _one_line_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedgalore: error: "), lines
    return lines[0]


QA_ROWS = [{"q": f"What is {a} plus {b}?", "a": f"{a + b}"} for a in range(4) for b in range(4)]


def load_config_text(folder: Path, text: str):
    """The config of the YAML ``text`` (saved in ``folder``, as a user writes it)."""
    (folder / "run.yaml").write_text(text)
    return load_config(folder / "run.yaml")


@torch.no_grad()
def _plain_text_predictions(folder: Path, texts: list[str], max_length: int) -> tuple[torch.Tensor, list[str]]:
    """Logits and predicted label names of ``texts`` by the folder alone, as a user runs it:
    ``AutoTokenizer`` + ``AutoModelForSequenceClassification`` + ``config.id2label``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    enc = tok(texts, truncation=True, max_length=max_length, padding="max_length", return_tensors="pt")
    logits = model(**enc).logits
    return logits, [model.config.id2label[int(i)] for i in logits.argmax(-1)]


# ----------------------------------------------------------------------------- sites, per-client evaluation
def test_natural_sites_and_client_eval_on_a_csv(site_run):
    root, run = site_run
    assert run.dir == root / "runs" / "news-fedgalore-naturalsite-s0"
    part = json.loads((run.dir / "partition.json").read_text())
    assert part["client_names"] == [c["name"] for c in part["clients"]] == SITES
    assert sum(part["sizes"]) + sum(part["test_sizes"]) == 48  # the 60 rows less the 12 held out for the test set
    train_sites = np.asarray(run.task.partition_values("site"))
    assert [s + t for s, t in zip(part["sizes"], part["test_sizes"])] == [int((train_sites == s).sum()) for s in SITES]
    assert [c["histogram"] for c in part["clients"]][0].keys() <= set(TOPICS)
    history = read_jsonl(run.dir / "metrics.jsonl")
    assert [h["round"] for h in history] == [1, 2]
    for rec in history:
        per = rec["client_eval"]["clients"]
        assert list(per) == SITES and [per[s]["n"] for s in SITES] == part["test_sizes"]
        acc = np.array([per[s]["accuracy"] for s in SITES])
        assert rec["eval/client_worst_accuracy"] == acc.min() and rec["client_eval"]["worst_client"] == SITES[int(acc.argmin())]
        n = np.array(part["test_sizes"], dtype=float)
        assert rec["eval/client_mean_accuracy"] == pytest.approx(float(n @ acc / n.sum()), rel=1e-12)
    assert {r["client_name"] for r in read_jsonl(run.dir / "clients.jsonl")} <= set(SITES)


# ----------------------------------------------------------------------------- export: text
def test_text_export_loads_with_plain_transformers(site_run, tmp_path):
    root, run = site_run
    out = tmp_path / "news-model"
    res = export_run(run.dir, out)
    assert res.processor == type(run.task.processor()).__name__ and res.check < 1e-5  # exported from another folder
    assert json.loads((out / "fedgalore_identity.json").read_text()) == json.loads((run.dir / "identity.json").read_text())
    texts = [str(t) for t in run.task._rows["test"].data["body"]]
    gold = [str(t) for t in run.task._rows["test"].data["topic"]]
    logits, predicted = _plain_text_predictions(out, texts, max_length=16)  # raw text in: no fedgalore
    torch.testing.assert_close(logits, run.logits, atol=1e-5, rtol=0)
    assert np.mean([p == g for p, g in zip(predicted, gold)]) == pytest.approx(run.summary["final"]["accuracy"], abs=1e-9)
    card = (out / "README.md").read_text()
    inputs = json.loads((run.dir / "identity.json").read_text())["inputs"]  # the card's fingerprints are the run's
    assert f"| task.options.data | news.csv | {(root / 'news.csv').stat().st_size:,} B | SHA-256 `{inputs['task.options.data']['sha256']}` |" in card
    assert f"| task.options.model | {Path(inputs['task.options.model']['path']).name}/ |" in card
    assert "Labels: politics, sport, tech." in card and "natural:site over 4 clients" in card
    # the reproduce command runs the saved config (data: news.csv) from the folder the run started in
    assert f"cd {root.resolve()} && fedgalore run --config {out.resolve()}/fedgalore_config.yaml output.dir=reproduced" in card


# ----------------------------------------------------------------------------- evaluate --data
def test_evaluate_on_a_data_file(site_run, tmp_path, capsys):
    """From another working directory than the run's, whose config names news.csv relatively."""
    root, run = site_run
    out = tmp_path / "exported"
    export_run(run.dir, out)
    rows = news_rows(30, seed=7)
    sub = rows[rows["topic"] != "tech"]  # a subset of the training labels
    write(sub, tmp_path / "new.csv")
    _, predicted = _plain_text_predictions(out, list(sub["body"]), max_length=16)
    want = float(np.mean([p == g for p, g in zip(predicted, sub["topic"])]))
    for source in (run.dir, out):
        assert main(["evaluate", str(source), "--data", str(tmp_path / "new.csv"), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["examples"] == len(sub) == 20 and got["task"] == "text_classification"
        assert got["metrics"]["accuracy"] == pytest.approx(want, abs=1e-9)
    write(rows.assign(topic=["weather"] + list(rows["topic"][1:])), tmp_path / "unseen.csv")
    line = _one_line_error(capsys, ["evaluate", str(out), "--data", str(tmp_path / "unseen.csv")])
    assert line == ("fedgalore: error: label 'weather' of unseen.csv (row 1, column 'topic') never occurs in the training "
                    "data (news.csv: politics, sport, tech); fix that row or add training rows with it")


# ----------------------------------------------------------------------------- export: causal LM, images
def test_causal_lm_export_loads_with_plain_transformers(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ops = ["add", "sub", "mul"]
    rows = [{"ask": f"What is {a} {op} {b}?", "reply": f"{a} {op} {b} is {a + b if op == 'add' else a - b if op == 'sub' else a * b}",
             "op": op} for a in range(1, 5) for b in range(1, 4) for op in ops]
    write(pd.DataFrame(rows), tmp_path / "ops.jsonl")
    cfg = load_config_text(tmp_path, f"""\
name: ops
task: {{name: causal_lm, options: {{model: {llama_dir}, data: {tmp_path / 'ops.jsonl'}, prompt_column: ask,
        response_column: reply, category_column: op, max_length: 48}}}}
method: {{name: fedit, rank: 2}}
federation: {{num_clients: 3, clients_per_round: 3, rounds: 1, partition: {{kind: pathological, classes_per_client: 1, by: op}}}}
train: {{lr: 1.0e-2, batch_size: 4, local_steps: 2}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    run = Run(cfg)
    part = json.loads((run.dir / "partition.json").read_text())
    assert [sorted(c["histogram"]) for c in part["clients"]] == [["add"], ["mul"], ["sub"]]  # by: op, one op each
    res = export_run(run.dir, tmp_path / "hf")
    assert res.processor == type(run.task.processor()).__name__ and res.check < 1e-5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    test = run.task.test_set()
    assert tok.chat_template == run.task.tokenizer.chat_template
    assert [tok(p)["input_ids"] for p in test.prompts] == [run.task.tokenizer(p)["input_ids"] for p in test.prompts]
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    same_metrics(run.task.evaluate(model, test, 64), run.summary["final"])


def test_export_of_a_model_folder_converted_from_gguf(tmp_path, llama_dir):
    """A folder converted from GGUF keeps GGUF's ``quantization_config`` in its config.json (the
    offline SmolLM2's did) although its weights are dense fp32: the export is not refused as
    quantised, and the exported config no longer claims GGUF."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "converted"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"dequantize": False, "gguf_file": "model.Q4_1.gguf", "quant_method": "gguf"}
    (model_dir / "config.json").write_text(json.dumps(config))
    write(pd.DataFrame(QA_ROWS), tmp_path / "qa.jsonl")
    cfg = load_config_text(tmp_path, f"""\
name: gguf
task: {{name: causal_lm, options: {{model: {model_dir}, data: {tmp_path / 'qa.jsonl'}, prompt_column: q, response_column: a,
        max_length: 32}}}}
method: {{name: fedgalore, rank: 2}}
federation: {{num_clients: 2, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_steps: 1}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    run = Run(cfg)
    assert run.model.config.quantization_config is not None  # as the converted folder says
    assert export_run(run.dir, tmp_path / "hf").check < 1e-5
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), run.batch), run.logits,
                               atol=1e-5, rtol=0)


def _pets(root: Path, per_class: int = 8) -> Path:
    from PIL import Image

    g = np.random.default_rng(0)
    for c, color in zip(("cat", "dog", "owl"), ((220, 30, 30), (30, 200, 30), (30, 30, 220))):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            arr = np.clip(np.array(color)[None, None] + g.normal(0, 40, (12, 12, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / f"{c}{i}.png")
    return root


@pytest.mark.parametrize("own_processor", [True, False], ids=["with-processor", "without-processor"])
def test_image_export_loads_with_plain_transformers_and_peft(tmp_path, vit_dir, own_processor):
    """hf and peft exports of an image folder run; a model folder without an image processor (the
    offline tiny ViT's case) exports the processor the task made, so raw images give the run's logits."""
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    model_dir = tmp_path / "vit"
    shutil.copytree(vit_dir, model_dir)
    if not own_processor:
        (model_dir / "preprocessor_config.json").unlink()
    cfg = load_config_text(tmp_path, f"""\
name: pets
task: {{name: image_classification, options: {{model: {model_dir}, data: {_pets(tmp_path / 'pets')}, new_head: true,
        test_fraction: 0.25}}}}
method: {{name: fedit, rank: 2}}
federation: {{num_clients: 2, clients_per_round: 2, rounds: 2, partition: {{kind: iid}}}}
train: {{lr: 1.0e-2, batch_size: 4, local_steps: 2}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    run = Run(cfg)
    files = run.task.test_set().images
    gold = [run.task.label_names()[int(y)] for y in run.task.test_set().labels]
    for fmt in ("hf", "peft"):
        res = export_run(run.dir, tmp_path / fmt, format=fmt)
        assert res.processor == "ViTImageProcessorPil" and res.check < 1e-5, fmt
        assert 'images in mode "RGB" (3 channels)' in (tmp_path / fmt / "README.md").read_text()
        processor = AutoImageProcessor.from_pretrained(tmp_path / fmt)
        if fmt == "hf":
            model = AutoModelForImageClassification.from_pretrained(tmp_path / fmt)
        else:  # the base built by transformers alone, as the card says; the adapter carries the head
            base = AutoModelForImageClassification.from_pretrained(model_dir, num_labels=3, ignore_mismatched_sizes=True)
            model = PeftModel.from_pretrained(base, tmp_path / fmt)
        with torch.no_grad():
            pixels = processor([Image.open(f).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]
            logits = model.eval()(pixel_values=pixels).logits  # raw image files in: no fedgalore
        torch.testing.assert_close(logits[:len(run.logits)], run.logits, atol=1e-5, rtol=0)
        accuracy = np.mean([model.config.id2label[int(i)] == g for i, g in zip(logits.argmax(-1), gold)]) if fmt == "hf" else \
            np.mean([run.task.label_names()[int(i)] == g for i, g in zip(logits.argmax(-1), gold)])
        assert accuracy == pytest.approx(run.summary["final"]["accuracy"], abs=1e-9), fmt


def test_image_adapter_travels_with_its_base_and_labels(tmp_path, vit_dir):
    """``model: null`` (the offline tiny ViT, pretrained in this machine's cache: no hub id, no image
    processor): the peft export ships its base in ``base/`` with the run's labels, and the card's
    load block, run in a fresh process with transformers and peft only (fedgalore not importable),
    gives the hf export's labels and the run's logits, with no head mismatch or new-head report."""
    import os
    import subprocess
    import sys

    from transformers import AutoModelForImageClassification

    from fedgalore.tasks.pretrain_vit import pretrained_vit_dir

    shutil.copytree(vit_dir, pretrained_vit_dir())  # what `python -m fedgalore.tasks.pretrain_vit` leaves there, tiny
    (pretrained_vit_dir() / "preprocessor_config.json").unlink()
    cfg = load_config_text(tmp_path, f"""\
name: pets
task: {{name: image_classification, options: {{data: {_pets(tmp_path / 'pets')}, new_head: true, test_fraction: 0.25}}}}
method: {{name: fedit, rank: 2}}
federation: {{num_clients: 2, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-2, batch_size: 4, local_steps: 2}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    run = Run(cfg)
    export_run(run.dir, tmp_path / "hf")
    res = export_run(run.dir, tmp_path / "ad", format="peft")
    assert res.shipped_base == tmp_path / "ad" / "base" and res.check < 1e-5
    assert json.loads((tmp_path / "ad" / "fedgalore_export.json").read_text())["shipped_base"] == "base"
    card = (tmp_path / "ad" / "README.md").read_text()
    block = re.search(r"## Load\n.*?```python\n(.*?)```", card, re.S).group(1)
    probe = "import sys\nsys.modules['fedgalore'] = None  # plain transformers and peft\n" + block + f"""
import json, torch
from PIL import Image
with torch.no_grad():
    pixels = processor([Image.open(f).convert("RGB") for f in {run.task.test_set().images!r}], return_tensors="pt")
    logits = model.eval()(pixel_values=pixels["pixel_values"]).logits
print(json.dumps({{"id2label": model.config.id2label, "logits": logits.tolist()}}))
"""
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.search(r"mismatch|newly initiali[sz]ed|load report|not initiali[sz]ed", r.stderr, re.I), r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    hf = AutoModelForImageClassification.from_pretrained(tmp_path / "hf")
    assert got["id2label"] == {str(k): v for k, v in hf.config.id2label.items()} == {"0": "cat", "1": "dog", "2": "owl"}
    torch.testing.assert_close(torch.tensor(got["logits"]), run.logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- run identity of the files
def test_changed_data_or_default_model_is_another_run(tmp_path, monkeypatch, capsys, bert_dir):
    """A data file or the default model folder (``model: null``) changed under the same path: `run`
    goes to ``-2`` saying why in one line; ``--resume`` refuses."""
    import fedgalore.tasks.assets as assets

    default = tmp_path / "default-model"
    shutil.copytree(bert_dir, default)
    monkeypatch.setattr(assets, "minilm_path", lambda: default)  # the offline MiniLM, stood in for
    monkeypatch.chdir(tmp_path)
    write(news_rows(48), tmp_path / "news.csv")
    (tmp_path / "news.yaml").write_text(NEWS_YAML.replace("model: {model}, ", "").replace("rounds: 2", "rounds: 1")
                                        .replace("client_eval: true, ", "").replace("{{", "{").replace("}}", "}"))
    base = tmp_path / "runs" / "news-fedgalore-naturalsite-s0"
    assert main(["run", "--config", "news.yaml"]) == 0
    inputs = json.loads((base / "identity.json").read_text())["inputs"]
    assert set(inputs) == {"task.options.data", "task.reads.model"} and inputs["task.reads.model"]["path"] == str(default)
    assert main(["run", "--config", "news.yaml"]) == 2 and "already holds this run" in capsys.readouterr().err

    with open("news.csv", "a") as fh:
        fh.write("a new vote on the party,politics,s1\n")
    capsys.readouterr()
    assert main(["run", "--config", "news.yaml", "--progress", "plain"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if " holds " in x]
    assert said == [f"runs/news-fedgalore-naturalsite-s0 holds a run with other inputs (task.options.data "
                    f"({tmp_path / 'news.csv'}): contents changed (size {inputs['task.options.data']['size']} -> "
                    f"{(tmp_path / 'news.csv').stat().st_size})); this run goes to runs/news-fedgalore-naturalsite-s0-2"]
    line = _one_line_error(capsys, ["run", "--resume", str(base)])
    assert line.startswith(f"fedgalore: error: cannot resume {base} with another config or inputs (task.options.data")

    from transformers import BertModel

    weights = BertModel.from_pretrained(default)
    with torch.no_grad():
        weights.embeddings.word_embeddings.weight.add_(0.01)
    weights.save_pretrained(default)  # other weights in the default model folder
    assert main(["run", "--config", "news.yaml", "--progress", "plain"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if " holds " in x]  # about the first run: both changed
    assert len(said) == 1 and said[0].endswith(f"; task.reads.model ({default}): model.safetensors changed); this run goes to "
                                               "runs/news-fedgalore-naturalsite-s0-3"), said


@pytest.mark.parametrize("task, options, asset", [
    ("causal_lm", {"prompt_column": "q", "response_column": "a"}, ("fedgalore.tasks.assets", "smollm2_path")),
    ("image_classification", {}, ("fedgalore.tasks.pretrain_vit", "pretrained_vit_dir")),
])
def test_default_model_folders_are_fingerprinted(tmp_path, monkeypatch, task, options, asset):
    import importlib

    folder = save_tiny_bert(tmp_path / "default")  # any folder with a model.safetensors will do: nothing is built
    monkeypatch.setattr(importlib.import_module(asset[0]), asset[1], lambda *a: folder)
    write(news_rows(12), tmp_path / "d.csv")
    d = {"name": "x", "task": {"name": task, "options": {"data": str(tmp_path / "d.csv"), **options}}}
    cfg = fedgalore.FederatedConfig.from_dict(d)
    inputs = run_identity(cfg).inputs
    assert set(inputs) == {"task.options.data", "task.reads.model"} and inputs["task.reads.model"]["path"] == str(folder)
    d["task"]["options"]["model"] = str(folder)  # named by the options: fingerprinted once, under its option
    assert set(run_identity(fedgalore.FederatedConfig.from_dict(d)).inputs) == {"task.options.data", "task.options.model"}


# ----------------------------------------------------------------------------- docs/data.md: a Task of your own
DATA_MD = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def test_data_md_custom_task_example_runs(tmp_path, monkeypatch, capsys):
    """docs/data.md's Task subclass written from scratch runs as written (``fedgalore.run(cfg,
    task=MyTask(...))``), and the run records the object and the digests of its data."""
    code = next(m.group(1) for m in re.finditer(r"```python\n(.*?)```", DATA_MD.read_text(), re.S) if "(Task):" in m.group(1))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(DATA_MD), "exec"), scope)  # noqa: S102 - the documentation's own example
    result = scope["result"]
    assert result.summary["rounds_completed"] == 3
    history = read_jsonl(result.run_dir / "metrics.jsonl")
    assert history[-1]["eval/accuracy"] > 0.8 and history[-1]["eval/loss"] < history[0]["eval/loss"]
    identity = json.loads((result.run_dir / "identity.json").read_text())
    assert identity["config"]["task"]["object"].endswith(":Blobs") and set(identity["config"]["task"]["data"]) == {
        "train", "test", "partition"}
    assert f"accuracy {history[-1]['eval/accuracy']:.3f}" in capsys.readouterr().out
    task = scope["Blobs"](seed=0)
    with pytest.raises(ExportError, match=r"the run's model \(MLP\) is not a transformers model.*load_global_model\("):
        export_run(result.run_dir, tmp_path / "out", task=task)
    assert not (tmp_path / "out").exists()
    model = load_global_model(result.run_dir, task=task).model  # where the docs say its global model is
    assert task.evaluate(model, task.test_set(), 64)["accuracy"] == pytest.approx(history[-1]["eval/accuracy"], abs=1e-9)
