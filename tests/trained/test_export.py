"""``fedgalore export`` / ``evaluate`` (docs/export.md): every method's export, loaded back with plain
transformers / PEFT, gives the run's global model's logits (to 1e-5) and its test metric; the
rank-R extraction's errors are the SVD tail; the model card; rounds (--round, --best, a stopped
and a resumed run); every bad input is one line; the paper's three task families (glue,
domainnet, metamath) on tiny local stand-ins of their model classes.

The reference is the engine's own global model: the :class:`Federation` object's
``method.load_global(runtime.model, state)`` after the run — what the round loop evaluates —
never rebuilt through the export code."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fedgalore
from fedgalore.methods.base import method_class
from fedgalore.cli import main
from fedgalore.job.config import FederatedConfig
from fedgalore.engine.events import ProgressSink
from fedgalore.trained.evaluate import with_test_data
from fedgalore.trained.export import ExportError, export_run
from fedgalore.trained.global_model import choose_round
from fedgalore.trained.lora_extract import RANK_NOTES
from fedgalore_testing.models import Run, logits_of, same_metrics

METHODS = ["fedgalore", "fedgalore_minus", "fedgalore_mean", "fedavg_full", "fedit", "ffa_lora", "flora", "fr_lora", "lora_fair"]
#: the methods whose global model is W0 + their adapters (MethodTraits.explicit_adapters)
ADAPTER_METHODS = [m for m in METHODS if method_class(m).traits.explicit_adapters]
TINY = {"n_train": 64, "n_test": 24, "hidden_size": 16, "num_layers": 1, "seq_len": 8}


def tiny_cfg(out: Path, method: str, rounds: int = 2, **over) -> FederatedConfig:
    d = {
        "name": "exp", "seed": 0,
        "task": {"name": "tiny_text", "options": dict(TINY)},
        "method": {"name": method, "rank": 2, "options": over.pop("options", {})},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": rounds, "validation_fraction": 0.25,
                       "partition": {"kind": "iid"}},
        "train": {"lr": 2e-2, "batch_size": 8, "local_steps": 2},
        "output": {"dir": str(out), "progress": "quiet", "keep_checkpoints": 3},
    }
    d.update(over)
    return FederatedConfig.from_dict(d)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("runs")
    out = {m: Run(tiny_cfg(root, m)) for m in METHODS}
    out["fedavg_full_all"] = Run(tiny_cfg(root, "fedavg_full", options={"trainable": "all"}, name="all"))
    return out


# ----------------------------------------------------------------------------- hf: every method
@pytest.mark.parametrize("method", METHODS)
def test_hf_export_loads_with_transformers_with_the_runs_logits_and_metric(runs, tmp_path, method):
    from transformers import AutoModelForSequenceClassification

    run = runs[method]
    res = export_run(run.dir, tmp_path / "hf")
    assert res.round == 2 and res.check is not None and res.check < 1e-5
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / "adapter_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "BertForSequenceClassification"
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    assert model.config.id2label == {0: "0", 1: "1", 2: "2", 3: "3"} and model.config.label2id["3"] == 3
    same_metrics(run.task.evaluate(model, run.task.test_set(), 64), run.summary["final"])


# ----------------------------------------------------------------------------- peft: explicit adapters
@pytest.mark.parametrize("method", ADAPTER_METHODS)
def test_peft_export_of_adapter_methods_loads_on_the_pretrained_model(runs, tmp_path, method):
    from peft import PeftModel

    run = runs[method]
    res = export_run(run.dir, tmp_path / "ad", format="peft")
    files = {p.name for p in (tmp_path / "ad").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files
    assert "model.safetensors" not in files  # no full model
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k or ".classifier." in k for k in tensors), sorted(tensors)
    assert sum(t.numel() for t in tensors.values()) < sum(p.numel() for p in run.task.build_model().parameters()) / 4
    conf = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert conf["r"] == 2 and conf["lora_alpha"] == 4.0 and "classifier" in conf["modules_to_save"]
    model = PeftModel.from_pretrained(run.task.build_model(), tmp_path / "ad")
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    assert res.check < 1e-5 and res.dense == ["classifier.bias", "classifier.weight"]


# ----------------------------------------------------------------------------- peft --rank: any method
def _adapter_delta(folder: Path, module: str) -> torch.Tensor:
    conf = json.loads((folder / "adapter_config.json").read_text())
    t = load_file(folder / "adapter_model.safetensors")
    b, a = t[f"base_model.model.{module}.lora_B.weight"], t[f"base_model.model.{module}.lora_A.weight"]
    return conf["lora_alpha"] / conf["r"] * (b @ a)


@pytest.mark.parametrize("method", ["fedgalore", "fedavg_full_all"])
def test_rank_extraction_errors_are_the_svd_tail_and_full_rank_is_exact(runs, tmp_path, capsys, method):
    from peft import PeftModel

    run = runs[method]
    assert main(["export", str(run.dir), "--out", str(tmp_path / "r1"), "--format", "peft", "--rank", "1"]) == 0
    printed = capsys.readouterr().out
    info = json.loads((tmp_path / "r1" / "fedgalore_export.json").read_text())
    w0 = dict(run.task.build_model().named_parameters())
    now = dict(run.model.named_parameters())
    tails, norms = [], []
    for m in info["matrices"]:
        name = m["name"]
        delta = (now[name + ".weight"] - w0[name + ".weight"]).detach().double()
        s = torch.linalg.svdvals(delta)
        tails.append(float(s[1:].pow(2).sum()))
        norms.append(float(s.pow(2).sum()))
        want = math.sqrt(tails[-1] / norms[-1])
        assert m["relative_error"] == pytest.approx(want, rel=1e-4, abs=1e-6), name
        got = float((delta - _adapter_delta(tmp_path / "r1", name).double()).norm() / delta.norm())
        assert got == pytest.approx(want, rel=1e-3, abs=1e-5), name  # what the saved adapter really loses
        assert f"relative error {m['relative_error']:.4g}" in printed
    total = math.sqrt(sum(tails) / sum(norms))
    assert info["total_relative_error"] == pytest.approx(total, rel=1e-4)
    assert f"total relative Frobenius error {info['total_relative_error']:.4g} over {len(tails)} matrices; " \
           f"{RANK_NOTES[run.cfg.method.name]}" in printed
    # the smallest adapted matrix is 16 wide: rank 16 keeps every change exactly
    res = export_run(run.dir, tmp_path / "r16", format="peft", rank=16)
    assert res.total_error < 1e-6
    model = PeftModel.from_pretrained(run.task.build_model(), tmp_path / "r16")
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-4, rtol=0)
    if method == "fedavg_full_all":  # embeddings, norms, the other matrices and biases trained too: carried whole
        assert "bert.embeddings.word_embeddings.weight" in res.dense and "bert.pooler.dense.bias" in res.dense
        assert json.loads((tmp_path / "r16" / "adapter_config.json").read_text())["bias"] == "lora_only"


# ----------------------------------------------------------------------------- the model card, evaluate
def test_model_card_and_evaluate(runs, tmp_path, capsys):
    run = runs["fedit"]
    out = tmp_path / "card"
    export_run(run.dir, out)
    card = (out / "README.md").read_text()
    rec = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()][-1]
    for text in ("library_name: transformers", "# exp: fedit on tiny_text, round 2", "| method | fedit (rank 2",
                 "| partition | iid over 3 clients, 2 per round", "0.25 of the training pool held out",
                 "| rounds | 2 exported; 2 completed of 2 configured |",
                 f"up {rec['cum_bytes_up']:,} B, down {rec['cum_bytes_down']:,} B",
                 f"| test | {rec['eval/accuracy']:.4f} |", f"| validation | {rec['eval/val_accuracy']:.4f} |",
                 "BertForSequenceClassification.from_pretrained", f"fedgalore run --config {out.resolve()}/fedgalore_config.yaml output.dir=reproduced",
                 "The task's own data", "differ from the run's global model by at most"):
        assert text in card, text
    assert (out / "fedgalore_config.yaml").read_text() == (run.dir / "config.yaml").read_text()
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    for path in (run.dir, out):
        assert main(["evaluate", str(path), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["task"] == "tiny_text" and got["examples"] == 24
        same_metrics(got["metrics"], run.summary["final"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text((run.dir / "config.yaml").read_text())
    assert main(["evaluate", str(out), "--config", str(cfg), "task.options.n_test=8"]) == 0
    assert "(8 test examples)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- rounds
def test_round_and_best(runs, tmp_path):
    run = runs["flora"]
    recs = {r["round"]: r for r in map(json.loads, (run.dir / "metrics.jsonl").read_text().splitlines())}
    res = export_run(run.dir, tmp_path / "r1", round=1)
    assert res.round == 1 and "round 1" in (tmp_path / "r1" / "README.md").read_text()
    ev = fedgalore.evaluate(tmp_path / "r1")
    same_metrics(ev.metrics, {k[5:]: v for k, v in recs[1].items() if k.startswith("eval/") and "val_" not in k})
    vals = [recs[r]["eval/val_accuracy"] for r in (1, 2)]
    assert export_run(run.dir, tmp_path / "best", best=True).round == 1 + int(vals[1] > vals[0])


def _fake_run(root: Path, kept: list[int], vals: list[float] | None, higher: bool = True) -> Path:
    (root / "checkpoints").mkdir(parents=True)
    (root / "config.yaml").write_text("name: x\n")
    for r in kept:
        (root / "checkpoints" / f"round_{r:04d}").mkdir()
        (root / "checkpoints" / f"round_{r:04d}" / "state.json").write_text("{}")
    (root / "summary.json").write_text(json.dumps({"primary_metric": "mse", "higher_is_better": higher}))
    recs = [{"round": i + 1, **({"eval/val_mse": v} if vals else {}), "eval/mse": 0.0} for i, v in enumerate(vals or [0, 0, 0])]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


def test_choose_round_rules(tmp_path):
    run = _fake_run(tmp_path / "a", [2, 3], [0.5, 0.2, 0.3], higher=False)
    assert choose_round(run) == 3 and choose_round(run, 2) == 2
    assert choose_round(run, best=True) == 2  # lowest validation mse
    with pytest.raises(ExportError, match=r"keeps no checkpoint of round 1; kept rounds: 2, 3"):
        choose_round(run, 1)
    run = _fake_run(tmp_path / "b", [3], [0.5, 0.9, 0.3])
    with pytest.raises(ExportError, match=r"best validation round .* is 2 \(val_mse=0.9000\) but its checkpoint was not kept \(kept rounds: 3\)"):
        choose_round(run, best=True)
    with pytest.raises(ExportError, match="no validation split"):
        choose_round(_fake_run(tmp_path / "c", [3], None), best=True)
    with pytest.raises(ExportError, match="no checkpoint yet"):
        choose_round(_fake_run(tmp_path / "d", [], None))


class _KillAfter(ProgressSink):
    def round_end(self, round, record):  # noqa: A002
        if round == 1:
            raise KeyboardInterrupt("simulated kill")


def test_stopped_and_resumed_runs(tmp_path):
    cfg = tiny_cfg(tmp_path / "a", "lora_fair", rounds=3)
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(cfg, progress=_KillAfter())
    stopped = next((tmp_path / "a").iterdir())
    assert json.loads((stopped / "summary.json").read_text())["status"] != "finished"
    res = export_run(stopped, tmp_path / "stopped")
    first = json.loads((stopped / "metrics.jsonl").read_text().splitlines()[res.round - 1])
    same_metrics(fedgalore.evaluate(tmp_path / "stopped").metrics,
                 {k[5:]: v for k, v in first.items() if k.startswith("eval/") and "val_" not in k})
    fedgalore.resume(stopped)
    export_run(stopped, tmp_path / "resumed", format="peft")
    full = Run(tiny_cfg(tmp_path / "b", "lora_fair", rounds=3))
    from peft import PeftModel

    model = PeftModel.from_pretrained(full.task.build_model(), tmp_path / "resumed")
    torch.testing.assert_close(logits_of(model, full.batch), full.logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- bad input: one line, nothing lost
def _error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedgalore: error: "), err
    return lines[0]


def test_bad_inputs_are_one_line(runs, tmp_path, capsys):
    run, out = str(runs["fedgalore"].dir), str(tmp_path / "x")
    assert "is not a run directory (no config.yaml)" in _error(capsys, ["export", str(tmp_path), "--out", out])
    assert "does not exist" in _error(capsys, ["export", str(tmp_path / "nope"), "--out", out])
    assert "keeps no checkpoint of round 7; kept rounds: 1, 2" in _error(capsys, ["export", run, "--out", out, "--round", "7"])
    line = _error(capsys, ["export", run, "--out", out, "--format", "peft"])
    assert "method 'fedgalore' changes the weights themselves" in line and "--rank R" in line
    assert "--rank 99 exceeds what the adapted matrix" in _error(capsys, ["export", run, "--out", out, "--format", "peft", "--rank", "99"])
    assert "use --rank <= 16" in _error(capsys, ["export", run, "--out", out, "--format", "peft", "--rank", "17"])
    assert "use it with --format peft" in _error(capsys, ["export", run, "--out", out, "--rank", "2"])
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))  # nothing written
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert "exists and is not empty" in _error(capsys, ["export", run, "--out", out])
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    assert "holds the run directory itself" in _error(capsys, ["export", run, "--out", str(Path(run).parent), "--force"])
    assert main(["export", run, "--out", out, "--force"]) == 0 and not (tmp_path / "x" / "keep.txt").exists()
    assert "reads no data files" in _error(capsys, ["evaluate", out, "--data", str(tmp_path / "new.csv")])
    assert "neither a run directory nor a model folder" in _error(capsys, ["evaluate", str(tmp_path), "--config", str(Path(run) / "config.yaml")])
    assert "carries no fedgalore_config.yaml" in _error(capsys, ["evaluate", str(tmp_path)])


def test_test_data_override_uses_the_tasks_data_option(monkeypatch, runs):
    """``--data`` rewrites task option ``data`` (for the file-based tasks; their options class here a stand-in)."""
    from dataclasses import dataclass

    from fedgalore.trained import evaluate as ev
    from fedgalore.tasks.base import TaskOptions, task_option

    @dataclass(frozen=True)
    class FileOptions(TaskOptions):
        data: object = task_option(None, "files")
        test_fraction: float = task_option(0.2, "held out")

    monkeypatch.setattr(ev, "task_class", lambda name: type("FileTask", (), {"options_class": FileOptions}))
    cfg = runs["fedit"].cfg
    cfg = FederatedConfig.from_dict({**cfg.to_dict(), "task": {"name": "tiny_text", "options": {"data": "a.csv", "test_fraction": 0.3}}})
    assert with_test_data(cfg, "new.csv").task.options == {"data": {"train": "a.csv", "test": "new.csv"}}
    cfg.task.options = {"data": {"train": "a.csv", "validation": "v.csv", "test": "t.csv"}}
    assert with_test_data(cfg, "new.csv").task.options["data"] == {"train": "a.csv", "validation": "v.csv", "test": "new.csv"}


# ----------------------------------------------------------------------------- the paper's task families
def _tokenizer_dir(path: Path, words: list[str]):
    from transformers import BertTokenizerFast

    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(vocab))
    tok.save_pretrained(path)
    return tok


def test_glue_roberta_family(tmp_path):
    """The paper's NLU path (``glue``: RoBERTa, a two-layer ``classifier`` head) on local files."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, RobertaConfig, RobertaForSequenceClassification

    words = ["good", "bad", "film", "great", "awful", "plot", "fine", "dull"]
    model_dir = tmp_path / "roberta"
    model_dir.mkdir()
    tok = _tokenizer_dir(model_dir, words)
    torch.manual_seed(0)
    RobertaForSequenceClassification(RobertaConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, pad_token_id=0, type_vocab_size=1, num_labels=2)).save_pretrained(model_dir)
    data = tmp_path / "sst2"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("validation", 16)):
        rows = [(" ".join(rng.choice(words, 5)), int(rng.integers(2))) for _ in range(n)]
        (data / f"{split}.csv").write_text("sentence,label\n" + "".join(f"{s},{y}\n" for s, y in rows))
    cfg = tiny_cfg(tmp_path / "runs", "fedit", rounds=1, task={"name": "glue", "options": {
        "subtask": "sst2", "model": str(model_dir), "data_dir": str(data), "max_length": 16, "cache": False}})
    run = Run(cfg)
    export_run(run.dir, tmp_path / "hf")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "RobertaForSequenceClassification" and model.config.id2label[1] == "positive"
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    same_metrics(run.task.evaluate(model, run.task.test_set(), 64), run.summary["final"])
    saved = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert saved("good film")["input_ids"] == tok("good film")["input_ids"]
    card = (tmp_path / "hf" / "README.md").read_text()
    identity = json.loads((run.dir / "identity.json").read_text())["inputs"]  # the card's one source of the fingerprints
    assert f"| task.options.data_dir | sst2/ | 2 files, {identity['task.options.data_dir']['bytes']:,} B | SHA-256 of the listing" in card
    assert f"| task.options.model | roberta/ | " in card and identity["task.options.model"]["sha256"] in card and str(model_dir) in card
    assert f'AutoTokenizer.from_pretrained("{tmp_path / "hf"}")' in card
    export_run(run.dir, tmp_path / "ad", format="peft")
    peft_model = PeftModel.from_pretrained(run.task.build_model(), tmp_path / "ad")  # head: classifier.dense + out_proj
    torch.testing.assert_close(logits_of(peft_model, run.batch), run.logits, atol=1e-5, rtol=0)
    plain_base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)  # the card's transformers-only base
    torch.testing.assert_close(logits_of(PeftModel.from_pretrained(plain_base, tmp_path / "ad"), run.batch), run.logits,
                               atol=1e-5, rtol=0)


def test_domainnet_vit_family(tmp_path):
    """The paper's vision path (``domainnet``: a ViT, PEFT without a task type) on a local image folder."""
    from PIL import Image
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageClassification, ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    vit = tmp_path / "vit"
    ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=32, num_labels=5)).save_pretrained(vit)
    rng = np.random.default_rng(0)
    for c, colour in enumerate(("red", "green", "blue")):
        folder = tmp_path / "dn" / "clipart" / colour
        folder.mkdir(parents=True)
        for i in range(10):
            arr = rng.integers(0, 80, (20, 24, 3), dtype=np.uint8)
            arr[..., c] += 150
            Image.fromarray(arr).save(folder / f"{i}.png")
    cfg = tiny_cfg(tmp_path / "runs", "fedit", rounds=1, task={"name": "domainnet", "options": {
        "domain": "clipart", "root": str(tmp_path / "dn"), "model": str(vit), "image_size": 16, "test_fraction": 0.3}})
    run = Run(cfg)
    export_run(run.dir, tmp_path / "hf")
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "hf")
    assert model.config.id2label == {0: "blue", 1: "green", 2: "red"}
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    same_metrics(run.task.evaluate(model, run.task.test_set(), 64), run.summary["final"])
    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert "AutoImageProcessor.from_pretrained" in (tmp_path / "hf" / "README.md").read_text()
    test = run.task.test_set()
    with Image.open(test.paths[0]) as im:
        torch.testing.assert_close(processor(im, return_tensors="pt")["pixel_values"][0], test[0]["pixel_values"], atol=1e-6, rtol=0)
    export_run(run.dir, tmp_path / "ad", format="peft")
    peft_model = PeftModel.from_pretrained(run.task.build_model(), tmp_path / "ad")
    torch.testing.assert_close(logits_of(peft_model, run.batch), run.logits, atol=1e-5, rtol=0)


def test_offline_vit_processor_is_to_pixels():
    from PIL import Image

    from fedgalore.tasks.paper_vision import vit_image_processor
    from fedgalore.tasks.mnist import to_pixels

    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    grey = [Image.fromarray(x) for x in images]  # mode "L", as a user opens an MNIST-like image
    got = vit_image_processor(28, (0.5,), (0.5,), rgb=False)(grey, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(got, to_pixels(images), atol=1e-6, rtol=0)


def test_metamath_causal_lm_family(tmp_path):
    """The paper's NLG path (``metamath``: a Llama, no head, generation metrics) on local files."""
    from peft import PeftModel
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = [{"query": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}. The answer is: {a + b}",
             "type": ["GSM_AnsAug", "MATH_AnsAug"][a % 2]} for a in range(6) for b in range(2)]
    gsm = [{"question": f"What is {a} plus 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"} for a in range(3)]
    corpus = [r["query"] + " " + r["response"] for r in rows] + ["Below is an instruction ### Response: #### 0 1 2 3 4 5 6 7 8 9"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(llama)
    tok.save_pretrained(llama)
    (tmp_path / "mm.json").write_text(json.dumps(rows))
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    cfg = tiny_cfg(tmp_path / "runs", "fedit", rounds=1, federation={
        "num_clients": 2, "clients_per_round": 2, "rounds": 1, "partition": {"kind": "iid"}}, task={"name": "metamath", "options": {
            "model": str(llama), "data": str(tmp_path / "mm.json"), "gsm8k_data": str(tmp_path / "gsm.jsonl"),
            "eval_sets": ["gsm8k"], "dtype": "float32", "max_length": 64, "max_new_tokens": 4, "eval_loss": True}})
    run = Run(cfg)
    export_run(run.dir, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(logits_of(model, run.batch), run.logits, atol=1e-5, rtol=0)
    same_metrics(run.task.evaluate(model, run.task.test_set(), 64), run.summary["final"])
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("What is 1 plus 2?")["input_ids"] == tok("What is 1 plus 2?")["input_ids"]
    card = (tmp_path / "hf" / "README.md").read_text()
    import hashlib

    digest = hashlib.sha256((tmp_path / "mm.json").read_bytes()).hexdigest()[:32]  # what `sha256sum mm.json` begins with
    assert f"| task.options.data | mm.json | {(tmp_path / 'mm.json').stat().st_size:,} B | SHA-256 `{digest}` |" in card
    export_run(run.dir, tmp_path / "ad", format="peft")
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), tmp_path / "ad")
    torch.testing.assert_close(logits_of(peft_model, run.batch), run.logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- docs/export.md as written
DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def _blocks(lang: str) -> list[str]:
    import re

    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", DOC.read_text(), re.S) if m.group(1) == lang]


def test_docs_export_md_runs_as_written(tmp_path, monkeypatch, capsys):
    """Every block of docs/export.md in document order, as a reader follows it: YAML blocks saved
    (the first as ``tiny-export.yaml``, one headed ``# NAME`` as NAME), every command of the bash
    blocks run, the Python blocks executed; the printed lines it shows match what ``export``
    prints (numbers aside). Without the offline MiniLM the support example is left out."""
    import re
    import shlex

    from fedgalore.tasks import assets

    try:
        assets.minilm_path()
        minilm = True
    except assets.AssetError:
        minilm = False
    monkeypatch.chdir(tmp_path)
    number = re.compile(r"\d+(\.\d+)?(e-?\d+)?")
    blocks = [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", DOC.read_text(), re.S)]
    shown = {b.splitlines()[0].split(" to ")[0]: b for lang, b in blocks if lang == "" and b.startswith("exported round")}
    ran, yamls, codes = [], 0, 0
    for lang, body in blocks:
        if not minilm and "support" in body:
            continue
        if lang == "yaml":
            first = body.splitlines()[0]
            name = first[2:].strip() if first.startswith("# ") else "tiny-export.yaml"
            (tmp_path / name).write_text(body)
            yamls += 1
        elif lang == "python":
            exec(compile(body, str(DOC), "exec"), {})  # noqa: S102 - the documentation's own examples
            if codes == 0:
                assert "{0: '0', 1: '1', 2: '2', 3: '3'}" in capsys.readouterr().out  # the id2label the first block prints
            codes += 1
        elif lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                cmd = re.sub(r"\s+#\s.*$", "", line).strip()
                if not cmd:
                    continue
                argv = shlex.split(cmd)
                assert argv[0] == "fedgalore", cmd
                assert main([*argv[1:], *(["--progress", "quiet"] if argv[1] == "run" else [])]) == 0, cmd
                out = capsys.readouterr().out
                if argv[1] == "export" and argv[4] in ("exported/tiny", "exported/tiny-galore-exact"):
                    want = shown[f"exported round {out.split()[2]} of {argv[2]}"].splitlines()
                    assert [number.sub("#", x) for x in want] == [number.sub("#", x) for x in out.splitlines()[:len(want)]]
                ran.append(cmd)
    assert len(ran) == (21 if minilm else 16) and any("--rank 4" in c for c in ran) and any("--exact" in c for c in ran)
    assert codes == (5 if minilm else 4) and yamls == (2 if minilm else 1)
    assert (tmp_path / "runs" / "tiny-rounds" / "adapters" / "round-0003" / "adapter_config.json").is_file()
    if minilm:
        conf = json.loads((tmp_path / "exported" / "support-adapter" / "adapter_config.json").read_text())
        assert conf["base_model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
