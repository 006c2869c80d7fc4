"""The round's stages (fedgalore.engine.stages): a new stage plugs in with one registry line and
no other change; the stages compose in registry order from the config; the round loop itself
reads no feature's config key (one room per feature)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import fedgalore
import fedgalore.engine.stages as stages
from fedgalore.engine.stages import REGISTRY, RoundStage, compose
from fedgalore.protocol.payload import Payload
from fedgalore_testing.runs import tiny_cfg

SRC = Path(fedgalore.__file__).resolve().parent


class Counting(RoundStage):
    """A stage a user might add: marks each upload at the client, counts them at the server and
    records the count with the round."""

    name = "counting"

    def __init__(self) -> None:
        self.received = 0
        self.wrapped = 0

    @classmethod
    def build(cls, cfg, runtime, run):
        return cls()

    def client_release(self, upload, broadcast, ctx):
        return Payload(upload.entries, {**upload.meta, "counting_mark": 7.0})

    def receive(self, client, upload, att, state):
        self.received += 1
        return upload, None

    def aggregate(self, state, apply):
        self.wrapped += 1
        return apply()

    def round_record(self, state, round_idx, uploads):
        out = {"counted_uploads": float(self.received)}
        self.received = 0
        return out


def test_a_new_stage_is_one_registry_line(tmp_path, monkeypatch):
    """Registering a stage (nothing else changed) runs its client and server hooks in a real run:
    the client's mark reaches every client record, the server counts each round's uploads and
    the count joins metrics.csv's round record."""
    monkeypatch.setattr(stages, "REGISTRY", (*REGISTRY, Counting))
    res = fedgalore.run(tiny_cfg(tmp_path, rounds=2))
    assert [h["counted_uploads"] for h in res.history] == [3.0, 3.0]  # clients_per_round = 3, nobody dropped
    recs = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    ups = [r for r in recs if "client" in r and "error" not in r]
    assert len(ups) == 6 and all(r["counting_mark"] == 7.0 for r in ups)


def test_stages_compose_from_the_config_in_registry_order(tmp_path):
    from fedgalore.engine.runtime import Runtime
    from fedgalore.engine.stages import RunView

    cfg = tiny_cfg(tmp_path, rounds=1, train={"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "scaffold": True},
                   federation={"num_clients": 6, "clients_per_round": 5, "rounds": 1,
                               "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
                               "robust": {"kind": "krum", "num_malicious": 1, "to_keep": 2},
                               "attack": {"clients": [0], "kind": "sign_flip"},
                               "server_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9},
                               "max_update_norm": 100.0})
    rt = Runtime(cfg)
    assert [s.name for s in rt.stages] == ["scaffold"]  # a client process: only the stages with client hooks
    view = RunView(tmp_path, rt.method, rt, print)
    both = compose(cfg, rt, view, have=rt.stages)
    assert [s.name for s in both] == ["privacy", "attack", "scaffold", "norm_guard", "robust", "server_optimizer"]
    assert both.get("scaffold") is rt.stages.get("scaffold")  # the client side's stage, not built twice
    assert [s.name for s in compose(tiny_cfg(tmp_path, rounds=1), rt, view)] == ["privacy"]  # plain FedAvg: the accountant only


#: config sections of round features; the loop must not read them (each is one stage's)
FEATURE_KEYS = {"privacy", "scaffold", "robust", "secure_aggregation", "attack", "server_optimizer", "max_update_norm",
                "clip_update_norm", "client_dp", "dp_clip", "secure_mode", "reproducible"}


def _code_names(path: Path) -> set[str]:
    """Attribute names and string constants in a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            out.add(n.value)
    return out


@pytest.mark.parametrize("module", ["engine/loop.py", "engine/collect.py"])
def test_the_round_loop_reads_no_feature_key(module):
    assert sorted(_code_names(SRC / module) & FEATURE_KEYS) == []


def test_the_feature_check_sees_a_feature_branch(tmp_path):
    bad = tmp_path / "loop.py"
    bad.write_text('"""privacy is fine in a docstring"""\ndef f(cfg):\n    if cfg.train.scaffold:\n        return cfg.privacy\n')
    assert _code_names(bad) & FEATURE_KEYS == {"scaffold", "privacy"}
