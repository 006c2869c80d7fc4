"""Adapters in and out (issue 44): a PEFT adapter folder as ``task.options.model`` (continued by
the LoRA methods, merged by the others), the portable base name exports record, the exact LoRA
export of an exactly low-rank update (``--exact``) and its refusals, and ``export.every_round``.

Every check is against a model built the other way: the adapter's own model through plain PEFT,
the engine's global model (``method.load_global`` on the run's runtime), a kept checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedgalore.cli import main
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.trained.export import ExportError, export_run
from fedgalore.trained.global_model import load_global_model
from fedgalore.engine.loop import Federation
from fedgalore.engine.round_adapters import round_adapter_dir
from fedgalore.methods.base import MethodError
from fedgalore.tasks.base import TaskError
from fedgalore_testing.assets import news_rows, write


def text_cfg(root: Path, model: str, method: str, name: str, rounds: int = 1, rank: int = 2, **over) -> FederatedConfig:
    d = {"name": name, "seed": 0,
         "task": {"name": "text_classification", "options": {"model": model, "data": str(root / "news.csv"), "text_column": "body",
                                                             "label_column": "topic", "max_length": 16, **over.pop("task_options", {})}},
         "method": {"name": method, "rank": rank, "options": over.pop("options", {})},
         "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": rounds, "partition": {"kind": "iid"}},
         "train": {"lr": 2e-2, "batch_size": 8, "local_steps": 2},
         "output": {"dir": str(root / "runs"), "progress": "quiet", "keep_checkpoints": 3}}
    d.update(over)
    return FederatedConfig.from_dict(d)


def batch_of(task, n: int = 8):
    return task.test_set().batch(list(range(min(n, len(task.test_set())))))


@torch.no_grad()
def global_logits(fed: Federation, batch) -> torch.Tensor:
    fed.method.load_global(fed.runtime.model, fed.state)
    return fed.runtime.model.eval()(**batch).logits.float()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, bert_dir):
    """A FedIT run on the tiny BERT, given by a relative path as a user writes it, exported as a
    PEFT adapter: (root, adapter folder, the run)."""
    import os

    root = tmp_path_factory.mktemp("adapter")
    write(news_rows(60), root / "news.csv")
    (root / "bert").symlink_to(bert_dir, target_is_directory=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        fed = Federation(text_cfg(root, "bert", "fedit", "first", rounds=2))
        fed.run()
        res = export_run(fed.run_dir, root / "ad", format="peft")
    finally:
        os.chdir(cwd)
    return root, root / "ad", fed, res


def test_export_records_the_base_as_the_user_named_it(adapter):
    root, folder, fed, res = adapter
    conf = json.loads((folder / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "bert" == res.base_model  # not the absolute path the run resolved
    card = (folder / "README.md").read_text()
    line = next(x for x in card.splitlines() if x.startswith("| base model |"))
    assert line == f"| base model | bert (this run read {(root / 'bert').resolve()}) |"


@pytest.mark.parametrize("method", ["fedit", "ffa_lora", "lora_fair", "fedgalore", "fedavg_full", "flora"])
def test_adapter_as_the_starting_model_is_the_adapters_model(adapter, method):
    """Round 0's global model is the adapter's model W0 + s·BA (PEFT loads it on the same base):
    continued by the LoRA methods, merged by the others; then the run trains from there."""
    from peft import PeftModel

    root, folder, _, _ = adapter
    fed = Federation(text_cfg(root, str(folder), method, f"from-{method}", task_options={"base_model": str(root / "bert")}))
    assert fed.task.start_adapter is not None and fed.task.start_adapter.rank == 2
    batch = batch_of(fed.task)
    with torch.no_grad():
        want = PeftModel.from_pretrained(fed.task.build_model(), folder).eval()(**batch).logits.float()
    torch.testing.assert_close(global_logits(fed, batch), want, atol=2e-6, rtol=0)
    if fed.method.traits.explicit_adapters:  # the adapter is trained on, not merged: W0 stays the base
        t = fed.runtime.target_modules[0]
        base = dict(fed.task.build_model().named_parameters())[t + ".weight"]
        assert torch.equal(fed.method.base_weight(fed.runtime.model, t).detach().cpu(), base.detach())
    fed.run()
    assert fed.history[-1]["round"] == 1


def test_adapter_errors_are_one_line(adapter, monkeypatch):
    root, folder, _, _ = adapter
    with pytest.raises(MethodError, match=r"has rank 2 and method.rank=4; set method.rank=2"):
        Federation(text_cfg(root, str(folder), "fedit", "r4", rank=4, task_options={"base_model": str(root / "bert")}))
    with pytest.raises(MethodError, match=r"set method.options.lora_alpha=4"):
        Federation(text_cfg(root, str(folder), "fedit", "a8", options={"lora_alpha": 8.0},
                            task_options={"base_model": str(root / "bert")}))
    other = root / "hub-adapter"
    other.mkdir(exist_ok=True)
    conf = json.loads((folder / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**conf, "base_model_name_or_path": "someorg/not-cached-model"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskError, match=r"'someorg/not-cached-model' .* is not available offline .* set task.options.base_model"):
        Federation(text_cfg(root, str(other), "fedit", "x"))
    (other / "adapter_config.json").write_text(json.dumps({**conf, "peft_type": "IA3"}))
    with pytest.raises(TaskError, match="only LoRA adapters"):
        Federation(text_cfg(root, str(other), "fedit", "y"))
    with pytest.raises(TaskError, match="base_model names the base of a PEFT adapter"):
        Federation(text_cfg(root, str(root / "bert"), "fedit", "z", task_options={"base_model": "bert"}))


# ----------------------------------------------------------------------------- --exact
TINY = {"n_train": 64, "n_test": 24, "hidden_size": 64, "num_layers": 1, "seq_len": 8}


def tiny_cfg(root: Path, method: str, weight_decay: float = 0.0, **over) -> FederatedConfig:
    d = {"name": "ex", "seed": 0, "task": {"name": "tiny_text", "options": dict(TINY)},
         "method": {"name": method, "rank": 2},
         "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 3, "partition": {"kind": "iid"}},
         "train": {"lr": 2e-2, "batch_size": 8, "local_steps": 2, "weight_decay": weight_decay},
         "output": {"dir": str(root), "progress": "quiet", "keep_checkpoints": 3}}
    d.update(over)
    return FederatedConfig.from_dict(d)


@pytest.mark.parametrize("method", ["fedgalore", "fedgalore_minus"])
def test_exact_export_of_fedgalore_gives_the_runs_logits_at_its_numerical_rank(tmp_path, method):
    from peft import PeftModel

    fed = Federation(tiny_cfg(tmp_path / "runs", method))
    fed.run()
    res = export_run(fed.run_dir, tmp_path / "ex", format="peft", exact=True)
    batch = batch_of(fed.task, 24)
    want = global_logits(fed, batch)
    got = PeftModel.from_pretrained(fed.task.build_model(), tmp_path / "ex").eval()(**batch).logits.float()
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))  # fp32 rounding
    assert res.check is not None and res.check <= 1e-5
    # rank ≤ Σ of the rounds' ranks: 3 rounds × 2 clients × (≤ one rank-2 term per local step, 2 steps)
    ranks = [f.rank for _, f in res.exact]
    assert ranks and all(1 <= k <= 3 * 2 * 2 * 2 for k in ranks) and max(ranks) < 64
    for _, f in res.exact:  # a clear gap: what is dropped is the fp32 rounding floor, what is kept is update
        assert f.largest_dropped <= f.floor < f.smallest_kept and f.smallest_kept > 10 * f.largest_dropped
        assert f.rel_error < 1e-4  # the fp32 factors' own rounding, against ‖W − W0‖ (a small update)
    conf = json.loads((tmp_path / "ex" / "adapter_config.json").read_text())
    assert sorted(conf["rank_pattern"].values()) == sorted(ranks) and conf["alpha_pattern"] == {
        k: float(v) for k, v in conf["rank_pattern"].items()}
    assert res.adapter_bytes < res.dense_bytes  # smaller than the matrices it stands for
    info = json.loads((tmp_path / "ex" / "fedgalore_export.json").read_text())
    assert [m["rank"] for m in info["exact"]] == ranks
    assert "## Exact LoRA" in (tmp_path / "ex" / "README.md").read_text()


def test_exact_is_refused_where_the_update_is_not_low_rank(tmp_path, capsys):
    decayed = Federation(tiny_cfg(tmp_path / "runs", "fedgalore", weight_decay=0.01, name="wd"))
    decayed.run()
    with pytest.raises(ExportError, match=r"train.weight_decay=0.01: FedGaLore's decoupled decay .* full-rank"):
        export_run(decayed.run_dir, tmp_path / "x", format="peft", exact=True)
    dense = Federation(tiny_cfg(tmp_path / "runs", "fedavg_full", name="full", federation={
        "num_clients": 3, "clients_per_round": 2, "rounds": 1, "partition": {"kind": "iid"}}))
    dense.run()
    assert main(["export", str(dense.run_dir), "--out", str(tmp_path / "y"), "--format", "peft", "--exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fedavg_full" in err[0] and "no exact LoRA form" in err[0]
    with pytest.raises(ExportError, match="use it with --format peft"):
        export_run(dense.run_dir, tmp_path / "z", exact=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ----------------------------------------------------------------------------- export.every_round
def test_every_round_keeps_a_peft_adapter_of_each_rounds_global_model(tmp_path):
    from peft import PeftModel

    fed = Federation(tiny_cfg(tmp_path / "runs", "fedit", weight_decay=0.01, export={"every_round": True}))
    fed.run()
    batch = batch_of(fed.task, 24)
    for r in (1, 3):
        folder = round_adapter_dir(fed.run_dir, r)
        assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "fedgalore_round.json"}
        g = load_global_model(fed.run_dir, round=r)  # the kept checkpoint of that round
        with torch.no_grad():
            want = g.model.eval()(**batch).logits.float()
            got = PeftModel.from_pretrained(fed.task.build_model(), folder).eval()(**batch).logits.float()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    size = sum(p.stat().st_size for p in round_adapter_dir(fed.run_dir, 3).iterdir())
    assert size < sum(p.numel() * 4 for p in fed.task.build_model().parameters())
    with pytest.raises(ConfigError, match="export.every_round keeps each round's LoRA adapter, and method 'fedgalore' has none"):
        tiny_cfg(tmp_path / "runs", "fedgalore", export={"every_round": True})


def test_hub_ids_of_the_offline_models(tmp_path):
    from fedgalore.tasks import assets

    assert assets.hub_id(tmp_path) is None
    try:
        path = assets.minilm_path()
    except assets.AssetError:
        pytest.skip("offline MiniLM not installed")
    assert assets.hub_id(path) == "sentence-transformers/all-MiniLM-L6-v2"
    assert assets.hub_id(assets.cache_dir() / "smollm2-135m-instruct", note=True).startswith(
        "HuggingFaceTB/SmolLM2-135M-Instruct (dequantised from its Q4_1 GGUF")
