"""A 4-bit / 8-bit frozen base for the LoRA methods (``task.options.quantization``, issue 44): the
refusals — methods that train the matrices themselves, a machine where bitsandbytes cannot run
(this CPU machine: one line, exit 2) —, the memory ``fedgalore plan`` counts for a quantised
base, and the GPU benchmark's CPU exit. The quantised training itself needs a CUDA GPU:
``benchmarks/quantized_base.py`` measures it there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedgalore.cli import main
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.tasks.base import TaskError
from fedgalore.tasks.quantize import quantization_unavailable, quantized_bytes


ROOT = Path(__file__).resolve().parents[2]
needs_cpu = pytest.mark.skipif(quantization_unavailable() is None, reason="bitsandbytes can run here")


def causal_cfg(llama_dir: Path, data: Path, method: str = "fedit", **options) -> dict:
    return {"name": "q", "task": {"name": "causal_lm", "options": {"model": str(llama_dir), "data": str(data),
                                                                   "prompt_column": "q", "response_column": "a",
                                                                   "max_length": 32, **options}},
            "method": {"name": method, "rank": 2},
            "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1, "partition": {"kind": "iid"}},
            "train": {"lr": 1e-2, "batch_size": 4, "local_steps": 1}, "output": {"progress": "quiet"}}


@pytest.fixture(scope="module")
def qa(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    path.write_text("".join(json.dumps({"q": f"What is {i} plus 2?", "a": f"The answer is {i + 2}."}) + "\n" for i in range(20)))
    return path


def test_methods_that_train_the_matrices_are_refused(llama_dir, qa):
    for method in ("fedgalore", "fedavg_full", "flora", "fr_lora"):
        with pytest.raises(ConfigError, match=rf"quantization=4bit freezes a quantised base, but method '{method}' trains "
                                              r"the weight matrices themselves; .*\(fedit, ffa_lora, lora_fair[^)]*\)"):  # + methods other tests register
            FederatedConfig.from_dict({**causal_cfg(llama_dir, qa, method, quantization="4bit"), "device": "cuda"})
    with pytest.raises(TaskError, match="quantization='3bit' must be one of 4bit, 8bit"):
        from fedgalore.tasks.generic.causal import CausalLMOptions

        CausalLMOptions(prompt_column="q", response_column="a", quantization="3bit")
    from fedgalore.tasks.paper_math.metamath import MetaMathOptions

    with pytest.raises(TaskError, match="load_in_4bit: true and quantization: 8bit disagree"):
        MetaMathOptions(load_in_4bit=True, quantization="8bit")
    with pytest.raises(ConfigError, match="freezes a quantised base"):  # the old name says the same
        FederatedConfig.from_dict({"name": "m", "task": {"name": "metamath", "options": {"load_in_4bit": True}},
                                   "method": {"name": "fedgalore"}, "device": "cuda"})


@needs_cpu
def test_refused_in_one_line_where_bitsandbytes_cannot_run(llama_dir, qa, tmp_path, capsys):
    """This machine (no CUDA, no bitsandbytes): the CLI says so in one line, exit 2, nothing written;
    the task itself refuses to build a quantised model."""
    cfg = tmp_path / "q.yaml"
    cfg.write_text(json.dumps({**causal_cfg(llama_dir, qa, quantization="4bit"), "output": {"dir": str(tmp_path / "runs")}}))
    assert main(["run", "--config", str(cfg), "--progress", "quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task.options.quantization=4bit: bitsandbytes' quantised layers run on a CUDA GPU" in err[0]
    assert quantization_unavailable() in err[0]
    assert not (tmp_path / "runs").exists()
    from fedgalore.tasks import get_task

    task = get_task("causal_lm", model=str(llama_dir), data=str(qa), prompt_column="q", response_column="a",
                    max_length=32, quantization="8bit")
    with pytest.raises(TaskError, match=r"quantization=8bit: .*; run it on a CUDA machine, or leave quantization out"):
        task.build_model()


def test_plan_counts_the_quantised_base(llama_dir, qa):
    """The model component of a quantised plan: NF4 (0.5 B/weight + block scales) / int8 (1 B + a
    row scale) for every linear weight but lm_head, the other tensors in fp32; methods that cannot
    use the quantised base are planned dense."""
    from fedgalore.plan import make_plan, model_spec

    assert quantized_bytes((4096, 4096), "4bit") == 4096 * 4096 // 2 + 4096 * 4096 // 64 + 4 * (4096 * 4096 // 64 // 256)
    assert quantized_bytes((11008, 4096), "8bit") == 11008 * 4096 + 4 * 11008
    plans = {}
    for q in (None, "4bit", "8bit"):
        cfg = FederatedConfig.from_dict({**causal_cfg(llama_dir, qa, quantization=q, dtype="bfloat16"), "device": "cuda"})
        plans[q] = make_plan(cfg, ["fedit", "fedgalore"])
    spec, _ = model_spec(FederatedConfig.from_dict({**causal_cfg(llama_dir, qa, dtype="bfloat16"), "device": "cuda"}))
    linear = {n: s for n, s in spec.params if n.endswith("_proj.weight")}
    others = {n: s for n, s in spec.params if n not in linear}
    fp32_rest = sum(4 * int(torch.Size(s).numel()) for s in others.values())
    dense = {q: p["methods"]["fedit"]["memory"]["components"]["model"] for q, p in plans.items()}
    adapters = dense[None] - sum(2 * int(torch.Size(s).numel()) for _, s in spec.params)
    for q in ("4bit", "8bit"):
        want = adapters + fp32_rest + sum(quantized_bytes(s, q) for s in linear.values())
        assert dense[q] == want, q
        assert plans[q]["methods"]["fedit"]["quantized_base"] and not plans[q]["methods"]["fedgalore"]["quantized_base"]
        assert plans[q]["methods"]["fedgalore"]["memory"]["components"]["model"] == \
            plans[None]["methods"]["fedgalore"]["memory"]["components"]["model"]
    assert dense["4bit"] < dense["8bit"] < dense[None] + fp32_rest
    from fedgalore.plan import format_plan

    assert "bfloat16, 4bit base for the LoRA methods" in format_plan(plans["4bit"])


def test_benchmark_says_it_needs_a_gpu_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the benchmark itself")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantized_base.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "needs a CUDA GPU" in r.stdout and "nothing was run" in r.stdout
