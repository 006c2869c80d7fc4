"""Text classification tasks and offline asset plumbing (fedgalore.tasks.paper_text,
fedgalore.tasks.assets).

The GLUE path runs end to end on a tiny random RoBERTa with a byte-level BPE tokenizer trained
here (offline) and tiny GLUE-format files; the BBC / Amazon tests use the real offline assets and
are skipped, with the reason, when `make setup` has not installed them.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch

from fedgalore.tasks import assets
from fedgalore.tasks.assets import AssetError
from fedgalore.tasks import TaskError, get_task, resolve_target_modules
from fedgalore.tasks.base import stratified_split
from fedgalore.tasks.paper_text.base import TokenizedDataset
from fedgalore.tasks.paper_text.glue import GlueTask


POS = ["good", "great", "fine", "lovely", "superb", "happy"]
NEG = ["bad", "awful", "poor", "sad", "terrible", "boring"]
FILL = ["the", "movie", "was", "plot", "and", "actors", "really", "quite", "a", "story"]


def _sentence(rng: np.random.Generator, words: list[str], n: int) -> str:
    toks = list(rng.choice(FILL, n)) + list(rng.choice(words, 2))
    rng.shuffle(toks)
    return " ".join(toks)


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    """A tiny random RobertaForSequenceClassification (2 labels) + a BPE tokenizer, saved offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers, decoders
    from transformers import RobertaConfig, RobertaForSequenceClassification, RobertaTokenizerFast

    d = tmp_path_factory.mktemp("tiny-roberta")
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(POS + NEG + FILL)] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    fast = RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
                                unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(d)
    cfg = RobertaConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=72, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=2)
    torch_state = torch.random.get_rng_state()
    RobertaForSequenceClassification(cfg).save_pretrained(d)
    torch.random.set_rng_state(torch_state)  # leave the global RNG as we found it
    return str(d)


@pytest.fixture(scope="module")
def glue_dirs(tmp_path_factory):
    """Tiny GLUE-format folders: sst2 as csv (ids), stsb as jsonl/tsv (float scores)."""
    import pandas as pd

    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("glue")
    sst = root / "sst2"
    sst.mkdir()
    for split, n in (("train", 48), ("validation", 16)):
        labels = np.arange(n) % 2
        rows = [{"sentence": _sentence(rng, POS if y else NEG, 4), "label": int(y), "idx": i} for i, y in enumerate(labels)]
        pd.DataFrame(rows).to_csv(sst / f"{split}.csv", index=False)
    sts = root / "stsb"
    sts.mkdir()
    for split, n in (("train", 30), ("dev", 10)):
        scores = np.round(np.linspace(0, 5, n), 2)
        rows = [{"sentence1": _sentence(rng, POS, 3), "sentence2": _sentence(rng, NEG if s < 2.5 else POS, 3), "label": float(s)} for s in scores]
        if split == "train":
            with open(sts / "train.jsonl", "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            pd.DataFrame(rows).to_csv(sts / "dev.tsv", sep="\t", index=False)
    return root


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------- assets
def test_cache_dir_env_and_debian_root_error(tmp_cache):
    assert assets.cache_dir() == tmp_cache and tmp_cache.is_dir()
    assert issubclass(AssetError, TaskError)
    with pytest.raises(AssetError, match=r"python -m fedgalore.tasks.assets debian"):
        assets.debian_root("dataset-fashion-mnist")


def test_fetch_debian_is_idempotent_without_apt(tmp_cache, monkeypatch):
    (tmp_cache / "debian" / "some-pkg" / "usr" / "share").mkdir(parents=True)

    def boom(*a, **k):  # an unpacked package must not be fetched again
        raise AssertionError("apt-get called")

    monkeypatch.setattr(assets.subprocess, "run", boom)
    assert assets.fetch_debian(["some-pkg"]) == {"some-pkg": tmp_cache / "debian" / "some-pkg"}
    assert assets.debian_root("some-pkg") == tmp_cache / "debian" / "some-pkg"


def test_assets_main_never_fails(tmp_cache, monkeypatch, capsys):
    monkeypatch.setattr(assets.shutil, "which", lambda name: None)  # no apt-get: warn, exit 0
    assert assets.main(["debian", "dataset-fashion-mnist"]) == 0
    assert "WARNING: dataset-fashion-mnist unavailable" in capsys.readouterr().err
    assert assets.main([]) == 2


def test_read_r_lazyload_missing_db(tmp_path):
    pytest.importorskip("rdata")
    with pytest.raises(AssetError, match="not found"):
        assets.read_r_lazyload(tmp_path / "Rdata", "training_data")


# ---------------------------------------------------------------------------------- target modules
def test_resolve_target_modules_roberta_excludes_head(tiny_roberta):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_roberta)
    names = resolve_target_modules(model, ("query", "value", "dense"), ("classifier",))
    per_layer = ["attention.self.query", "attention.self.value", "attention.output.dense", "intermediate.dense", "output.dense"]
    assert names == [f"roberta.encoder.layer.{i}.{s}" for i in range(2) for s in per_layer]
    assert not any(n.startswith("classifier") for n in names)  # classifier.dense / out_proj are head
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {"classifier.dense", "classifier.out_proj"} <= linear


def test_resolve_target_modules_bert_includes_pooler():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3)
    model = BertForSequenceClassification(cfg)
    names = resolve_target_modules(model, ("query", "value", "dense"), ("classifier",))
    assert len(names) == 2 * 5 + 1
    assert names[-1] == "bert.pooler.dense"  # documented: the pooler is an adapted (pretrained) matrix
    assert "classifier" not in names and all(n.startswith("bert.") for n in names)


# ---------------------------------------------------------------------------------- GLUE path
def test_glue_sst2_end_to_end(tiny_roberta, glue_dirs, tmp_cache):
    task = get_task("glue", subtask="sst2", model=tiny_roberta, data_dir=str(glue_dirs / "sst2"), max_length=32, dropout=0.0)
    assert isinstance(task, GlueTask)
    assert (len(task.train_set()), len(task.test_set())) == (48, 16)
    assert task.primary_metric == "accuracy" and task.higher_is_better
    assert task.label_names() == ["negative", "positive"]
    np.testing.assert_array_equal(task.partition_labels(), np.arange(48) % 2)
    assert "token_type_ids" not in task.train_set().columns

    # batches are trimmed to their longest row, identically via batch() and collate()
    b1 = task.train_set().batch(range(8))
    b2 = task.collate([task.train_set()[i] for i in range(8)])
    assert b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)
    assert b1["input_ids"].shape[1] == int(b1["attention_mask"].sum(1).max()) < 32

    m1, m2 = task.build_model(), task.build_model()
    assert _same_weights(m1, m2) and not m1.training
    assert m1.config.num_labels == 2

    model = m1
    batch = task.train_set().batch(range(16))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = task.loss(model, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0], losses

    metrics = task.evaluate(model, task.test_set(), batch_size=5)
    assert set(metrics) == {"accuracy", "loss"}
    assert 0.0 <= metrics["accuracy"] <= 1.0 and np.isfinite(metrics["loss"])
    assert metrics["accuracy"] * 16 == pytest.approx(round(metrics["accuracy"] * 16))
    assert model.training  # evaluate restores the mode

    # the tokenised tensors were cached; a second construction reads them back identically
    files = list((tmp_cache / "text").glob("glue-*.safetensors"))
    assert len(files) == 1
    again = GlueTask("sst2", model=tiny_roberta, data_dir=str(glue_dirs / "sst2"), max_length=32)
    assert all(torch.equal(again.train_set().columns[k], v) for k, v in task.train_set().columns.items())


def test_glue_stsb_regression(tiny_roberta, glue_dirs, tmp_cache):
    task = GlueTask("sts-b", model=tiny_roberta, data_dir=str(glue_dirs / "stsb"), max_length=48, dropout=0.0)
    assert task.subtask == "stsb" and task.regression
    assert task.primary_metric == "mse" and task.higher_is_better is False
    assert len(task.train_set()) == 30 and len(task.test_set()) == 10  # dev.tsv is the validation split
    assert task.train_set().columns["labels"].dtype == torch.float32
    bins = task.partition_labels()
    scores = task.train_set().columns["labels"].numpy()
    np.testing.assert_array_equal(bins, np.digitize(scores, [1, 2, 3, 4]))
    assert set(bins.tolist()) == {0, 1, 2, 3, 4} and len(task.label_names()) == 5
    model = task.build_model()  # the checkpoint's 2-way head is replaced by a 1-output head
    assert model.classifier.out_proj.out_features == 1 and model.config.problem_type == "regression"
    assert _same_weights(model, task.build_model())
    batch = task.train_set().batch(range(10))
    with torch.no_grad():
        out = model(**batch)
        expected = torch.mean((out.logits[:, 0] - batch["labels"]) ** 2)
        loss = task.loss(model, batch)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)  # MSE loss
    metrics = task.evaluate(model, task.test_set(), batch_size=4)
    assert set(metrics) == {"mse", "pearson", "spearman", "loss"}
    assert metrics["mse"] == pytest.approx(metrics["loss"], rel=1e-5)


def test_glue_limit_and_primary_override(tiny_roberta, glue_dirs, tmp_cache):
    task = GlueTask("sst2", model=tiny_roberta, data_dir=str(glue_dirs / "sst2"), max_length=32, limit=10, cache=False)
    assert len(task.train_set()) == 10 and len(task.test_set()) == 10
    assert not (tmp_cache / "text").exists()
    with pytest.raises(TaskError, match="primary_metric"):
        GlueTask("sst2", model=tiny_roberta, data_dir=str(glue_dirs / "sst2"), primary_metric="mcc", cache=False)


def test_glue_errors(tiny_roberta, glue_dirs, tmp_path, tmp_cache, monkeypatch):
    with pytest.raises(TaskError, match="unknown GLUE subtask"):
        GlueTask("squad", model=tiny_roberta)
    with pytest.raises(TaskError, match="not a folder"):
        GlueTask("sst2", model=tiny_roberta, data_dir=str(tmp_path / "nope"))
    with pytest.raises(TaskError, match="no train file"):
        GlueTask("sst2", model=tiny_roberta, data_dir=str(tmp_path))
    with pytest.raises(TaskError, match="lacks column 'sentence1'"):
        GlueTask("mrpc", model=tiny_roberta, data_dir=str(glue_dirs / "sst2"))
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):  # the hub path without network (never touch the network in tests)
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(TaskError, match="data_dir"):
        GlueTask("sst2", model=tiny_roberta)
    with pytest.raises(TaskError, match="could not load"):
        GlueTask("sst2", model=str(tmp_path / "no-model"), data_dir=str(glue_dirs / "sst2"))


# ---------------------------------------------------------------------------------- offline assets
def _minilm_or_skip():
    try:
        return assets.minilm_path(), assets.bbc_news_dir()
    except AssetError as exc:
        pytest.skip(f"offline text assets not installed: {exc}")


@pytest.mark.assets
def test_glue_pairs_with_bert_and_minilm_tokenizer(glue_dirs, tmp_path, tmp_cache):
    """Sentence pairs through a BERT model (token_type_ids) with the MiniLM WordPiece tokenizer."""
    minilm, _ = _minilm_or_skip()
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    d = tmp_path / "tiny-bert"
    tok = AutoTokenizer.from_pretrained(str(minilm))
    tok.save_pretrained(d)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    state = torch.random.get_rng_state()
    BertForSequenceClassification(cfg).save_pretrained(d)
    torch.random.set_rng_state(state)
    mrpc = tmp_path / "mrpc"
    mrpc.mkdir()
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (glue_dirs / "stsb" / "train.jsonl").read_text().splitlines()]
        with open(mrpc / f"{split}.jsonl", "w") as fh:
            fh.writelines(json.dumps({**r, "label": int(r["label"] >= 2.5)}) + "\n" for r in rows)
    task = GlueTask("mrpc", model=str(d), data_dir=str(mrpc), max_length=40)
    cols = task.train_set().columns
    assert "token_type_ids" in cols and int(cols["token_type_ids"].max()) == 1  # second segment marked
    model = task.build_model()
    assert "bert.pooler.dense" in resolve_target_modules(model, task.target_modules, task.head_modules)
    metrics = task.evaluate(model, task.test_set(), batch_size=8)
    assert set(metrics) == {"accuracy", "f1", "loss"}


@pytest.mark.assets
def test_bbc_news_task(tmp_cache):
    _, data = _minilm_or_skip()
    names = sorted(p.name for p in data.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    assert len(names) == 5
    counts = [len(list((data / n).glob("*.txt"))) for n in names]
    assert sum(counts) == 2225

    # deterministic stratified split over the real label column
    labels = np.concatenate([np.full(c, i) for i, c in enumerate(counts)])
    tr, te = stratified_split(labels, 0.2, np.random.default_rng(0))
    tr2, te2 = stratified_split(labels, 0.2, np.random.default_rng(0))
    np.testing.assert_array_equal(tr, tr2)
    np.testing.assert_array_equal(te, te2)
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 2225
    np.testing.assert_array_equal(np.bincount(labels[te]), [round(0.2 * c) for c in counts])
    assert not np.array_equal(stratified_split(labels, 0.2, np.random.default_rng(1))[1], te)

    task = get_task("offline_text", limit=40)
    assert task.label_names() == names == ["business", "entertainment", "politics", "sports", "tech"]
    assert len(task.train_set()) == 40 and len(task.test_set()) == 40
    assert task.train_set().columns["input_ids"].shape == (40, 128)
    assert len(set(task.partition_labels().tolist())) >= 4  # a seeded subset keeps the topics mixed
    m1, m2 = task.build_model(), task.build_model()
    assert _same_weights(m1, m2)
    assert m1.config.num_labels == 5 and m1.classifier.weight.std().item() == pytest.approx(0.02, rel=0.25)
    metrics = task.evaluate(m1, task.test_set(), batch_size=20)
    assert set(metrics) == {"accuracy", "macro_f1", "loss"}
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 1.0 < metrics["loss"] < 2.5  # ≈ ln 5 for a fresh head
    # the same options hit the cache (no re-tokenisation) and give the same tensors
    again = get_task("offline_text", limit=40)
    assert torch.equal(again.train_set().columns["input_ids"], task.train_set().columns["input_ids"])
    assert len(list((tmp_cache / "text").glob("offline_text-*.safetensors"))) == 1


@pytest.mark.assets
def test_amazon_reviews_task():
    _minilm_or_skip()
    pytest.importorskip("rdata", reason="reading the R data needs `pip install rdata`")
    try:
        assets.debian_root("r-cran-modeldata")
    except AssetError as exc:
        pytest.skip(f"Amazon reviews not fetched: {exc}")
    from fedgalore.tasks.paper_text.amazon import load_amazon_reviews

    train_df, test_df = load_amazon_reviews()
    assert (len(train_df), len(test_df)) == (4000, 1000)
    assert sorted(set(map(str, train_df["score"]))) == ["great", "other"]
    task = get_task("offline_text_amazon", limit=24)
    assert task.label_names() == ["great", "other"] and task.positive_label == 0
    assert len(task.train_set()) == 24
    metrics = task.evaluate(task.build_model(), task.test_set(), batch_size=12)
    assert set(metrics) == {"accuracy", "macro_f1", "f1", "loss"}


# ---------------------------------------------------------------------------------- pipelines
def test_text_pipeline_configs_are_valid():
    from pathlib import Path

    from omegaconf import OmegaConf

    from fedgalore.job.config import FederatedConfig, load_config

    conf = Path(__file__).resolve().parents[2] / "conf" / "pipeline"
    for name, task in (("offline_text", "offline_text"), ("offline_text_amazon", "offline_text_amazon")):
        cfg = load_config(conf / f"{name}.yaml")
        assert cfg.task.name == task and cfg.method.name == "fedgalore" and cfg.method.rank == 8
        assert cfg.federation.num_clients == 20 and cfg.federation.clients_per_round == 5
        assert cfg.federation.partition.kind == "dirichlet" and cfg.federation.partition.alpha == 0.5
        assert cfg.method.options["update_proj_gap"] == 50 and cfg.method.options["sync"] == "ajive"

    raw = OmegaConf.to_container(OmegaConf.load(conf / "glue_roberta.yaml"))
    compare = raw.pop("compare")
    cfg = FederatedConfig.from_dict(raw)
    t, f = cfg.train, cfg.federation
    # paper Appendix H, Tables 8-9
    assert (t.lr, t.batch_size, t.warmup_ratio, t.weight_decay, t.schedule, t.local_epochs) == (5e-5, 32, 0.06, 0.01, "cosine", 2)
    assert (f.rounds, f.num_clients, f.clients_per_round, cfg.method.rank) == (50, 50, 5, 8)
    assert cfg.task.options == {"subtask": "sst2", "model": "roberta-base", "max_length": 128}
    # one options pool: LoRA alpha 2r (Table 9) for the baselines, FedAvg-Full on the whole model
    assert cfg.method.options["lora_alpha"] == 16 and cfg.method.options["trainable"] == "all"
    assert "method_options" not in compare
    assert GlueTask.target_modules == ("query", "value", "dense") and GlueTask.head_modules == ("classifier",)
