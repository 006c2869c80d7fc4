"""``fedgalore predict`` and ``fedgalore evaluate --by`` (issue 44): an unlabelled file becomes
predictions (classes with probabilities, or generations) from a run or an export, in CSV or JSONL;
per-site metrics of a test split with the worst site named."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from fedgalore.cli import main
from fedgalore.trained.evaluate import evaluate
from fedgalore.trained.global_model import load_global_model
from fedgalore.trained.predict import predict
from fedgalore.tasks import get_task
from fedgalore.tasks.base import subset_examples
from fedgalore_testing.assets import news_rows, write
from fedgalore_testing.models import _loaded


NEWS = """\
name: news
task:
  name: text_classification
  options: {{model: {model}, data: {{train: {train}, test: {test}}}, text_column: body, label_column: topic, max_length: 16}}
method: {{name: fedavg_full, rank: 4}}
federation: {{clients_per_round: null, rounds: 1, partition: {{kind: natural, column: site}}}}
train: {{lr: 1.0e-3, batch_size: 8, local_steps: 1}}
output: {{dir: {out}, progress: quiet}}
"""


@pytest.fixture(scope="module")
def news_run(tmp_path_factory, bert_dir):
    """A one-round text_classification run on news rows (sites s0..s3), its test file and an export."""
    import fedgalore

    root = tmp_path_factory.mktemp("predict")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDGALORE_CACHE", str(root / "cache"))
        df = news_rows(80)
        df["body"] = [b + " today" * (i % 5) for i, b in enumerate(df["body"])]  # lengths differ: padding is trimmed per batch
        train, test = write(df.iloc[:56], root / "train.csv"), write(df.iloc[56:].reset_index(drop=True), root / "test.csv")
        (root / "news.yaml").write_text(NEWS.format(model=bert_dir, train=train, test=test, out=root / "runs"))
        res = fedgalore.run(fedgalore.load_config(root / "news.yaml"))
        fedgalore.export_run(res.run_dir, root / "exported")
    return root, res.run_dir


def test_predict_an_unlabelled_file_from_a_run_and_an_export(news_run, capsys, monkeypatch):
    root, run_dir = news_run
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    test = pd.read_csv(root / "test.csv")
    unlabelled = write(test.drop(columns=["topic"]), root / "new.csv")
    assert main(["predict", str(run_dir), "--data", str(unlabelled), "--out", str(root / "pred.csv")]) == 0
    assert f"predicted {len(test)} rows of {unlabelled}" in capsys.readouterr().out
    got = pd.read_csv(root / "pred.csv")
    g = load_global_model(run_dir)
    names = g.task.label_names()
    assert list(got.columns) == ["body", "site", "predicted_label", "predicted_probability"] + [f"prob_{n}" for n in names]
    assert got["body"].tolist() == test["body"].tolist()  # the input rows, in order
    probs = got[[f"prob_{n}" for n in names]].to_numpy()
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-9)
    np.testing.assert_allclose(got["predicted_probability"], probs.max(1), atol=1e-12)
    # the same classes and probabilities the run's own model gives its test split (the same rows)
    ids, _ = g.task.predict(g.model, g.task.test_set(), 64)
    assert got["predicted_label"].tolist() == [names[i] for i in ids]
    with torch.no_grad():
        logits = g.model(**{k: v for k, v in g.task.test_set().batch(range(len(test))).items() if k != "labels"}).logits
    np.testing.assert_allclose(probs, torch.softmax(logits.double(), -1).numpy(), atol=1e-5)
    # an export predicts the same; JSONL out
    res = predict(root / "exported", unlabelled, root / "pred.jsonl", batch_size=3)
    rows = [json.loads(x) for x in (root / "pred.jsonl").read_text().splitlines()]
    assert res.rows == len(rows) == len(test) and res.source == f"folder {root / 'exported'}"
    assert [r["predicted_label"] for r in rows] == got["predicted_label"].tolist()
    np.testing.assert_allclose([[r[f"prob_{n}"] for n in names] for r in rows], probs, atol=1e-6)


def test_predict_bad_input_is_one_line(news_run, capsys, monkeypatch):
    root, run_dir = news_run
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    no_text = write(pd.DataFrame({"text_body": ["a b"]}), root / "other.csv")
    labelled = root / "test.csv"
    cases = [
        (["--data", str(labelled), "--out", str(root / "p.txt")], "write predictions to a .csv or .jsonl file"),
        (["--data", str(root / "nope.csv"), "--out", str(root / "p.csv")], "no such file"),
        (["--data", str(no_text), "--out", str(root / "p.csv")], "has no column 'body' (the task's text_column); its columns: text_body"),
        (["--data", str(labelled), "--out", str(root / "test.csv")], "exists; choose another file, or add --force"),
    ]
    for args, expect in cases:
        assert main(["predict", str(run_dir), *args]) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and expect in lines[0], lines
    # --text-column names another column
    assert main(["predict", str(run_dir), "--data", str(no_text), "--out", str(root / "p.csv"), "--text-column", "text_body"]) == 0
    assert len(pd.read_csv(root / "p.csv")) == 1


def test_evaluate_by_site_gives_each_sites_metrics_and_the_worst(news_run, capsys, monkeypatch):
    root, run_dir = news_run
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    ev = evaluate(run_dir, by="site", min_group=1)  # ~6 test rows a site: every group may be the worst
    g = load_global_model(run_dir)
    sites = np.asarray(pd.read_csv(root / "test.csv")["site"])
    assert list(ev.groups) == sorted(set(sites))
    for name, m in ev.groups.items():
        alone = g.task.evaluate(g.model, subset_examples(g.task.test_set(), np.flatnonzero(sites == name)), 64)
        assert m["n"] == int((sites == name).sum()) and m["accuracy"] == alone["accuracy"]
        assert m["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    acc = {n: m["accuracy"] for n, m in ev.groups.items()}
    assert ev.worst == min(acc, key=acc.get) and ev.metrics == g.task.evaluate(g.model, g.task.test_set(), 64)
    assert main(["evaluate", str(run_dir), "--by", "site", "--min-group", "1"]) == 0
    out = capsys.readouterr().out
    assert "by site (4 groups):" in out and f"worst site (by the task's primary metric): {ev.worst} (accuracy=" in out
    assert main(["evaluate", str(run_dir), "--by", "site", "--json", "--min-group", "1"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["worst"] == ev.worst and js["groups"][ev.worst]["n"] == ev.groups[ev.worst]["n"]
    assert main(["evaluate", str(run_dir), "--by", "region"]) == 2
    assert "--by region: task 'text_classification': test.csv has no column 'region'; its columns: body, topic, site" in capsys.readouterr().err


def test_evaluate_by_needs_a_task_with_columns(tmp_path, capsys):
    import fedgalore
    from fedgalore_testing.runs import tiny_cfg

    res = fedgalore.run(tiny_cfg(tmp_path, "fedavg_full", rounds=1))
    assert main(["evaluate", str(res.run_dir), "--by", "site"]) == 2
    assert "--by site: task 'tiny_text' keeps no columns of its test rows" in capsys.readouterr().err
    assert main(["predict", str(res.run_dir), "--data", str(tmp_path / "x.csv"), "--out", str(tmp_path / "y.csv")]) == 2
    capsys.readouterr()


def test_predict_generations_for_prompts_without_responses(tmp_path, llama_dir, monkeypatch):
    """causal_lm: unlabelled prompts (no response column) and chats ending with the user's turn get
    the task's own prompt (its chat template) and a greedy generation each."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    qa = [{"question": f"What is {a} plus {b}?", "solution": f"The answer is {a + b}"} for a in range(4) for b in range(3)]
    task = get_task("causal_lm", model=str(llama_dir), data=str(write(pd.DataFrame(qa), tmp_path / "qa.jsonl")),
                    prompt_column="question", response_column="solution", max_length=64, max_new_tokens=3)
    loaded = _loaded(monkeypatch, task)
    new = write(pd.DataFrame({"question": ["What is 1 plus 1?", "What is 3 plus 2?"], "id": [7, 8]}), tmp_path / "new.csv")
    res = predict("ignored", new, tmp_path / "gen.jsonl", batch_size=1)
    rows = [json.loads(x) for x in (tmp_path / "gen.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 1 plus 1?", "What is 3 plus 2?")]
    assert task.prediction_prompts(task._rows["test"].select([0, 1])) == task.test_set().prompts[:2]  # labelled rows: the same prompts
    assert [r["generation"] for r in rows] == task.generate(loaded.model, prompts) and [r["id"] for r in rows] == [7, 8]
    assert res.columns == ["generation"]

    chats = [{"role": "user", "content": r["question"]} for r in qa]
    conv = [{"messages": [c, {"role": "assistant", "content": r["solution"]}]} for c, r in zip(chats, qa)]
    ctask = get_task("causal_lm", model=str(llama_dir), data=str(write(pd.DataFrame(conv), tmp_path / "chats.jsonl")),
                     messages_column="messages", max_length=64, max_new_tokens=3)
    _loaded(monkeypatch, ctask)
    ask = write(pd.DataFrame({"messages": [[{"role": "user", "content": "What is 1 plus 1?"}]]}), tmp_path / "ask.jsonl")
    predict("ignored", ask, tmp_path / "gen2.csv")
    assert ctask.prediction_prompts(ctask._rows["train"].select([0])) == [ctask.train_set().prompts[0]]
    out = pd.read_csv(tmp_path / "gen2.csv")
    assert out["generation"].tolist() == task.generate(loaded.model, prompts[:1])  # the same model, the same prompt


def test_predict_images_without_labels(tmp_path, vit_dir, monkeypatch):
    from fedgalore_testing.models import _images

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    root = _images(tmp_path / "pets")
    task = get_task("image_classification", model=str(vit_dir), data=str(root), test_fraction=0.5, new_head=True)
    loaded = _loaded(monkeypatch, task)
    files = sorted(str(p.relative_to(tmp_path)) for p in root.rglob("*.png"))[:5]
    new = write(pd.DataFrame({"image": files}), tmp_path / "new.csv")
    predict("ignored", new, tmp_path / "pred.csv", batch_size=2)
    got = pd.read_csv(tmp_path / "pred.csv")
    from PIL import Image

    pixels = task.image_processor(images=[Image.open(tmp_path / f).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = torch.softmax(loaded.model(pixel_values=pixels).logits.double(), -1).numpy()
    np.testing.assert_allclose(got[[f"prob_{c}" for c in task.label_names()]].to_numpy(), ref, atol=1e-5)
    assert got["predicted_label"].tolist() == [task.label_names()[i] for i in ref.argmax(1)]


def test_predict_and_evaluate_read_an_image_folder(tmp_path, vit_dir, monkeypatch, capsys):
    """``--data`` a folder of images: flat (rows without labels) or one sub-folder per class (as
    training reads one) for predict, the class folders for evaluate — the same numbers as a file
    listing the same images."""
    import shutil

    import fedgalore
    from fedgalore_testing.models import _images

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    root = _images(tmp_path / "pets")
    (tmp_path / "pets.yaml").write_text(f"""\
name: pets
task: {{name: image_classification, options: {{model: {vit_dir}, data: {root}, new_head: true, test_fraction: 0.25}}}}
method: {{name: fedit, rank: 2}}
federation: {{num_clients: 2, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-2, batch_size: 4, local_steps: 1}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    run_dir = fedgalore.run(fedgalore.load_config(tmp_path / "pets.yaml")).run_dir
    flat = tmp_path / "scans"
    flat.mkdir()
    for f in sorted(root.rglob("*.png"))[::3]:
        shutil.copy(f, flat / f.name)
    listed = write(pd.DataFrame({"image": [str(f) for f in sorted(flat.iterdir())]}), tmp_path / "listed.csv")
    assert main(["predict", str(run_dir), "--data", str(listed), "--out", str(tmp_path / "by_file.csv")]) == 0
    assert main(["predict", str(run_dir), "--data", str(flat), "--out", str(tmp_path / "flat.csv")]) == 0
    assert "predicted 6 rows of" in capsys.readouterr().out
    by_file, by_folder = pd.read_csv(tmp_path / "by_file.csv"), pd.read_csv(tmp_path / "flat.csv")
    assert by_folder["image"].tolist() == by_file["image"].tolist()
    probs = [c for c in by_file if c.startswith("prob_")]
    np.testing.assert_allclose(by_folder[probs].to_numpy(), by_file[probs].to_numpy(), atol=1e-6)
    assert main(["predict", str(run_dir), "--data", str(root), "--out", str(tmp_path / "classes.csv")]) == 0
    classes = pd.read_csv(tmp_path / "classes.csv")
    assert len(classes) == 18 and classes["label"].tolist() == ["cat"] * 6 + ["dog"] * 6 + ["owl"] * 6
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--data", str(root), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["examples"] == 18
    assert ev["metrics"]["accuracy"] == pytest.approx(np.mean(classes["predicted_label"] == classes["label"]), abs=1e-9)
    assert main(["evaluate", str(run_dir), "--data", str(flat)]) == 2  # no class folders: nothing to score, said so
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds images without class sub-folders" in err[0] and "fedgalore predict" in err[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["predict", str(run_dir), "--data", str(empty), "--out", str(tmp_path / "e.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no images" in err[0] and not (tmp_path / "e.csv").exists()
