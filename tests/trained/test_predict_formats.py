"""``fedgalore predict`` reads and writes files as people have them, and ``evaluate --by`` says
which groups trained and ranks only groups large enough (issue "A practitioner's second day").

* predict reads ``--data`` with the run's ``task.options.csv`` (``--csv KEY=VALUE`` replaces a
  field), a one-column file of sentences with commas as one column, and writes a CSV the way its
  input is written: delimiter, encoding, byte-order mark, quote character, line ends; list and dict
  cells as JSON text;
* ``evaluate --by site`` gives each site's ``n`` and whether it took part in training (aggregated,
  sampled never, dropped by ``min_client_size``, not a client), and names the worst site among the
  sites of at least ``--min-group`` rows.
"""
from __future__ import annotations

import codecs
import csv
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedgalore.cli import main
from fedgalore.trained.evaluate import MIN_GROUP, evaluate
from fedgalore.trained.global_model import load_global_model
from fedgalore.trained.predict import _read, predict
from fedgalore.tasks import get_task
from fedgalore_testing.models import _loaded  # noqa: E402
from fedgalore_testing.assets import news_rows, write  # noqa: E402


# a run whose files are written as a European Excel writes them: ';', a byte-order mark, CRLF, and
# here quoted with ' (so that a ';' inside a text is only read right with the run's csv options)
RUN = """\
name: clinics
task:
  name: text_classification
  options:
    model: {model}
    data: {{train: {train}, test: {test}}}
    csv: {{delimiter: ";", quotechar: "'"}}
    text_column: body
    label_column: topic
    max_length: 16
method: {{name: fedavg_full, rank: 4}}
federation:
  rounds: 1
  clients_per_round: 1
  partition: {{kind: natural, column: site, min_client_size: 5}}
train: {{lr: 1.0e-3, batch_size: 8, local_steps: 1}}
output: {{dir: {out}, progress: quiet}}
"""
NORD, SUD, PETIT, EST = "Hôpital Nord", "Clinique Sud", "Cabinet Petit", "Hôpital Est"


def _excel(df: pd.DataFrame, path: Path, *, delimiter: str = ";", quotechar: str = "'", encoding: str = "utf-8-sig",
           newline: str = "\r\n") -> Path:
    """``df`` written by the csv module as given (None cells empty)."""
    buf = io.StringIO(newline="")
    out = csv.writer(buf, delimiter=delimiter, quotechar=quotechar, lineterminator=newline)
    out.writerow(list(df.columns))
    for row in df.itertuples(index=False):
        out.writerow(["" if v is None or (isinstance(v, float) and np.isnan(v)) else v for v in row])
    path.write_bytes(buf.getvalue().encode(encoding))
    return path


def _rows(n: int, site: str, seed: int) -> pd.DataFrame:
    df = news_rows(n, seed=seed)
    df["site"] = site
    df["body"] = [b + ("; see note" if i % 4 == 0 else "") for i, b in enumerate(df["body"])]  # a ';' inside a text
    return df


@pytest.fixture(scope="module")
def clinics(tmp_path_factory, bert_dir):
    """A one-round run on ';'/BOM/CRLF/'-quoted files: sites Nord and Sud (20 training rows each),
    Petit (3 rows: dropped by min_client_size=5); one client of two sampled. The test file adds a
    site Est that no client holds."""
    import fedgalore

    root = tmp_path_factory.mktemp("clinics")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDGALORE_CACHE", str(root / "cache"))
        train = pd.concat([_rows(20, NORD, 1), _rows(20, SUD, 2), _rows(3, PETIT, 3)], ignore_index=True)
        test = pd.concat([_rows(22, NORD, 4), _rows(21, SUD, 5), _rows(4, PETIT, 6), _rows(5, EST, 7)], ignore_index=True)
        _excel(train, root / "train.csv")
        _excel(test, root / "test.csv")
        (root / "clinics.yaml").write_text(RUN.format(model=bert_dir, train=root / "train.csv", test=root / "test.csv",
                                                      out=root / "runs"))
        res = fedgalore.run(fedgalore.load_config(root / "clinics.yaml"))
    return root, res.run_dir, test


def _new_rows(test: pd.DataFrame) -> pd.DataFrame:
    """Rows to predict: the test texts and sites, an id with an empty cell, an empty note, no label."""
    df = test[["body", "site"]].head(9).copy()
    df.loc[2, "body"] = ""  # an empty text
    df["id"] = [str(i) if i != 5 else "" for i in range(len(df))]
    df["note"] = ["" if i % 3 else "à voir; urgent" for i in range(len(df))]
    return df


def test_predict_reads_with_the_runs_csv_options_and_writes_like_its_input(clinics, monkeypatch, capsys):
    """';', BOM, CRLF, ' quotes: read with the run's csv options, written back the same way, every
    input cell as it was (empty cells empty, ids integers); the predictions are the run's model's."""
    root, run_dir, test = clinics
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    new = _new_rows(test)
    data = _excel(new, root / "new.csv")
    assert main(["predict", str(run_dir), "--data", str(data), "--out", str(root / "pred.csv"), "--progress", "quiet"]) == 0
    raw = (root / "pred.csv").read_bytes()
    assert raw.startswith(codecs.BOM_UTF8) and not raw.startswith(codecs.BOM_UTF8 * 2)
    assert raw.count(b"\r\n") == raw.count(b"\n") == len(new) + 1  # every line ends with CRLF, no bare LF
    text = raw.decode("utf-8-sig")
    header = text.split("\r\n")[0]
    g = load_global_model(run_dir)
    names = g.task.label_names()
    assert header == ";".join(["body", "site", "id", "note", "predicted_label", "predicted_probability"] + [f"prob_{n}" for n in names])
    got = list(csv.reader(io.StringIO(text, newline=""), delimiter=";", quotechar="'"))
    assert [r[:4] for r in got[1:]] == new.astype(str).values.tolist()  # the input cells exactly: '' stays '', 5 not 5.0
    assert "'" + new["body"][0] + "'" in text  # a ';' inside a text is quoted with the input's quote character
    # the same predictions as the model gives these texts
    ids, _ = g.task.predict(g.model, g.task.encode_texts(new["body"].tolist()), 64)
    assert [r[4] for r in got[1:]] == [names[i] for i in ids]
    probs = np.asarray([[float(x) for x in r[6:]] for r in got[1:]])
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-9)
    np.testing.assert_allclose([float(r[5]) for r in got[1:]], probs.max(1), rtol=1e-12)
    # the output is read back by the same reader with the same options
    back = pd.read_csv(root / "pred.csv", sep=";", quotechar="'", encoding="utf-8-sig", keep_default_na=False, dtype=str)
    assert back["site"].tolist() == new["site"].tolist() and back["note"].tolist() == new["note"].tolist()


def test_predict_csv_options_from_the_command_line(clinics, monkeypatch, capsys):
    """--csv KEY=VALUE replaces the run's field: a ','-separated, '"'-quoted, cp1252 file (no BOM,
    LF) predicted by the ';' run is read and written back in cp1252 with ',' and LF."""
    root, run_dir, test = clinics
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    new = _new_rows(test)
    data = _excel(new, root / "win.csv", delimiter=",", quotechar='"', encoding="cp1252", newline="\n")
    out = root / "win-pred.csv"
    # with the run's delimiter ';' and quote ' the file is not read as written: one error line
    assert main(["predict", str(run_dir), "--data", str(data), "--out", str(out)]) == 2
    assert len([x for x in capsys.readouterr().err.splitlines() if x.strip()]) == 1 and not out.exists()
    assert main(["predict", str(run_dir), "--data", str(data), "--out", str(out),
                 "--csv", "delimiter=,", "--csv", 'quotechar="']) == 0
    raw = out.read_bytes()
    assert not raw.startswith(codecs.BOM_UTF8) and b"\r\n" not in raw and raw.count(b"\n") == len(new) + 1
    assert "Hôpital Nord".encode("cp1252") in raw and "Hôpital Nord".encode("utf-8") not in raw  # cp1252 in, cp1252 out
    back = pd.read_csv(out, encoding="cp1252", keep_default_na=False, dtype=str)
    assert back[["body", "site", "id", "note"]].values.tolist() == new.astype(str).values.tolist()
    # a malformed --csv is one line saying what to give
    for bad, expect in [(["--csv", "delim=;"], "give KEY=VALUE with KEY one of delimiter, encoding, quotechar"),
                        (["--csv", "delimiter=;;"], "--csv delimiter=';;' must be one character"),
                        (["--csv", "encoding=klingon"], "--csv encoding='klingon' is not an encoding Python knows")]:
        assert main(["predict", str(run_dir), "--data", str(data), "--out", str(root / "x.csv"), *bad]) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and expect in lines[0], lines


def test_a_one_column_file_of_sentences_with_commas(tmp_path, bert_dir, monkeypatch):
    """A header of one name and sentences with commas (unquoted, some quoted): one column, each line
    whole; written back as a ',' CSV that reads back to the same sentences."""
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    labelled = write(pd.DataFrame({"text": ["vote party", "goal match", "chip phone"] * 4,
                                   "label": ["politics", "sport", "tech"] * 4}), tmp_path / "train.csv")
    task = get_task("text_classification", model=str(bert_dir), data=str(labelled), max_length=16)
    loaded = _loaded(monkeypatch, task)
    sentences = ["Hello, world, again", "no comma here", "a, b, c, d, e", 'quoted, "as a spreadsheet" does', "Ça va, merci"]
    lines = ["text", *sentences[:3], '"quoted, ""as a spreadsheet"" does"', sentences[4]]
    data = tmp_path / "sentences.csv"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = predict("ignored", data, tmp_path / "out.csv")
    assert res.rows == len(sentences)
    back = pd.read_csv(tmp_path / "out.csv")
    assert back["text"].tolist() == sentences
    ids, _ = task.predict(loaded.model, task.encode_texts(sentences), 64)
    assert back["predicted_label"].tolist() == [task.label_names()[i] for i in ids]
    assert (tmp_path / "out.csv").read_text(encoding="utf-8").splitlines()[0].startswith("text,predicted_label,")
    # the same file with a byte-order mark, utf-8 given: read as utf-8-sig (the column is 'text', not '\ufefftext')
    bom = tmp_path / "bom.csv"
    bom.write_bytes(codecs.BOM_UTF8 + data.read_bytes())
    predict("ignored", bom, tmp_path / "bom-out.csv", csv={"encoding": "utf-8"})
    raw = (tmp_path / "bom-out.csv").read_bytes()
    assert raw.startswith(codecs.BOM_UTF8) and pd.read_csv(tmp_path / "bom-out.csv", encoding="utf-8-sig")["text"].tolist() == sentences


def test_list_and_dict_cells_are_written_as_json(tmp_path, bert_dir, monkeypatch):
    """A JSONL input's list and dict columns become JSON text in a CSV (parsed back: the same values);
    a .jsonl output keeps them as JSON values."""
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    labelled = write(pd.DataFrame({"text": ["vote party", "goal match", "chip phone"] * 4,
                                   "label": ["politics", "sport", "tech"] * 4}), tmp_path / "train.csv")
    _loaded(monkeypatch, get_task("text_classification", model=str(bert_dir), data=str(labelled), max_length=16))
    records = [{"text": "vote, party", "tags": ["a,b", "é"], "meta": {"site": NORD, "k": [1, 2]}},
               {"text": "goal", "tags": [], "meta": {"site": SUD, "k": []}}]
    data = tmp_path / "new.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    predict("ignored", data, tmp_path / "out.csv")
    text = (tmp_path / "out.csv").read_text(encoding="utf-8")
    assert "array(" not in text and "{'" not in text  # no numpy or Python repr
    back = list(csv.DictReader(io.StringIO(text, newline="")))
    assert [json.loads(r["tags"]) for r in back] == [r["tags"] for r in records]
    assert [json.loads(r["meta"]) for r in back] == [r["meta"] for r in records]
    predict("ignored", data, tmp_path / "out.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["tags"] for r in rows] == [r["tags"] for r in records] and [r["meta"] for r in rows] == [r["meta"] for r in records]


def test_chat_messages_in_a_csv_are_json(tmp_path, llama_dir, monkeypatch):
    """causal_lm: a conversation ending with the user's turn, predicted into a CSV: its ``messages``
    cell parses back to the same list of turns."""
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    conv = [{"messages": [{"role": "user", "content": f"{a}, plus {a}?"}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(8)]
    task = get_task("causal_lm", model=str(llama_dir), data=str(write(pd.DataFrame(conv), tmp_path / "chats.jsonl")),
                    messages_column="messages", max_length=64, max_new_tokens=2)
    loaded = _loaded(monkeypatch, task)
    asks = [[{"role": "user", "content": "Bonjour, ça va?"}], [{"role": "user", "content": 'say "1, 2"'}]]
    data = tmp_path / "ask.jsonl"
    data.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in asks), encoding="utf-8")
    predict("ignored", data, tmp_path / "gen.csv", batch_size=1)
    back = list(csv.DictReader(io.StringIO((tmp_path / "gen.csv").read_text(encoding="utf-8"), newline="")))
    assert [json.loads(r["messages"]) for r in back] == asks
    rows, _ = _read(data)
    assert [r["generation"] for r in back] == task.generate(loaded.model, task.prediction_prompts(rows))


def test_evaluate_by_site_says_who_trained_and_ranks_large_groups(clinics, monkeypatch, capsys):
    root, run_dir, test = clinics
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    assert MIN_GROUP == 20
    ev = evaluate(run_dir, by="site")
    sizes = test["site"].value_counts().to_dict()
    assert {n: g["n"] for n, g in ev.groups.items()} == sizes and ev.min_group == 20
    # clients.jsonl: the one client sampled in round 1; the other site is a client never aggregated
    (rec,) = [json.loads(x) for x in (Path(run_dir) / "clients.jsonl").read_text().splitlines()]
    trained = rec["client_name"]
    other = ({NORD, SUD} - {trained}).pop()
    assert ev.training == {trained: "yes", other: "not aggregated", PETIT: "dropped", EST: "no"}
    # the worst among the groups of >= 20 rows (Nord 22, Sud 21); Petit (4) and Est (5) are not ranked
    acc = {n: g["accuracy"] for n, g in ev.groups.items()}
    assert ev.worst == min([NORD, SUD], key=acc.get)
    assert evaluate(run_dir, by="site", min_group=1).worst == min(acc, key=acc.get)
    assert evaluate(run_dir, by="site", min_group=23).worst is None
    assert main(["evaluate", str(run_dir), "--by", "site"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = {n: next(x for x in lines if x.startswith(f"  {n} ")) for n in sizes}
    for n, state in ev.training.items():
        assert row[n].split()[len(n.split())] == str(sizes[n]) and f" {state} " in row[n]
    assert f"worst site (by the task's primary metric): {ev.worst} (accuracy=" in out
    assert "among the 2 groups with n >= 20 (--min-group 20; 2 smaller groups not ranked)" in out
    assert "dropped = a site federation.partition.min_client_size dropped" in out
    assert main(["evaluate", str(run_dir), "--by", "site", "--min-group", "30"]) == 0
    assert "worst site: none named, no group has n >= 30 test rows (--min-group 30" in capsys.readouterr().out
    assert main(["evaluate", str(run_dir), "--by", "site", "--json", "--min-group", "4"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["min_group"] == 4 and js["training"] == ev.training and js["groups"][EST]["n"] == 5
    assert js["worst"] == min([NORD, SUD, PETIT, EST], key=acc.get)
    for bad, expect in [(["--by", "site", "--min-group", "0"], "--min-group 0 must be a whole number >= 1"),
                        (["--min-group", "5"], "--min-group 5 ranks the groups of --by COLUMN: give --by too")]:
        assert main(["evaluate", str(run_dir), *bad]) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and expect in lines[0], lines


def test_evaluate_by_a_column_that_is_not_the_clients(clinics, monkeypatch, capsys):
    """--by topic: the run's clients are its sites, so whether a topic trained is not known, and said."""
    root, run_dir, _ = clinics
    monkeypatch.setenv("FEDGALORE_CACHE", str(root / "cache"))
    ev = evaluate(run_dir, by="topic", min_group=1)
    assert ev.training == {} and ev.training_note == "not known by topic: the run's clients are its 'site' values"
    assert main(["evaluate", str(run_dir), "--by", "topic"]) == 0
    assert "trained: not known by topic: the run's clients are its 'site' values" in capsys.readouterr().out


def test_causal_predict_merges_the_lora_adapters_and_generates_the_same_text(tmp_path, llama_dir, monkeypatch):
    """A LoRA run's causal model generates after W + BA is folded in (merge_and_unload: no adapter
    matmuls at every token, the slow part on a CPU) — the same greedy text as the unmerged model."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from fedgalore.job.config import FederatedConfig
    from fedgalore.trained.evaluate import LoadedModel

    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    qa = [{"question": f"What is {a} plus {b}?", "solution": f"The answer is {a + b}"} for a in range(3) for b in range(3)]
    task = get_task("causal_lm", model=str(llama_dir), data=str(write(pd.DataFrame(qa), tmp_path / "qa.jsonl")),
                    prompt_column="question", response_column="solution", max_length=64, max_new_tokens=6)
    model = get_peft_model(task.build_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a trained adapter: B ≠ 0, so the merge changes the weights
            p.data = torch.randn(p.shape, generator=g) * 0.5
    model.eval()
    new = write(pd.DataFrame({"question": [q["question"] for q in qa[:3]]}), tmp_path / "new.csv")
    expected = task.generate(model, task.prediction_prompts(_read(new)[0]))  # unmerged
    loaded = LoadedModel(model, task, FederatedConfig.from_dict({"task": {"name": task.name}}), "lora model")
    monkeypatch.setattr("fedgalore.trained.predict.load_for_inference", lambda *a, **k: loaded)
    seen = []
    plain_generate = task.generate
    monkeypatch.setattr(task, "generate", lambda m, *a, **k: seen.append(isinstance(m, PeftModel)) or plain_generate(m, *a, **k))
    predict("ignored", new, tmp_path / "gen.jsonl", batch_size=3)
    got = [json.loads(x)["generation"] for x in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert seen == [False] and got == expected
