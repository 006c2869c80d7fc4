"""Instruction formats and files as people have them (issue 44, items 1, 2, 6, 7).

* ``causal_lm`` ``format: alpaca | sharegpt | messages`` (and the older ``prompt_response`` /
  ``template`` under their names), ``train_on``, and loss masks that cover exactly the assistant
  tokens;
* ``task.options.csv`` and sniffing (a semicolon CSV with a byte-order mark, a cp1252 file), the
  parser's own error line, ``drop_empty``, ``federation.partition.min_client_size``;
* labels stored as whole-number floats are classes; truly fractional ones are regression, said so.

Every data file is written here, in ``tmp_path``; the models are the tiny random checkpoints of
tests/fedgalore_testing/assets.py (conftest.py's ``llama_dir`` / ``bert_dir``), plus a copy of the tiny Llama's
tokenizer with ChatML special tokens (``<|im_start|>``, ``<|im_end|>`` as end of sequence), the
layout of SmolLM2's.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pandas as pd
import pytest

from fedgalore.tasks import TaskError, get_task, parse_task_options
from fedgalore.tasks.generic.formats import ALPACA_PROMPT, ALPACA_PROMPT_INPUT, PLAIN_CHAT_TEMPLATE
from fedgalore_testing.assets import news_rows, write

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chatml_dir(llama_dir, tmp_path_factory):
    """The tiny Llama's config and tokenizer with ChatML special tokens and template (no weights:
    the data tests never build the model)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chatml")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    tok.save_pretrained(d)
    shutil.copy(llama_dir / "config.json", d / "config.json")
    return d


@pytest.fixture(scope="module")
def plain_dir(llama_dir, tmp_path_factory):
    """The tiny Llama's config and tokenizer without a chat template."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("plain")
    tok = AutoTokenizer.from_pretrained(llama_dir)
    tok.chat_template = None
    tok.save_pretrained(d)
    for f in d.glob("chat_template.*"):
        f.unlink()
    shutil.copy(llama_dir / "config.json", d / "config.json")
    return d


def causal(model_dir, data, **kw):
    return get_task("causal_lm", model=str(model_dir), data=str(data), max_length=256, test_fraction=0.25, **kw)


def labelled_runs(item) -> list[list[int]]:
    """The maximal runs of positions whose label is not -100, as token ids (labels equal the ids there)."""
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != -100:
            assert lab == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def conversations(n: int = 8) -> list[list[tuple[str, str]]]:
    """Multi-turn chats as (speaker, text): a system turn, then two question/answer pairs."""
    out = []
    for i in range(n):
        a, b = 2 + i, 3 + i % 4
        out.append([("system", "Be brief."), ("human", f"What is {a} plus {b}?"), ("gpt", f"{a} + {b} = {a + b}."),
                    ("human", f"And times {b}?"), ("gpt", f"The answer is {(a + b) * b}.")])
    return out


def write_sharegpt(path, chats) -> None:
    path.write_text("".join(json.dumps({"conversations": [{"from": w, "value": v} for w, v in c], "id": k}) + "\n"
                            for k, c in enumerate(chats)))


ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def write_messages(path, chats) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": ROLES[w], "content": v} for w, v in c]}) + "\n" for c in chats))


# ============================================================================ 1. formats by name
def test_alpaca_json_with_empty_and_missing_inputs(tmp_path, chatml_dir, plain_dir):
    rows = [{"instruction": f"Add {i} and 2.", "input": ["", f"{i}, 2", None][i % 3], "output": f"{i + 2}"} for i in range(12)]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows))  # a JSON array of records, as Stanford Alpaca ships it
    task = causal(chatml_dir, path, format="alpaca")
    data, tok = task._rows["train"].data, task.tokenizer
    for i, row in enumerate(data):
        user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        assert task.train_set().prompts[i] == tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                                        add_generation_prompt=True)
        assert task.train_set().responses[i] == row["output"]
    assert task.describe()["format"] == "alpaca"
    # no chat template: the usual Alpaca prompt, with and without its input section
    plain = causal(plain_dir, path, format="alpaca")
    prompts = {r["instruction"]: p for r, p in zip(plain._rows["train"].data, plain.train_set().prompts)}
    for r in rows:
        if r["instruction"] in prompts:
            want = (ALPACA_PROMPT_INPUT.format(instruction=r["instruction"], input=r["input"]) if r["input"]
                    else ALPACA_PROMPT.format(instruction=r["instruction"]))
            assert prompts[r["instruction"]] == want
    assert sum("### Input:" in p for p in prompts.values()) == sum(bool(r["input"]) for r in plain._rows["train"].data) > 0
    # the loss is on the output and the end-of-sequence token only
    item, ptok = plain.train_set()[0], plain.tokenizer
    assert labelled_runs(item) == [ptok(plain.train_set().responses[0], add_special_tokens=False)["input_ids"] + [ptok.eos_token_id]]
    # a file without an input column at all, and other column names (Dolly's)
    dolly = tmp_path / "dolly.jsonl"
    write(pd.DataFrame([{"instruction": f"Say {i}.", "context": "" if i % 2 else "ctx", "response": str(i)} for i in range(8)]), dolly)
    t = causal(plain_dir, dolly, format="alpaca", input_column="context", response_column="response")
    assert all(("### Input:\nctx" in p) == (r["context"] == "ctx") for p, r in zip(t.train_set().prompts, t._rows["train"].data))
    no_input = tmp_path / "noinput.jsonl"
    write(pd.DataFrame([{"instruction": f"Say {i}.", "output": str(i)} for i in range(8)]), no_input)
    assert all("### Input" not in p for p in causal(plain_dir, no_input, format="alpaca").train_set().prompts)


def test_sharegpt_multi_turn_masks_exactly_the_assistant_turns(tmp_path, chatml_dir):
    chats = conversations()
    write_sharegpt(tmp_path / "chat.jsonl", chats)
    task = causal(chatml_dir, tmp_path / "chat.jsonl", format="sharegpt")
    tok = task.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end
    ds = task.train_set()
    assert task.options.train_on == "all_assistant_turns" and len(ds) == 6
    for i in range(len(ds)):
        turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in task._rows["train"].data[i]["conversations"]]
        item = ds[i]
        # the sequence is the chat template's rendering of the whole conversation (its final newline aside)
        full = tok.apply_chat_template(turns, tokenize=False)
        assert item["input_ids"].tolist() == tok(full[:-1])["input_ids"]
        # the labels cover exactly the two answers, each with its end-of-turn token
        answers = [t["content"] for t in turns if t["role"] == "assistant"]
        assert labelled_runs(item) == [tok(a, add_special_tokens=False)["input_ids"] + [im_end] for a in answers]
        assert ds.prompts[i] == tok.apply_chat_template(turns[:-1], tokenize=False, add_generation_prompt=True)
        assert ds.responses[i] == answers[-1]
    # train_on: last -- the earlier answer is context
    last = causal(chatml_dir, tmp_path / "chat.jsonl", format="sharegpt", train_on="last")
    item = last.train_set()[0]
    assert labelled_runs(item) == [tok(last.train_set().responses[0], add_special_tokens=False)["input_ids"] + [im_end]]
    assert item["input_ids"].tolist() == ds[0]["input_ids"].tolist()  # the same tokens, fewer of them trained
    assert task.loss_items(task.collate([ds[0]])) > last.loss_items(last.collate([item]))


def test_messages_equal_sharegpt_and_the_plain_fallback(tmp_path, chatml_dir, plain_dir, llama_dir):
    chats = conversations()
    write_sharegpt(tmp_path / "chat.jsonl", chats)
    write_messages(tmp_path / "messages.jsonl", chats)
    a = causal(chatml_dir, tmp_path / "chat.jsonl", format="sharegpt")
    b = causal(chatml_dir, tmp_path / "messages.jsonl", format="messages")
    assert [a.train_set()[i]["labels"].tolist() for i in range(6)] == [b.train_set()[i]["labels"].tolist() for i in range(6)]
    # a chat stored as JSON text in a CSV column is parsed
    pd.DataFrame({"messages": [json.dumps([{"role": ROLES[w], "content": v} for w, v in c]) for c in chats]}).to_csv(
        tmp_path / "chats.csv", index=False)
    csv_chats = causal(chatml_dir, tmp_path / "chats.csv", format="messages")
    assert [csv_chats.train_set()[i]["labels"].tolist() for i in range(6)] == [b.train_set()[i]["labels"].tolist() for i in range(6)]
    # messages_column alone (the format before formats had names) is format messages
    c = causal(chatml_dir, tmp_path / "messages.jsonl", messages_column="messages")
    assert c.describe()["format"] == "messages" and c.train_set().segments == b.train_set().segments
    # a tokenizer without a chat template: the plain fallback, and the answers found in it all the same
    plain = causal(plain_dir, tmp_path / "messages.jsonl", format="messages")
    tok = plain.tokenizer
    turns = plain._rows["train"].data[0]["messages"]
    assert plain.train_set().prompts[0] == tok.apply_chat_template(
        [{"role": t["role"], "content": t["content"]} for t in turns[:-1]], tokenize=False, add_generation_prompt=True,
        chat_template=PLAIN_CHAT_TEMPLATE)
    assert plain.train_set().prompts[0].startswith("### System:\nBe brief.\n\n### User:\nWhat is")
    answers = [t["content"] for t in turns if t["role"] == "assistant"]
    assert labelled_runs(plain.train_set()[0]) == [tok(answers[0], add_special_tokens=False)["input_ids"],
                                                   tok(answers[1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    # the tiny Llama's own template writes no end-of-turn token: each earlier answer is its content alone
    own = causal(llama_dir, tmp_path / "messages.jsonl", format="messages")
    seg = own.train_set().segments[0]
    assert [t for t, trained in seg if trained] == [answers[0]]


def test_format_errors_name_the_format_and_what_was_found(tmp_path, chatml_dir):
    chats = conversations(4)
    write_sharegpt(tmp_path / "chat.jsonl", chats)
    write_messages(tmp_path / "messages.jsonl", chats)
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "x", "input": "", "output": "y"}] * 4))
    cases = [
        ({"data": "chat.jsonl", "format": "messages"},
         r"chat\.jsonl has no column 'messages' \(task\.options\.messages_column\); its columns: conversations, id; "
         r"format messages reads other columns; these look like sharegpt: set task\.options\.format: sharegpt$"),
        ({"data": "chat.jsonl", "messages_column": "conversations"},
         r"row \d+: format messages needs \{role, content\} turns in column 'conversations' \(task\.options\.messages_column\); "
         r"found turns with keys from, value; that looks like ShareGPT: set task\.options\.format: sharegpt$"),
        ({"data": "messages.jsonl", "format": "sharegpt", "messages_column": "messages"},
         r"found turns with keys content, role; that looks like OpenAI messages: set task\.options\.format: messages$"),
        ({"data": "messages.jsonl", "format": "sharegpt"},
         r"these look like messages: set task\.options\.format: messages$"),
        ({"data": "alpaca.json", "format": "sharegpt"}, r"these look like alpaca: set task\.options\.format: alpaca$"),
        ({"data": "alpaca.json", "prompt_column": "prompt", "response_column": "output"},
         r"has no column 'prompt' .*format prompt_response \(from the columns named\) reads other columns; these look like "
         r"alpaca: set task\.options\.format: alpaca$"),
        ({"data": "chat.jsonl", "format": "sharegpt", "prompt_column": "x"}, r"task\.options\.format: sharegpt does not read prompt_column"),
        ({"data": "chat.jsonl", "format": "sharegpt", "input_column": "x"}, r"input_column is read by format: alpaca only"),
        ({"data": "chat.jsonl", "format": "prompt_response"}, r"format: prompt_response needs prompt_column and response_column"),
        ({"data": "chat.jsonl"}, r"task\.options needs prompt_column \+ response_column, .* or a format: alpaca, sharegpt or messages"),
        ({"data": "chat.jsonl", "format": "shargpt"}, r"task\.options\.format='shargpt' must be one of 'alpaca', 'sharegpt'"),
    ]
    for opts, expected in cases:
        with pytest.raises(TaskError) as exc:
            get_task("causal_lm", model=str(chatml_dir), **{k: str(tmp_path / v) if k == "data" else v for k, v in opts.items()})
        msg = str(exc.value)
        assert "\n" not in msg and __import__("re").search(expected, msg), (opts, msg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}) + "\n")
    with pytest.raises(TaskError, match=r"bad\.jsonl row 1: turn 2 is from 'bot'; ShareGPT speakers are human, user, gpt"):
        get_task("causal_lm", model=str(chatml_dir), data={"train": str(bad), "test": str(bad)}, format="sharegpt")
    ends = tmp_path / "ends.jsonl"
    ends.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                             {"role": "user", "content": "bye"}]}) + "\n")
    with pytest.raises(TaskError, match=r"must end with an assistant turn .*\(it ends with a user turn, 3 turn\(s\)\)"):
        get_task("causal_lm", model=str(chatml_dir), data={"train": str(ends), "test": str(ends)}, format="messages")


def test_a_template_that_rewrites_earlier_turns_asks_for_train_on_last(tmp_path, chatml_dir):
    from transformers import AutoTokenizer

    d = tmp_path / "rewriting"
    shutil.copytree(chatml_dir, d)
    tok = AutoTokenizer.from_pretrained(d)
    # like templates that drop past answers' reasoning: only the last assistant turn is written in full
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
                         "(answered){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(d)
    write_messages(tmp_path / "m.jsonl", conversations(4))
    with pytest.raises(TaskError, match=r"m\.jsonl.* row \d+: the chat template does not write .*set task\.options\.train_on: last"):
        causal(d, tmp_path / "m.jsonl", format="messages")
    assert len(causal(d, tmp_path / "m.jsonl", format="messages", train_on="last").train_set()) == 3


def test_formats_train_end_to_end(tmp_path, llama_dir, capsys):
    """A one-round run per format through the CLI on the tiny Llama: the loss is finite and the
    run's task.json names the format."""
    from fedgalore.cli import main

    chats = conversations(12)
    write_sharegpt(tmp_path / "chat.jsonl", chats)
    (tmp_path / "alpaca.json").write_text(json.dumps(
        [{"instruction": f"What is {i} plus 2?", "input": "" if i % 2 else "carefully", "output": f"{i + 2}"} for i in range(12)]))
    for fmt, data in (("sharegpt", "chat.jsonl"), ("alpaca", "alpaca.json")):
        cfg = tmp_path / f"{fmt}.yaml"
        cfg.write_text(f"""\
name: {fmt}
task:
  name: causal_lm
  options: {{model: {llama_dir}, data: {tmp_path / data}, format: {fmt}, max_length: 96}}
method: {{name: fedgalore, rank: 4}}
federation: {{num_clients: 2, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_steps: 1}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
        assert main(["run", "--config", str(cfg)]) == 0, capsys.readouterr().err
        run = tmp_path / "runs" / f"{fmt}-fedgalore-iid-s0"
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert math.isfinite(metrics[-1]["train_loss"]) and math.isfinite(metrics[-1]["eval/loss"])
        assert json.loads((run / "task.json").read_text())["format"] == fmt


def test_format_options_are_typed():
    opts = parse_task_options("causal_lm", {"data": "x.json", "format": "alpaca"})
    assert opts.columns().prompt == "instruction" and opts.columns().input == "input" and opts.columns().response == "output"
    assert parse_task_options("causal_lm", {"data": "x.jsonl", "format": "sharegpt"}).columns().messages == "conversations"
    assert parse_task_options("causal_lm", {"data": "x.jsonl", "format": "messages"}).columns().messages == "messages"
    assert parse_task_options("causal_lm", {"data": "x", "template": "Q: {q}", "response_column": "a"}).resolved_format() == "template"
    with pytest.raises(TaskError, match=r"task\.options\.train_on='first' must be one of 'last', 'all_assistant_turns'"):
        parse_task_options("causal_lm", {"data": "x.jsonl", "format": "sharegpt", "train_on": "first"})


# ============================================================================ 2. files as people have them
def excel_csv(path, df, encoding="utf-8-sig", sep=";") -> None:
    path.write_bytes(df.to_csv(index=False, sep=sep, lineterminator="\r\n").encode(encoding))


def text_task(bert_dir, data, **kw):
    opts = {"text_column": "body", "label_column": "topic", "max_length": 16, **kw}
    return get_task("text_classification", model=str(bert_dir), data=data if isinstance(data, dict) else str(data), **opts)


def test_semicolon_csv_with_a_bom_is_sniffed_and_said_once(tmp_path, bert_dir, caplog):
    df = news_rows(60)
    df["body"] = df["body"].str.replace(" ", ", ", n=1)  # commas in the text: a comma-split would break
    excel_csv(tmp_path / "excel.csv", df)
    plain = tmp_path / "plain.csv"
    write(df, plain)
    with caplog.at_level(logging.WARNING):
        task = text_task(bert_dir, tmp_path / "excel.csv")
        again = text_task(bert_dir, tmp_path / "excel.csv")
        text_task(bert_dir, plain)
    assert task._rows["train"].columns == ["body", "topic", "site"]  # no BOM in the first column's name
    assert sorted(list(task._rows["train"].data["body"]) + list(task._rows["test"].data["body"])) == sorted(df["body"])
    assert _texts(task) == _texts(again) == _texts(text_task(bert_dir, plain))
    said = [r.getMessage() for r in caplog.records if "sniffed" in r.getMessage()]
    assert said == ["excel.csv: read with delimiter ';', encoding utf-8-sig (sniffed; task.options.csv: {delimiter, encoding} sets them)"]
    # given, nothing is sniffed or said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        given = text_task(bert_dir, tmp_path / "excel.csv", csv={"delimiter": ";", "encoding": "utf-8-sig"})
    assert _texts(given) == _texts(task) and not [r for r in caplog.records if "sniffed" in r.getMessage()]


def _texts(task) -> list[str]:
    ex = task._examples("train")
    return [f"{t}|{y}" for t, y in zip(ex.text, ex.labels)]


def test_cp1252_tsv_and_quotechar(tmp_path, bert_dir, caplog):
    df = news_rows(60)
    df["body"] = df["body"] + " café naïve"
    excel_csv(tmp_path / "win.csv", df, encoding="cp1252", sep=",")
    with caplog.at_level(logging.WARNING):
        task = text_task(bert_dir, tmp_path / "win.csv")
    assert all(b.endswith("café naïve") for b in task._rows["train"].data["body"])
    assert any("win.csv: read with delimiter ',', encoding cp1252 (sniffed" in r.getMessage() for r in caplog.records)
    df2 = news_rows(60)
    df2["body"] = df2["body"] + "; more"
    (tmp_path / "q.csv").write_text(df2.to_csv(index=False, sep=";", quotechar="'", quoting=1))  # 'a b; more';'sport';'s1'
    q = text_task(bert_dir, tmp_path / "q.csv", csv={"delimiter": ";", "quotechar": "'"})
    assert all(b.endswith("; more") for b in q._rows["train"].data["body"])
    with pytest.raises(TaskError, match=r"task\.options\.csv\.delimiter=';;' must be one character"):
        parse_task_options("text_classification", {"data": "x.csv", "csv": {"delimiter": ";;"}})
    with pytest.raises(TaskError, match=r"task\.options\.csv\.encoding='utf-9' is not an encoding Python knows"):
        parse_task_options("text_classification", {"data": "x.csv", "csv": {"encoding": "utf-9"}})


def test_a_parse_error_shows_the_parsers_own_line(tmp_path, bert_dir):
    df = news_rows(30)
    df["body"] = [f"{b}, and more{', x' * (i % 3)}" for i, b in enumerate(df["body"])]
    excel_csv(tmp_path / "excel.csv", df)
    with pytest.raises(TaskError) as exc:  # a wrong delimiter given: the rows have 3 to 5 comma-fields
        text_task(bert_dir, tmp_path / "excel.csv", csv={"delimiter": ","})
    msg = str(exc.value)
    assert "\n" not in msg and "DatasetGenerationError" not in msg
    assert "could not read excel.csv as .csv (ParserError: Error tokenizing data. C error: Expected " in msg
    assert msg.endswith("read with delimiter ',', encoding utf-8-sig (sniffed); set task.options.csv: {delimiter, encoding, "
                        "quotechar} if that is not how the file is written"), msg


def test_drop_empty_rows(tmp_path, bert_dir, llama_dir, caplog):
    df = news_rows(60).astype({"body": object, "topic": object})
    df.loc[[4, 9], "body"] = ""
    df.loc[[13], "topic"] = None
    write(df, tmp_path / "holes.csv")
    with pytest.raises(TaskError, match=r"holes\.csv: 2 rows have an empty or NaN text in column 'body' \(first: row 5\); "
                                        r"fill or drop those rows, or set task\.options\.drop_empty: true$"):
        text_task(bert_dir, tmp_path / "holes.csv")
    with caplog.at_level(logging.WARNING):
        task = text_task(bert_dir, tmp_path / "holes.csv", drop_empty=True)
        task.build_model()
    assert len(task.train_set()) + len(task.test_set()) == 57
    kept = sorted(task._rows["train"].index.tolist() + task._rows["test"].index.tolist())
    assert kept == [i for i in range(60) if i not in (4, 9, 13)]  # rows keep their file row numbers
    said = [r.getMessage() for r in caplog.records if "drop_empty" in r.getMessage()]
    assert said == ["holes.csv: dropped 3 of 60 rows with an empty or NaN value in column(s) body, topic (task.options.drop_empty)"]
    # alpaca: an empty input is no hole; an empty output is
    rows = [{"instruction": f"Say {i}.", "input": "", "output": "" if i == 3 else str(i)} for i in range(10)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    t = get_task("causal_lm", model=str(llama_dir), data=str(tmp_path / "a.json"), format="alpaca", drop_empty=True)
    assert len(t.train_set()) + len(t.test_set()) == 9


def test_integral_float_labels_are_classes_and_fractions_regression(tmp_path, bert_dir, caplog):
    df = news_rows(60).assign(stars=lambda d: np.array([0.0, 1.0, 3.0])[np.arange(60) % 3])
    write(df, tmp_path / "stars.csv")  # written "0.0", "1.0", "3.0": read back as floats
    with caplog.at_level(logging.WARNING):
        task = text_task(bert_dir, tmp_path / "stars.csv", label_column="stars")
        task.build_model()
    assert not task.regression and task.label_names() == ["0", "1", "3"] and task.primary_metric == "accuracy"
    said = [r.getMessage() for r in caplog.records if "whole numbers" in r.getMessage()]
    assert said == ["text_classification: column 'stars' holds whole numbers stored as floats (3.0): 3 classes (0, 1, 3); "
                    "set task.options.regression: true for regression"]
    assert text_task(bert_dir, tmp_path / "stars.csv", label_column="stars", regression=True).regression
    # an empty cell makes pandas read integers as floats: dropped, the rest are still classes
    holes = df.astype({"stars": object})
    holes.loc[5, "stars"] = None
    write(holes, tmp_path / "holes.csv")
    assert text_task(bert_dir, tmp_path / "holes.csv", label_column="stars", drop_empty=True).label_names() == ["0", "1", "3"]
    caplog.clear()
    write(df.assign(stars=df["stars"] + 0.5 * (np.arange(60) % 2)), tmp_path / "scores.csv")
    with caplog.at_level(logging.WARNING):
        reg = text_task(bert_dir, tmp_path / "scores.csv", label_column="stars")
    assert reg.regression and reg.primary_metric == "mse"
    said = [r.getMessage() for r in caplog.records if "regression" in r.getMessage()]
    assert said == ["text_classification: column 'stars' holds numbers with a fractional part (e.g. 1.5): regression (one "
                    "output, MSE; metrics mse, pearson, spearman); set task.options.regression: false to treat its values as classes"]


# ============================================================================ min_client_size
def _site_cfg(tmp_path, data, **partition):
    from fedgalore.job.config import FederatedConfig

    return FederatedConfig.from_dict({
        "name": "sites",
        "task": {"name": "text_classification", "options": {"data": data, "text_column": "body", "label_column": "topic",
                                                            "max_length": 16}},
        "method": {"name": "fedavg_full", "rank": 4},
        "federation": {"clients_per_round": None, "rounds": 1, "partition": partition},
        "train": {"lr": 1.0e-3, "batch_size": 4, "local_steps": 1},
        "output": {"dir": str(tmp_path / "runs"), "progress": "quiet"},
    })


def test_min_client_size_drops_small_sites_one_line_each(tmp_path, bert_dir, caplog):
    from fedgalore.job.clients import resolve_clients, split_clients
    from fedgalore.job.config import ConfigError

    df = news_rows(63)
    df.loc[60:, "site"] = "tiny"  # a 3-row site
    write(df, tmp_path / "news.csv")
    task = text_task(bert_dir, tmp_path / "news.csv")
    n_tiny_train = int(np.sum(task.partition_values("site") == "tiny"))
    assert 1 <= n_tiny_train <= 3
    cfg = _site_cfg(tmp_path, str(tmp_path / "news.csv"), kind="natural", column="site", min_client_size=5)
    with caplog.at_level(logging.WARNING):
        clients = split_clients(cfg, task)
        split_clients(cfg, task)  # the split is drawn again (a preview, then the run): said once
    assert clients.names == ["s0", "s1", "s2", "s3"] and clients.dropped == [("tiny", n_tiny_train)]
    assert [r.getMessage() for r in caplog.records if "min_client_size" in r.getMessage()] == [
        f"federation.partition.min_client_size=5: dropped site 'tiny' ({n_tiny_train} training examples); its examples are not trained on"]
    sites = task.partition_values("site")
    assert all((sites[p] == n).all() for p, n in zip(clients.parts, clients.names))
    assert resolve_clients(cfg, clients).federation.num_clients == 4
    # the saved config.yaml records 4 clients: splitting again with it gives the same clients
    again = _site_cfg(tmp_path, str(tmp_path / "news.csv"), kind="natural", column="site", min_client_size=5)
    again.federation.num_clients = 4
    assert split_clients(again, task).names == clients.names
    again.federation.num_clients = 5
    with pytest.raises(ConfigError, match=r"federation\.num_clients=5, but the partition has 4 site values with at least "
                                          r"federation\.partition\.min_client_size=5 training examples \(1 dropped\)"):
        split_clients(again, task)
    with pytest.raises(ConfigError, match=r"min_client_size=100 leaves 0 of 5 site values .* a federation needs 2"):
        split_clients(_site_cfg(tmp_path, "x", kind="natural", column="site", min_client_size=100), task)
    with pytest.raises(ConfigError, match=r"min_client_size drops small sites of kinds natural and files .*kind dirichlet"):
        _site_cfg(tmp_path, "x", kind="dirichlet", alpha=0.5, min_client_size=5)
    # without it, the batch-size refusal names min_client_size as the way out
    small = _site_cfg(tmp_path, "x", kind="natural", column="site")
    small.train.batch_size = 8
    with pytest.raises(ConfigError, match=r"client\(s\) 'tiny' \(\d\) hold fewer training examples than one batch .*"
                                          r"federation\.partition\.min_client_size: 8 drops the ones smaller than that"):
        split_clients(small, task)


def test_min_client_size_with_per_site_files_through_the_cli(tmp_path, bert_dir, capsys, caplog):
    """Per-site files (kind files): the 3-row site is dropped by `fedgalore partition` and the run
    alike; partition.json lists it under ``dropped``."""
    from fedgalore.cli import main

    for site, n in (("a", 30), ("b", 30), ("c", 3)):
        write(news_rows(n, seed=len(site) + n).drop(columns=["site"]), tmp_path / f"{site}.csv")
    cfg = tmp_path / "sites.yaml"
    cfg.write_text(f"""\
name: sites
task:
  name: text_classification
  options:
    model: {bert_dir}
    text_column: body
    label_column: topic
    max_length: 16
    labels: [politics, sport, tech]
    data: {{sites: {{a: {tmp_path / 'a.csv'}, b: {tmp_path / 'b.csv'}, c: {{train: {tmp_path / 'c.csv'}, test: {tmp_path / 'a.csv'}}}}}}}
method: {{name: fedavg_full, rank: 4}}
federation: {{partition: {{kind: files, min_client_size: 8}}, clients_per_round: null, rounds: 1}}
train: {{lr: 1.0e-3, batch_size: 8, local_steps: 1}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
""")
    with caplog.at_level(logging.WARNING):
        assert main(["partition", "--config", str(cfg)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "partition files: 2 clients" in out and "dropped (min_client_size 8): c (3)" in out
    assert any("federation.partition.min_client_size=8: dropped site 'c' (3 training examples)" in r.getMessage()
               for r in caplog.records)
    assert main(["run", "--config", str(cfg)]) == 0, capsys.readouterr().err
    rec = json.loads((tmp_path / "runs" / "sites-fedavg_full-files-s0" / "partition.json").read_text())
    assert rec["client_names"] == ["a", "b"] and rec["dropped"] == [{"name": "c", "size": 3}]
    assert rec["options"] == {"min_client_size": 8}


# ============================================================================ docs/data.md, as written
DATA_MD = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "data.md"


def _section_blocks(title: str, lang: str) -> list[str]:
    import re

    text = DATA_MD.read_text()
    start = text.index(title)
    section = text[start:text.index("\n## ", start + 1)]
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", section, re.S) if m.group(1) == lang]


def _commands(title: str) -> list[list[str]]:
    import re
    import shlex

    return [shlex.split(re.sub(r"\s+#\s.*$", "", line)) for bash in _section_blocks(title, "bash")
            for line in bash.strip().splitlines()]  # every bash block of the section, in order


TINY = ["federation.rounds=1", "train.local_steps=1", "output.progress=quiet", "method.rank=4"]


def test_data_md_formats_section_runs_as_written(tmp_path, monkeypatch, llama_dir, capsys):
    """The formats section's Python writes alpaca.json, chat.jsonl and messages.jsonl; its YAML,
    saved as the text says, runs by its commands (on the tiny Llama, one local step)."""
    from fedgalore.cli import main

    title = "## Instruction formats: `format`"
    monkeypatch.chdir(tmp_path)
    (code,) = _section_blocks(title, "python")
    exec(compile(code, str(DATA_MD), "exec"), {})  # noqa: S102 - the documentation's own example
    alpaca = json.loads((tmp_path / "alpaca.json").read_text())
    assert len(alpaca) == 60 and sum(r["input"] == "" for r in alpaca) == 30
    assert [json.loads(x)["conversations"][1]["from"] for x in (tmp_path / "chat.jsonl").read_text().splitlines()] == ["human"] * 60
    yamls = _section_blocks(title, "yaml")
    assert [__import__("re").search(r"^name: (\w+)", y).group(1) for y in yamls] == ["alpaca", "chat"]
    for y in yamls:
        (tmp_path / f"{y.split()[1]}.yaml").write_text(y)
    commands = _commands(title)
    assert [c[:4] for c in commands] == [["fedgalore", "run", "--config", "alpaca.yaml"], ["fedgalore", "run", "--config", "chat.yaml"],
                                         ["fedgalore", "run", "--config", "chat.yaml"]]
    for cmd in commands:
        assert main(cmd[1:] + TINY + [f"task.options.model={llama_dir}"]) == 0, (cmd, capsys.readouterr().err)
    for run, fmt in (("alpaca", "alpaca"), ("chat", "sharegpt"), ("messages", "messages")):
        folder = tmp_path / "runs" / f"{run}-fedgalore-iid-s0"
        assert json.loads((folder / "task.json").read_text())["format"] == fmt
        assert math.isfinite(json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["eval/loss"])
    # the same conversations as ShareGPT and as messages: the same loss
    loss = {r: json.loads((tmp_path / "runs" / f"{r}-fedgalore-iid-s0" / "metrics.jsonl").read_text().splitlines()[-1])["eval/loss"]
            for r in ("chat", "messages")}
    assert loss["chat"] == pytest.approx(loss["messages"], rel=1e-6)


def test_data_md_files_section_runs_as_written(tmp_path, monkeypatch, bert_dir, capsys, caplog):
    """The files section's Python turns a news.csv into an Excel-style excel.csv (semicolons, a
    byte-order mark, empty texts, a 3-row site); its YAML and commands run as written."""
    from fedgalore.cli import main

    title = "## Files as people have them"
    monkeypatch.chdir(tmp_path)
    write(news_rows(120), tmp_path / "news.csv")  # docs/data.md writes it from BBC News; these rows have its columns
    code, *later = _section_blocks(title, "python")  # the file, then (for predict) a Windows-saved copy of it
    exec(compile(code, str(DATA_MD), "exec"), {})  # noqa: S102 - the documentation's own example
    raw = (tmp_path / "excel.csv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfbody;topic;site\r\n")
    (y,) = _section_blocks(title, "yaml")
    (tmp_path / "excel.yaml").write_text(y)
    tiny = TINY + [f"task.options.model={bert_dir}", "task.options.max_length=16", "train.batch_size=8",
                   "federation.clients_per_round=2"]
    cmds = _commands(title)
    after = [c for c in cmds if c[1] in ("predict", "evaluate")]  # on the trained run, as written
    with caplog.at_level(logging.WARNING):
        for cmd in [c for c in cmds if c not in after]:
            assert main(cmd[1:] + tiny) == 0, (cmd, capsys.readouterr().err)
    said = [r.getMessage() for r in caplog.records]
    for block in later:
        exec(compile(block, str(DATA_MD), "exec"), {})  # noqa: S102
    for cmd in after:
        assert main(cmd[1:]) == 0, (cmd, capsys.readouterr().err)
    out = (tmp_path / "excel-predictions.csv").read_bytes()  # written as excel.csv is: ';', a byte-order mark, CRLF
    assert out.startswith(b"\xef\xbb\xbfbody;topic;site;") and b"\r\n" in out[:400]
    assert "excel.csv: dropped 3 of 120 rows with an empty or NaN value in column(s) body, topic (task.options.drop_empty)" in said
    assert any(m.startswith("federation.partition.min_client_size=16: dropped site 'lakeview' (") for m in said)
    rec = json.loads((tmp_path / "runs" / "excel-fedgalore-naturalsite-s0" / "partition.json").read_text())
    assert rec["client_names"] == ["s0", "s1", "s2", "s3"] and rec["dropped"][0]["name"] == "lakeview"
    # without the csv option the same file is sniffed, and said so
    caplog.clear()
    (tmp_path / "sniffed.yaml").write_text(y.replace("name: excel", "name: sniffed").replace(
        '    csv: {delimiter: ";", encoding: utf-8-sig}   # left out: sniffed from the file, said once\n', ""))
    with caplog.at_level(logging.WARNING):
        assert main(["partition", "--config", "sniffed.yaml"] + tiny) == 0
    assert "excel.csv: read with delimiter ';', encoding utf-8-sig (sniffed; task.options.csv: {delimiter, encoding} sets them)" in [
        r.getMessage() for r in caplog.records]


def test_the_float_label_note_names_the_columns_own_values(tmp_path, bert_dir, caplog):
    """Labels 0.0/1.0/2.0 are named as the file wrote them: "(2.0)", not a made-up "(3.0)"."""
    df = news_rows(30).assign(triage=lambda d: np.array([0.0, 1.0, 2.0])[np.arange(30) % 3])
    write(df, tmp_path / "triage.csv")
    with caplog.at_level(logging.WARNING):
        text_task(bert_dir, tmp_path / "triage.csv", label_column="triage").build_model()
    said = [r.getMessage() for r in caplog.records if "whole numbers" in r.getMessage()]
    assert len(said) == 1 and "stored as floats (2.0): 3 classes (0, 1, 2)" in said[0]


def _smollm2_dir():
    try:
        from fedgalore.tasks.assets import cache_dir

        d = cache_dir() / "smollm2-135m-instruct"
        return d if (d / "tokenizer_config.json").is_file() else None
    except Exception:
        return None


_SMOLLM2 = _smollm2_dir()  # resolved at import (tests may point the cache elsewhere)


@pytest.mark.skipif(_SMOLLM2 is None, reason="SmolLM2 not cached (make setup)")
def test_a_templates_own_system_prompt_is_said_once_and_system_prompt_chooses_it(tmp_path, caplog):
    """SmolLM2's chat template adds "You are a helpful AI assistant named SmolLM..." to every row
    without a system turn: the run says so once; task.options.system_prompt replaces it, and a row's
    own system turn is kept as it is."""
    from fedgalore.tasks import get_task

    rows = [{"instruction": f"Water the tomatoes {i}?", "input": "", "output": "Yes."} for i in range(8)]
    (tmp_path / "garden.json").write_text(json.dumps(rows))
    with caplog.at_level(logging.WARNING):
        plain = get_task("causal_lm", model=str(_SMOLLM2), data=str(tmp_path / "garden.json"), format="alpaca")
    said = [r.getMessage() for r in caplog.records if "adds its own system prompt" in r.getMessage()]
    assert len(said) == 1 and "task.options.system_prompt" in said[0]
    assert "named SmolLM" in plain._wrap("hi")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        mine = get_task("causal_lm", model=str(_SMOLLM2), data=str(tmp_path / "garden.json"), format="alpaca",
                        system_prompt="You are a gardener.")
    assert not [r for r in caplog.records if "adds its own system prompt" in r.getMessage()]
    assert "You are a gardener." in mine._wrap("hi") and "named SmolLM" not in mine._wrap("hi")
    own = mine._render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], True)
    assert "Be brief." in own and "You are a gardener." not in own
