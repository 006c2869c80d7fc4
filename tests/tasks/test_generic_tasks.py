"""The generic tasks (issue 31, items 1, 2 and the data/task bad inputs of item 7): your files
through ``datasets``, your model folder, configured by ``task.options`` alone.

Everything runs on tiny random checkpoints (conftest.py's fixtures, saved by tests/fedgalore_testing/assets.py:
a BERT with a WordPiece tokenizer, a Llama with a BPE tokenizer and a chat template, a ViT with an
image processor) and on data files written in every supported format, with column names that differ from the defaults.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_REAL_CACHE = Path(os.environ.get("FEDGALORE_CACHE") or Path.home() / ".cache" / "fedgalore").expanduser()

import numpy as np
import pandas as pd
import pytest
import torch

from fedgalore.tasks import TaskError, get_task, parse_task_options
from fedgalore.tasks.generic.architectures import default_target_modules, pick_target_modules, skeleton
from fedgalore_testing.assets import TOPICS, news_rows, write
from fedgalore_testing.models import QA, _images, causal_task


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def text_task(bert_dir, data, **kw):
    opts = dict(model=str(bert_dir), data=data if isinstance(data, dict) else str(data), text_column="body",
                label_column="topic", max_length=16)
    opts.update(kw)
    return get_task("text_classification", **opts)


def _texts(task, split: str) -> list[str]:
    ex = task._examples(split)
    return [f"{t}|{y}" for t, y in zip(ex.text, ex.labels)]


# ============================================================================ 1. data from files
def test_every_format_loads_the_same_examples(tmp_path, bert_dir):
    df = news_rows()
    ref = text_task(bert_dir, write(df, tmp_path / "news.csv"))
    assert ref.label_names() == TOPICS and len(ref.train_set()) == 48 and len(ref.test_set()) == 12
    for name in ("news.tsv", "news.json", "news.jsonl", "news.parquet", "news_saved"):
        task = text_task(bert_dir, write(df, tmp_path / name))
        assert _texts(task, "train") == _texts(ref, "train") and _texts(task, "test") == _texts(ref, "test"), name
        assert torch.equal(task.train_set().columns["input_ids"], ref.train_set().columns["input_ids"]), name
    # a datasets DatasetDict folder and a {train, test} mapping of files give the same split
    import datasets

    train_df, test_df = df.iloc[:40], df.iloc[40:]
    datasets.DatasetDict({"train": datasets.Dataset.from_pandas(train_df, preserve_index=False),
                          "test": datasets.Dataset.from_pandas(test_df, preserve_index=False)}).save_to_disk(str(tmp_path / "dd"))
    a = text_task(bert_dir, tmp_path / "dd")
    b = text_task(bert_dir, {"train": str(write(train_df, tmp_path / "tr.jsonl")), "test": str(write(test_df, tmp_path / "te.parquet"))})
    assert _texts(a, "train") == _texts(b, "train") and len(a.test_set()) == 20 and _texts(a, "test") == _texts(b, "test")
    assert b.describe()["data"] == {"train": "tr.jsonl", "test": "te.parquet"}


def test_split_is_stratified_seeded_and_deterministic(tmp_path, bert_dir):
    df = pd.concat([news_rows(60), news_rows(30, seed=1).assign(topic="tech")], ignore_index=True)  # 20/20/50 rows
    path = write(df, tmp_path / "news.csv")
    t1, t2 = text_task(bert_dir, path, test_fraction=0.2), text_task(bert_dir, path, test_fraction=0.2)
    assert _texts(t1, "test") == _texts(t2, "test")
    counts = np.bincount(t1.test_set().columns["labels"].numpy(), minlength=3)
    assert counts.tolist() == [4, 4, 10]  # round(0.2 * n_c) per class
    rows = {s: set(t1._rows[s].index.tolist()) for s in ("train", "test")}
    assert rows["train"].isdisjoint(rows["test"]) and rows["train"] | rows["test"] == set(range(len(df)))
    t3 = text_task(bert_dir, path, test_fraction=0.2, seed=1)
    assert _texts(t3, "test") != _texts(t1, "test")
    assert len(text_task(bert_dir, path, limit=10).train_set()) == 10


def test_label_set_from_training_and_written_as_id2label(tmp_path, bert_dir):
    df = news_rows().assign(topic=lambda d: d["topic"].map({"politics": 10, "sport": 3, "tech": 7}))
    task = text_task(bert_dir, write(df, tmp_path / "news.jsonl"))
    assert task.label_names() == ["3", "7", "10"] and task.describe()["label_kind"] == "integer"
    y = task.train_set().columns["labels"].numpy()
    raw = np.asarray(task._rows["train"].data["topic"])
    assert np.array_equal(np.array([3, 7, 10])[y], raw)
    model = task.build_model()
    assert model.config.id2label == {0: "3", 1: "7", 2: "10"} and model.config.label2id == {"3": 0, "7": 1, "10": 2}
    assert task.describe()["labels"] == ["3", "7", "10"]


def test_regression_on_a_float_label_column(tmp_path, bert_dir):
    df = news_rows().assign(score=np.round(np.linspace(0, 5, 60), 3))
    task = text_task(bert_dir, write(df, tmp_path / "scores.parquet"), label_column="score")
    assert task.regression and task.primary_metric == "mse" and not task.higher_is_better
    model = task.build_model()
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    test = task.test_set()
    metrics = task.evaluate(model, test, 8)
    with torch.no_grad():
        pred = model(**test.batch(range(len(test)))).logits[:, 0].numpy()
    gold = test.columns["labels"].numpy()
    assert metrics["mse"] == pytest.approx(float(np.mean((pred - gold) ** 2)), rel=1e-5)
    assert set(metrics) == {"mse", "pearson", "spearman", "loss"}
    assert len(np.unique(task.partition_labels())) == len(task.label_names()) == 5  # score quintiles
    grades = write(df.assign(score=(np.arange(60) % 3).astype(float)), tmp_path / "grades.parquet")  # 0.0, 1.0, 2.0
    classes = text_task(bert_dir, grades, label_column="score")  # whole numbers stored as floats: classes (issue 44)
    assert not classes.regression and classes.label_names() == ["0", "1", "2"]
    assert text_task(bert_dir, grades, label_column="score", regression=True).regression


def test_sentence_pairs(tmp_path, bert_dir):
    from transformers import AutoTokenizer

    df = news_rows().assign(claim=lambda d: "it is " + d["topic"], answer=lambda d: np.where(np.arange(60) % 2, "yes", "no"))
    task = text_task(bert_dir, write(df, tmp_path / "pairs.csv"), text_columns=["body", "claim"], label_column="answer")
    ex = task._examples("train")
    tok = AutoTokenizer.from_pretrained(bert_dir)
    enc = tok(ex.text[0], ex.text_pair[0], truncation=True, max_length=16)
    row = task.train_set()[0]
    n = int(row["attention_mask"].sum())
    assert row["input_ids"][:n].tolist() == enc["input_ids"] and row["token_type_ids"][:n].tolist() == enc["token_type_ids"]
    assert 1 in enc["token_type_ids"] and task.label_names() == ["no", "yes"]


def test_decoder_checkpoint_classifies_from_the_last_token(tmp_path, llama_dir):
    task = get_task("text_classification", model=str(llama_dir), data=str(write(news_rows(), tmp_path / "news.csv")),
                    text_column="body", label_column="topic", max_length=64)
    assert task.head_modules == ("score",) and task.target_modules[0] == "q_proj"
    model = task.build_model()  # the tokenizer has no padding token: it pads with </s>
    assert model.config.pad_token_id == task.tokenizer().eos_token_id
    batch = task.test_set().batch([0, 1, 2])
    assert batch["attention_mask"].sum(1).min() < batch["attention_mask"].shape[1]  # rows of different lengths
    m = task.evaluate(model, task.test_set(), 4)
    assert 0 <= m["accuracy"] <= 1 and math.isfinite(m["loss"])


def test_validation_file_is_the_validation_set(tmp_path, bert_dir):
    df = news_rows(90)
    files = {s: str(write(df.iloc[i * 30:(i + 1) * 30], tmp_path / f"{s}.csv")) for i, s in enumerate(("train", "test", "validation"))}
    task = text_task(bert_dir, files)
    assert len(task.validation_set()) == 30 and task.describe()["n_validation"] == 30
    assert text_task(bert_dir, files["train"]).validation_set() is None


# ============================================================================ heads and target modules
def test_head_created_seeded_kept_when_exported_and_replaced_on_request(tmp_path, bert_dir, caplog):
    path = write(news_rows(), tmp_path / "news.csv")
    task = text_task(bert_dir, path)
    with caplog.at_level("WARNING"):
        a, b = task.build_model(), task.build_model()
    assert sum("gets a new head" in r.message for r in caplog.records) == 1  # said once
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = text_task(bert_dir, path, seed=1).build_model()
    assert not torch.equal(a.classifier.weight, other.classifier.weight)
    a.classifier.weight.data.add_(1.0)
    a.save_pretrained(tmp_path / "exported")
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        if (bert_dir / f).is_file():
            (tmp_path / "exported" / f).write_bytes((bert_dir / f).read_bytes())
    kept = text_task(tmp_path / "exported", path).build_model()
    assert torch.equal(kept.classifier.weight, a.classifier.weight)
    fresh = text_task(tmp_path / "exported", path, new_head=True).build_model()
    assert torch.equal(fresh.classifier.weight, b.classifier.weight)


def test_target_modules_per_architecture(bert_dir, llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, ConvNextConfig, GPT2Config, OPTConfig

    assert default_target_modules("bert") == ("query", "value", "dense")  # ours: the paper's choice for encoders
    assert default_target_modules("llama") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert default_target_modules("opt") == ("q_proj", "v_proj")  # PEFT's mapping
    assert default_target_modules("convnext") is None
    opt = skeleton(AutoModelForCausalLM, OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2))
    assert pick_target_modules(opt, "opt", None) == ("q_proj", "v_proj")
    assert pick_target_modules(opt, "opt", ["fc1"]) == ("fc1",)
    conv = skeleton(AutoModelForImageClassification, ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))
    with pytest.raises(TaskError, match=r"no default target modules for model_type='convnext'.*task\.options\.target_modules"):
        pick_target_modules(conv, "convnext", None)
    gpt2 = skeleton(AutoModelForCausalLM, GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(TaskError, match=r"Conv1D layers are not nn\.Linear.*task\.options\.target_modules"):
        pick_target_modules(gpt2, "gpt2", None)
    with pytest.raises(TaskError, match=r"match no nn\.Linear layer.*task\.options\.target_modules"):
        pick_target_modules(opt, "opt", ["nope"])
    assert AutoConfig.from_pretrained(llama_dir).model_type == "llama"


# ============================================================================ partition values
def test_partition_values_are_the_training_rows_column(tmp_path, bert_dir):
    df = news_rows()
    task = text_task(bert_dir, write(df, tmp_path / "news.csv"))
    sites = task.partition_values("site")
    by_text = dict(zip(df["body"] + "|" + df["topic"], df["site"]))
    ex = task._examples("train")
    assert list(sites) == [by_text[f"{t}|{TOPICS[y]}"] for t, y in zip(ex.text, ex.labels)]
    assert np.array_equal(task.partition_values(None), task.partition_labels())
    with pytest.raises(TaskError, match=r"news\.csv has no column 'region' to partition by; its columns: body, topic, site"):
        task.partition_values("region")


# ============================================================================ 2b. causal LM


def test_causal_lm_loss_masks_the_prompt_exactly(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    path = write(pd.DataFrame(QA), tmp_path / "qa.jsonl")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    for chat in (False, True):
        task = causal_task(llama_dir, path, chat_template=chat)
        ds = task.train_set()
        q, r = task._rows["train"].data["question"][0], task._rows["train"].data["solution"][0]
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) if chat else q
        assert ds.prompts[0] == prompt and ds.responses[0] == r
        p_ids = tok(prompt)["input_ids"]
        r_ids = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        item = ds[0]
        assert item["input_ids"].tolist() == p_ids + r_ids
        assert item["labels"].tolist() == [-100] * len(p_ids) + r_ids
    assert task.primary_metric == "loss" and not task.higher_is_better
    assert task.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = task.build_model()
    m = task.evaluate(model, task.test_set(), 4)
    assert set(m) == {"loss", "perplexity"} and m["perplexity"] == pytest.approx(math.exp(m["loss"]))
    assert m["loss"] == pytest.approx(task.mean_loss(model, task.test_set(), 100), rel=1e-6)  # token mean, any batching


def test_causal_lm_messages_template_and_categories(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    chats = [{"conv": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["question"]},
                       {"role": "assistant", "content": r["solution"]}], "kind": r["kind"]} for r in QA]
    task = causal_task(llama_dir, write(pd.DataFrame(chats), tmp_path / "chats.json"), prompt_column=None, response_column=None,
                       messages_column="conv", category_column="kind")
    conv = task._rows["train"].data["conv"][0]
    assert task.train_set().prompts[0] == tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    assert task.train_set().responses[0] == conv[-1]["content"]
    assert task.label_names() == ["add", "sum"]
    assert [task.label_names()[c] for c in task.partition_labels()] == list(task._rows["train"].data["kind"])
    assert sorted(np.bincount(task.partition_labels())) == [6, 6]  # test split stratified by kind: 2 of 8 each
    templ = causal_task(llama_dir, write(pd.DataFrame(QA), tmp_path / "qa.csv"), prompt_column=None,
                        template="Q ({kind}): {question}\nA: ", chat_template=False)
    row = templ._rows["train"].data[0]
    assert templ.train_set().prompts[0] == f"Q ({row['kind']}): {row['question']}\nA: "


def test_causal_lm_answer_pattern_exact_match(tmp_path, llama_dir, monkeypatch):
    path = write(pd.DataFrame(QA), tmp_path / "qa.parquet")
    task = causal_task(llama_dir, path, answer_pattern=r"answer is\s*(-?[\d,.]+)")
    test = task.test_set()
    gold = [extract for extract in test.answers]
    assert gold == [str(int(s.rsplit(" ", 1)[1])) for s in test.responses] and task.primary_metric == "exact_match"
    outs = [f"so the answer is {gold[0]}", f"the answer is {float(gold[1]):.1f}", "no idea"] + ["x"] * (len(test) - 3)
    monkeypatch.setattr(task, "generate", lambda model, prompts, max_new_tokens=None: [outs.pop(0) for _ in prompts])
    m = task.evaluate(task.build_model(), test, 2)
    assert m["exact_match"] == pytest.approx(2 / len(test)) and "loss" in m and "perplexity" in m


# ============================================================================ 2c. images


def test_image_folder_and_image_column(tmp_path, vit_dir):
    root = _images(tmp_path / "pets")
    task = get_task("image_classification", model=str(vit_dir), data=str(root), test_fraction=0.5, new_head=True)
    assert task.label_names() == ["cat", "dog", "owl"] and len(task.train_set()) == 9 and len(task.test_set()) == 9
    batch = task.train_set().batch([0, 1])
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    from PIL import Image

    ref = task.image_processor(images=[Image.open(task.train_set().images[0]).convert("RGB")], return_tensors="pt")["pixel_values"]
    assert torch.allclose(batch["pixel_values"][0], ref[0])
    model = task.build_model()
    assert model.config.id2label == {0: "cat", 1: "dog", 2: "owl"} and task.target_modules[:3] == ("query", "value", "dense")
    assert set(task.evaluate(model, task.test_set(), 4)) == {"accuracy", "macro_f1", "loss"}
    # the same images as a CSV of relative paths, and as a datasets Image column saved to disk
    rows = [{"file": f"pets/{c}/{c}{i}.png", "animal": c} for c in ("cat", "dog", "owl") for i in range(6)]
    csv = write(pd.DataFrame(rows), tmp_path / "pets.csv")
    by_csv = get_task("image_classification", model=str(vit_dir), data=str(csv), image_column="file", label_column="animal",
                      test_fraction=0.5, new_head=True)
    assert [Path(p).name for p in by_csv.train_set().images] == [Path(p).name for p in task.train_set().images]
    import datasets

    ds = datasets.Dataset.from_dict({"img": [str(tmp_path / r["file"]) for r in rows], "animal": [r["animal"] for r in rows]})
    ds.cast_column("img", datasets.Image()).save_to_disk(str(tmp_path / "pets_ds"))
    by_ds = get_task("image_classification", model=str(vit_dir), data=str(tmp_path / "pets_ds"), image_column="img",
                     label_column="animal", test_fraction=0.5, new_head=True)
    assert torch.allclose(by_ds.train_set().batch([0, 4])["pixel_values"], task.train_set().batch([0, 4])["pixel_values"])
    # train/ and test/ folders
    split = tmp_path / "split"
    _images(split / "train", per_class=4), _images(split / "test", per_class=2)
    t = get_task("image_classification", model=str(vit_dir), data=str(split), new_head=True)
    assert len(t.train_set()) == 12 and len(t.test_set()) == 6 and t.describe()["data"] == {"train": "split/train", "test": "split/test"}


def test_a_broken_image_is_one_line_before_training(tmp_path, vit_dir):
    root = _images(tmp_path / "pets")
    (root / "dog" / "broken.png").write_bytes(b"not an image at all")
    with pytest.raises(TaskError) as err:
        get_task("image_classification", model=str(vit_dir), data=str(root), test_fraction=0.5, new_head=True)
    msg = _one_line(err)
    assert "broken.png" in msg and "cannot be read (UnidentifiedImageError" in msg and "replace or remove it" in msg
    # a truncated PNG (its header intact) is caught too: verify checks the chunks
    good = (root / "cat" / "cat0.png").read_bytes()
    (root / "dog" / "broken.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(TaskError, match="broken.png.*cannot be read"):
        get_task("image_classification", model=str(vit_dir), data=str(root), test_fraction=0.5, new_head=True)
    # the check can be skipped (the run then finds it when a client opens it)
    task = get_task("image_classification", model=str(vit_dir), data=str(root), test_fraction=0.5, new_head=True,
                    verify_images=False)
    assert len(task.train_set()) + len(task.test_set()) == 19


# ============================================================================ 7. bad input: one line each
def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    df = news_rows()
    write(df, d / "news.csv")
    (d / "news.xlsx").write_text("x")
    empty = df.copy()
    empty.loc[5, "body"] = ""
    write(empty, d / "empty_text.csv")
    nan = df.astype({"body": object})
    nan.loc[7, "body"] = None
    write(nan, d / "nan_text.jsonl")
    nolabel = df.copy()
    nolabel.loc[[3, 9], "topic"] = None
    write(nolabel, d / "no_label.csv")
    nanlabel = df.assign(topic=np.where(np.arange(60) == 11, np.nan, np.arange(60) % 3))
    write(nanlabel, d / "nan_label.parquet")
    write(df.iloc[:40], d / "train.csv")
    write(df.iloc[40:].assign(topic=["weather"] + list(df.iloc[41:]["topic"])), d / "test.csv")
    lines = (d / "nan_text.jsonl").read_text().splitlines()
    lines[4] = lines[4][:-3]  # a record cut short
    (d / "broken.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.mark.parametrize("data, kw, expected", [
    ("missing.csv", {}, r"task\.options\.data: no file or folder 'missing\.csv'"),
    ("news.xlsx", {}, r"'news\.xlsx' has an unsupported extension '\.xlsx'; use one of \.csv, \.tsv, \.json, \.jsonl, \.parquet"),
    ("news.csv", {"text_column": "text"}, r"news\.csv has no column 'text' \(task\.options\.text_column\); its columns: body, topic, site"),
    ("news.csv", {"label_column": "label"}, r"news\.csv has no column 'label' \(task\.options\.label_column\); its columns: body, topic, site"),
    ("empty_text.csv", {}, r"empty_text\.csv: a row has an empty or NaN text in column 'body' \(first: row 6\); fill or drop"),
    ("nan_text.jsonl", {}, r"nan_text\.jsonl: a row has an empty or NaN text in column 'body' \(first: row 8\)"),
    ("no_label.csv", {}, r"no_label\.csv: 2 rows have an empty or NaN label in column 'topic' \(first: row 4\)"),
    ("nan_label.parquet", {}, r"nan_label\.parquet: a row has an empty or NaN label in column 'topic' \(first: row 12\)"),
    ({"train": "train.csv", "test": "test.csv"}, {},
     r"label 'weather' of test\.csv \(row 1, column 'topic'\) never occurs in the training data \(train\.csv: politics, sport, tech\)"),
    ({"train": "train.csv", "tst": "test.csv"}, {}, r"a mapping has the keys train \(required\), test, validation; got train, tst"),
    ("news.csv", {"test_fraction": 1.5}, r"task\.options\.test_fraction=1\.5 must be in \(0, 1\)"),
    ("someorg/nodata", {}, r"data='someorg/nodata' is no local file or folder, and loading it from the Hugging Face hub failed"),
    ("broken.jsonl", {}, r"^could not read broken\.jsonl: line 5 is not a JSON record \(.* at column \d+\); fix or drop that line"),
])
def test_bad_data_is_one_line(bad_dir, bert_dir, data, kw, expected, monkeypatch):
    monkeypatch.chdir(bad_dir)
    with pytest.raises(TaskError) as exc:
        text_task(bert_dir, data, **kw)
    assert re.search(expected, _one_line(exc)), str(exc.value)


def test_bad_model_and_options_are_one_line(tmp_path, bert_dir, vit_dir, llama_dir):
    path = write(news_rows(), tmp_path / "news.csv")
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((bert_dir / "config.json").read_text())
    with pytest.raises(TaskError) as exc:
        text_task(no_tok, path)
    assert re.search(r"model folder '.*no_tokenizer' has no tokenizer .*tokenizer\.save_pretrained", _one_line(exc))
    with pytest.raises(TaskError) as exc:
        text_task(tmp_path / "nowhere", path)
    assert "task.options.model=" in _one_line(exc) and "no such folder" in str(exc.value)
    with pytest.raises(TaskError) as exc:
        get_task("text_classification", model=str(bert_dir), data=str(path), max_lenght=64)
    assert re.search(r"task 'text_classification' has no option 'max_lenght'; its options are: model, data, .*max_length",
                     _one_line(exc))
    with pytest.raises(TaskError) as exc:  # 5-way head of the checkpoint, 3 classes in the data
        get_task("image_classification", model=str(vit_dir), data=str(_images(tmp_path / "pets")), test_fraction=0.5).build_model()
    assert re.search(r"has a classification head of another size than the 3 labels .*task\.options\.new_head: true", _one_line(exc))
    five = _images(tmp_path / "five", per_class=2)  # a head of the right size, for other labels
    for c in ("eel", "fox"):
        (five / c).mkdir()
        for f in (five / "cat").iterdir():
            (five / c / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TaskError) as exc:
        get_task("image_classification", model=str(vit_dir), data=str(five), test_fraction=0.5).build_model()
    assert re.search(r"has a head for labels \['LABEL_0', .*task\.options\.new_head: true", _one_line(exc))
    kept = get_task("image_classification", model=str(vit_dir), data=str(five), test_fraction=0.5, new_head=False).build_model()
    assert kept.config.id2label[4] == "owl"
    with pytest.raises(TaskError) as exc:
        causal_task(llama_dir, path, messages_column="body")
    assert "leave out prompt_column, response_column" in _one_line(exc)
    with pytest.raises(TaskError) as exc:
        causal_task(llama_dir, path, prompt_column=None)
    line = _one_line(exc)
    assert "task 'causal_lm': task.options needs prompt_column + response_column, or template + response_column, or messages_column" in line
    assert line.count("causal_lm") == 1
    with pytest.raises(TaskError) as exc:
        causal_task(llama_dir, write(pd.DataFrame(QA), tmp_path / "qa.csv"), answer_pattern=r"#### (\d+)")
    assert re.search(r"qa\.csv \(held out\) row \d+: task\.options\.answer_pattern='#### \(\\\\d\+\)' finds no answer", _one_line(exc))


def test_task_options_are_typed_and_listed():
    opts = parse_task_options("text_classification", {"data": {"train": "a.csv", "test": "b.csv"}, "text_columns": ["q", "a"]})
    assert opts.data == {"train": "a.csv", "test": "b.csv"} and opts.text_columns == ("q", "a")
    assert parse_task_options("causal_lm", {"data": "x.jsonl", "messages_column": "m"}).max_length == 512
    with pytest.raises(TaskError, match=r"task 'causal_lm': task\.options\.max_length must be an integer"):
        parse_task_options("causal_lm", {"data": "x.jsonl", "messages_column": "m", "max_length": "long"})
    # data may be left out only by a nodes deployment's server (which then names its labels): the options parse,
    # the task refuses (tests/flower/test_flower_nodes.py; tests/tasks/test_generic_tasks.py::test_a_task_without_data_is_one_line)
    assert parse_task_options("image_classification", {}).data is None


def test_a_task_without_data_is_one_line(bert_dir):
    with pytest.raises(TaskError, match=r"^task\.options\.data is required: a file, a folder, or \{train: FILE, test: FILE\}; "):
        get_task("text_classification", model=str(bert_dir))


# ============================================================================ end to end
def test_fedgalore_run_on_a_csv_with_a_local_model(tmp_path, bert_dir, capsys):
    from fedgalore.cli import main

    write(news_rows(96), tmp_path / "news.csv")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""\
task:
  name: text_classification
  options: {{model: {bert_dir}, data: {tmp_path / 'news.csv'}, text_column: body, label_column: topic, max_length: 16}}
method: {{name: fedgalore, rank: 4}}
federation: {{num_clients: 4, clients_per_round: 2, rounds: 2, partition: {{kind: dirichlet, alpha: 0.5, min_size: 2}}}}
train: {{lr: 1.0e-3, batch_size: 8, local_steps: 2}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    assert main(["run", "--config", str(cfg)]) == 0, capsys.readouterr().err
    run = next((tmp_path / "runs").iterdir())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2] and all(0 <= m["eval/accuracy"] <= 1 and m["train_loss"] > 0 for m in metrics)
    task_json = json.loads((run / "task.json").read_text())
    assert task_json["labels"] == TOPICS and task_json["data"] == {"test": "news.csv (held out)", "train": "news.csv"}
    assert json.loads((run / "environment.json").read_text())["target_modules"][0].endswith("attention.self.query")
    capsys.readouterr()
    assert main(["run", "--config", str(cfg), "task.options.text_column=text"]) == 2  # bad input: one line, exit 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["fedgalore: error: news.csv has no column 'text' (task.options.text_column); its columns: body, topic, site"]


# ============================================================================ docs/data.md
DOCS = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def _blocks(lang: str) -> list[str]:
    """The ``lang`` code blocks of docs/data.md's task sections (the Partitions section is tested by
    tests/job/test_client_partitions.py, the formats and files sections by tests/tasks/test_data_formats.py)."""
    text = DOCS.read_text()
    text = text[:text.index("## Partitions")] + text[text.index("## From Python"):]
    for title in ("## Instruction formats", "## Files as people have them"):  # tests/tasks/test_data_formats.py runs these
        start = text.index(title)
        text = text[:start] + text[text.index("\n## ", start + 1):]
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S) if m.group(1) == lang]


def test_docs_yaml_examples_are_valid_and_short(tmp_path):
    from fedgalore.job.config import load_config

    yamls = _blocks("yaml")
    assert [re.search(r"name: (\w+)\n  options", y).group(1) for y in yamls] == ["text_classification", "causal_lm",
                                                                                  "image_classification", "text_classification"]
    for i, y in enumerate(yamls):
        assert len(y.strip().splitlines()) <= 15, y
        (tmp_path / f"{i}.yaml").write_text(y)
        cfg = load_config(tmp_path / f"{i}.yaml")
        assert cfg.federation.partition.kind == ("files" if i == 3 else "dirichlet")  # the per-site example last
        parse_task_options(cfg.task.name, cfg.task.options)
    assert "## Partitions" in DOCS.read_text() and "### `natural`" in DOCS.read_text()


@pytest.mark.assets
def test_docs_examples_run_as_written(tmp_path, monkeypatch, bert_dir, llama_dir, vit_dir, capsys):
    """docs/data.md's three examples: its Python writes the data (offline BBC News, Fashion-MNIST),
    its YAML runs with `fedgalore run` — on the tiny checkpoints here and a tiny budget."""
    from fedgalore.cli import main
    from fedgalore.tasks.assets import AssetError, bbc_news_dir, cache_dir
    from fedgalore.tasks.mnist import load_fashion_mnist

    if (_REAL_CACHE / "debian").is_dir():  # Fashion-MNIST from the real cache; everything else in the test's
        (cache_dir() / "debian").symlink_to(_REAL_CACHE / "debian")
    try:
        bbc_news_dir(), load_fashion_mnist("test")
    except AssetError as exc:
        pytest.skip(f"offline assets not installed: {exc}")
    monkeypatch.chdir(tmp_path)
    for code in _blocks("python")[:4]:  # the three tasks' data, then the per-site files split from news.csv
        exec(compile(code, "docs/data.md", "exec"), {})
    assert len(pd.read_csv("news.csv")) == 2225 and len(list(Path("clothes").rglob("*.png"))) == 600
    tiny = ["federation.rounds=1", "federation.num_clients=2", "federation.clients_per_round=2", "train.local_steps=1",
            "federation.partition.min_size=1", "method.rank=4", "output.progress=quiet", "task.options.limit=24"]
    models = {"text_classification": [f"task.options.model={bert_dir}", "task.options.max_length=16"],
              "causal_lm": [f"task.options.model={llama_dir}", "task.options.max_new_tokens=2", "task.options.max_length=48"],
              "image_classification": [f"task.options.model={vit_dir}"]}
    for y in _blocks("yaml"):
        Path("run.yaml").write_text(y)
        task = re.search(r"name: (\w+)\n  options", y).group(1)
        sites = "sites:" in y  # one client per site: the count comes from the data
        args = [a for a in tiny if not (sites and a.startswith(("federation.num_clients", "federation.clients_per_round")))]
        assert main(["run", "--config", "run.yaml", *args, *models[task]]) == 0, capsys.readouterr().err
    runs = sorted(p.name for p in Path("runs").iterdir())
    assert runs == ["arith-fedgalore-dirichlet0.5-s0", "clinics-fedgalore-files-s0", "clothes-fedgalore-dirichlet0.5-s0",
                    "news-fedgalore-dirichlet0.5-s0"]
    clinics = json.loads((Path("runs") / "clinics-fedgalore-files-s0" / "partition.json").read_text())
    assert clinics["client_names"] == ["clinic-a", "clinic-b", "clinic-c"]
    last = [json.loads(x) for x in (Path("runs") / "clinics-fedgalore-files-s0" / "metrics.jsonl").read_text().splitlines()][-1]
    assert set(last["client_eval"]["clients"]) == {"clinic-a", "clinic-b", "clinic-c"}
    assert all((Path("runs") / r / "metrics.jsonl").read_text().strip() for r in runs)
