"""Causal-LM math tasks: answer extraction / normalisation against hand-written cases, the
MetaMathQA task on tiny local JSON files with a tiny random Llama and an offline-trained BPE
tokenizer, and the offline gsm_symbolic task (tiny Llama; real SmolLM2 only if cached)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fedgalore.tasks import get_task  # noqa: E402
from fedgalore.tasks.base import TaskError, resolve_target_modules  # noqa: E402
from fedgalore.tasks.paper_math.base import LLAMA_TARGET_MODULES  # noqa: E402
from fedgalore.tasks.paper_math.grading import (  # noqa: E402
    answers_match,
    extract_gsm8k_answer,
    extract_math_answer,
    last_boxed,
    normalize_math_answer,
    normalize_number,
)
from fedgalore.tasks.paper_math.metamath import MetaMathQATask  # noqa: E402


# ----------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text, expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is 1,234 dollars\n#### 1,234", "1234"),
        ("He loses 5 - 8 = -3 points.\n#### -3", "-3"),
        ("The answer is: 18", "18"),
        ("Step 1: 3 + 4 = 7. The answer is 7.", "7"),
        ("... so she pays $12.50. The answer is $12.50", "12.5"),
        ("The answer is: 42.0", "42"),
        ("first 3 then 9 and finally 27 apples", "27"),  # fallback: last number
        ("#### 5\n\nThe answer is: 6", "5"),  # #### has priority
        ("no digits here", None),
        ("The answer is 0.25", "0.25"),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_normalize_number():
    assert normalize_number("1,000,000") == "1000000"
    assert normalize_number(" -7.50 ") == "-7.5"
    assert normalize_number("$3") == "3"
    assert normalize_number("50%") == "50"
    assert normalize_number("abc") is None
    assert answers_match("1,234", "1234", "gsm8k") and not answers_match("1234", "1235", "gsm8k")
    assert not answers_match(None, "3", "gsm8k")


def test_last_boxed_and_math_extraction():
    assert last_boxed(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{\{a, b\}}") == r"\{a, b\}"
    assert last_boxed(r"\boxed{\sqrt{x^{2}}}") == r"\sqrt{x^{2}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("none") is None
    assert extract_math_answer(r"We get $\boxed{\dfrac{3}{4}}$.") == r"\dfrac{3}{4}"
    assert extract_math_answer("Thus ... The answer is: \\frac{1}{2}") == "\\frac{1}{2}"
    assert extract_math_answer("nothing to see") is None


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\left( 3, 4 \right)", "(3,4)"),
        (r"90^\circ", "90"),
        (r"5\text{ cm}", "5"),
        (r"x = 7", "7"),
        (r"\$10", "10"),
        ("1,000", "1000"),
        (r"\sqrt2", r"\sqrt{2}"),
        ("-3.0", "-3"),
        (r"10\%", "10"),
    ],
)
def test_math_answers_match(pred, gold):
    assert answers_match(pred, gold, "math"), (normalize_math_answer(pred), normalize_math_answer(gold))


def test_math_answers_differ():
    assert not answers_match(r"\frac{1}{3}", r"\frac{1}{2}", "math")
    assert not answers_match("(3,4)", "(4,3)", "math")
    assert normalize_math_answer(None) is None


# ----------------------------------------------------------------------------- tiny model + data
TRAIN = [
    {"query": "What is 2 plus 3?", "response": "2 + 3 = 5. The answer is: 5", "type": "GSM_AnsAug"},
    {"query": "What is 4 times 2?", "response": "4 * 2 = 8. The answer is: 8", "type": "GSM_Rephrased"},
    {"query": "Compute 1/2 + 1/2.", "response": "1/2 + 1/2 = 1. The answer is: 1", "type": "MATH_AnsAug"},
    {"query": "What is 9 minus 4?", "response": "9 - 4 = 5. The answer is: 5", "type": "GSM_AnsAug"},
    {"query": "What is 3 times 3?", "response": "3 * 3 = 9. The answer is: 9", "type": "MATH_SV"},
    {"query": "What is 6 plus 1?", "response": "6 + 1 = 7. The answer is: 7", "type": "GSM_FOBAR"},
]
GSM = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "What is 10 minus 1?", "answer": "10 - 1 = <<10-1=9>>9\n#### 9"},
]
MATH = [
    {"problem": "Compute $\\frac{1}{4}+\\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "What is $2^3$?", "solution": "$2^3 = \\boxed{8}$.", "level": "Level 1", "type": "Algebra"},
]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM + a BPE tokenizer trained offline, saved like a hub model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [r["query"] + " " + r["response"] for r in TRAIN] + [g["question"] + " " + g["answer"] for g in GSM]
    corpus += [m["problem"] + " " + m["solution"] for m in MATH]
    corpus += ["Below is an instruction that describes a task. Write a response that appropriately completes the request.",
               "### Instruction:\n### Response:\nQuestion: Answer: #### The answer is: 0 1 2 3 4 5 6 7 8 9 , . $ \\boxed{}"]
    try:
        import reasoning_gym

        corpus += [e["question"] + " " + e["metadata"]["answer_cot"] for e in reasoning_gym.create_dataset("gsm_symbolic", size=60, seed=0)]
    except ImportError:
        pass
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def metamath_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("metamath")
    (d / "metamath.json").write_text(json.dumps(TRAIN))
    (d / "gsm8k_test.jsonl").write_text("\n".join(json.dumps(r) for r in GSM) + "\n")
    (d / "math_test.jsonl").write_text("\n".join(json.dumps(r) for r in MATH) + "\n")
    return d


def _metamath(tiny_llama_dir, files, **kw):
    opts = dict(model=str(tiny_llama_dir), data=str(files / "metamath.json"), gsm8k_data=str(files / "gsm8k_test.jsonl"),
                math_data=str(files / "math_test.jsonl"), dtype="float32", max_length=128, max_new_tokens=6)
    opts.update(kw)
    return get_task("metamath", **opts)


def test_metamath_task_data_and_masking(tiny_llama_dir, metamath_files):
    task = _metamath(tiny_llama_dir, metamath_files)
    assert isinstance(task, MetaMathQATask)
    assert task.peft_task_type == "CAUSAL_LM" and tuple(task.head_modules) == ()
    assert len(task.train_set()) == 6 and len(task.test_set()) == 4
    assert task.partition_labels().tolist() == [r["type"] for r in TRAIN]
    assert task.label_names() == ["GSM_AnsAug", "GSM_FOBAR", "GSM_Rephrased", "MATH_AnsAug", "MATH_SV"]
    assert task.test_set().answers == ["7", "9", "\\frac{1}{2}", "8"]
    assert task.test_set().kinds == ["gsm8k", "gsm8k", "math", "math"]
    info = json.loads(json.dumps(task.describe()))
    assert info["n_train"] == 6 and info["n_test"] == 4 and info["primary_metric"] == "exact_match"
    ex = task.train_set()[0]
    tok = task.tokenizer
    n_prompt = len(tok(task.train_set().prompts[0])["input_ids"])
    assert (ex["labels"][:n_prompt] == -100).all()
    assert torch.equal(ex["labels"][n_prompt:], ex["input_ids"][n_prompt:])
    assert int(ex["input_ids"][-1]) == tok.eos_token_id
    assert tok.decode(ex["labels"][n_prompt:-1]) == TRAIN[0]["response"]
    batch = task.collate([task.train_set()[i] for i in range(3)])
    lengths = [len(task.train_set()[i]["input_ids"]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_metamath_truncation_keeps_response_tokens(tiny_llama_dir, metamath_files):
    task = _metamath(tiny_llama_dir, metamath_files, max_length=24)
    for i in range(len(task.train_set())):
        ex = task.train_set()[i]
        assert len(ex["input_ids"]) <= 24 and int((ex["labels"] != -100).sum()) >= 1


def test_metamath_train_and_evaluate(tiny_llama_dir, metamath_files):
    task = _metamath(tiny_llama_dir, metamath_files, eval_loss=True)
    model = task.build_model()
    names = resolve_target_modules(model, task.target_modules)
    assert len(names) == 2 * 7 and not any("lm_head" in n for n in names)
    batch = task.collate([task.train_set()[i] for i in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    m = task.evaluate(model, task.test_set(), batch_size=3)
    assert set(m) == {"gsm8k_exact_match", "math_exact_match", "exact_match", "loss"}
    assert all(0.0 <= m[k] <= 1.0 for k in ("gsm8k_exact_match", "math_exact_match", "exact_match"))
    assert m["exact_match"] == pytest.approx((m["gsm8k_exact_match"] + m["math_exact_match"]) / 2)
    assert np.isfinite(m["loss"])


def test_metamath_evaluate_counts_exact_matches(tiny_llama_dir, metamath_files, monkeypatch):
    task = _metamath(tiny_llama_dir, metamath_files, eval_sets=("gsm8k", "math"))
    outputs = iter([["so 7\n#### 7", "The answer is 8"], ["$\\boxed{\\dfrac{1}{2}}$", "The answer is: 9"]])
    monkeypatch.setattr(task, "generate", lambda model, prompts, max_new_tokens=None: next(outputs))
    m = task.evaluate(task.build_model(), task.test_set(), batch_size=2)
    assert m == {"gsm8k_exact_match": 0.5, "math_exact_match": 0.5, "exact_match": 0.5}


def test_metamath_bad_eval_set(tiny_llama_dir, metamath_files):
    with pytest.raises(TaskError, match="eval_sets"):
        _metamath(tiny_llama_dir, metamath_files, eval_sets=("svamp",))


def test_generation_left_pads(tiny_llama_dir, metamath_files):
    task = _metamath(tiny_llama_dir, metamath_files)
    model = task.build_model()
    prompts = [task.test_set().prompts[0], "What?"]
    both = task.generate(model, prompts, max_new_tokens=4)
    alone = task.generate(model, prompts[1:], max_new_tokens=4)
    assert len(both) == 2 and both[1] == alone[0]  # padding does not change a greedy continuation


# ----------------------------------------------------------------------------- offline gsm_symbolic
def test_offline_gsm_symbolic_with_tiny_llama(tiny_llama_dir):
    rg = pytest.importorskip("reasoning_gym")
    task = get_task("offline_math", model=str(tiny_llama_dir), n_train=12, n_test=3, max_length=512, eval_max_new_tokens=4)
    assert len(task.train_set()) == 12 and len(task.test_set()) == 3
    pool = rg.create_dataset("gsm_symbolic", size=4 * (3 + 12), seed=0)
    assert task.test_indices[0] == 0 and not set(task.test_indices) & set(task.train_indices)
    assert task.test_set().answers == [str(pool[i]["answer"]) for i in task.test_indices]
    labels = task.partition_labels()
    assert labels.dtype == np.int64 and labels.min() >= 0 and labels.max() < 100
    assert labels.tolist() == [pool.task_indices[i] for i in task.train_indices]  # template ids
    assert task.train_set().responses[0].rstrip().split("\n")[-1].startswith("####")
    assert task.train_set().prompts[0].startswith("Question: ")  # tiny tokenizer has no chat template
    model = task.build_model()
    batch = task.collate([task.train_set()[i] for i in range(4)])
    with torch.no_grad():
        loss0 = float(task.loss(model, batch))
    assert np.isfinite(loss0) and loss0 > 0
    m = task.evaluate(model, task.test_set(), batch_size=3)
    assert set(m) == {"gsm8k_exact_match", "exact_match", "loss"}


def test_offline_gsm_symbolic_length_filter(tiny_llama_dir):
    pytest.importorskip("reasoning_gym")
    task = get_task("offline_math", model=str(tiny_llama_dir), n_train=5, n_test=2, max_length=200)
    assert len(task.train_set()) == 5 and len(task.test_set()) == 2
    assert task.train_indices != list(range(2, 7))  # some long problems were skipped
    for ds in (task.train_set(), task.test_set()):
        for i in range(len(ds)):
            ex = ds[i]
            assert len(ex["input_ids"]) <= 200 and int(ex["labels"][-1]) == task.tokenizer.eos_token_id


def _smollm2_cached() -> bool:
    try:
        from fedgalore.tasks.assets import cache_dir

        return (cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file()
    except Exception:
        return False


@pytest.mark.skipif(not _smollm2_cached(), reason="SmolLM2 not cached: run `python -c 'from fedgalore.tasks.assets import smollm2_path; smollm2_path()'` (make setup)")
def test_offline_math_real_smollm2():
    pytest.importorskip("reasoning_gym")
    task = get_task("offline_math", n_train=4, n_test=2, max_length=256, eval_max_new_tokens=4)
    assert task.tokenizer.eos_token == "<|im_end|>"
    assert task.train_set().prompts[0].startswith("<|im_start|>")
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert len(resolve_target_modules(model, LLAMA_TARGET_MODULES)) == 30 * 7
    batch = task.collate([task.train_set()[i] for i in range(2)])
    with torch.no_grad():
        loss = float(task.loss(model, batch))
    assert 0.0 < loss < 3.0  # a pretrained instruct model already models worked solutions well
