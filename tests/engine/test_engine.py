"""The federated engine: round loop, payloads/ledger, aggregation math, resume, pluggable methods."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import fedgalore
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.events import ProgressSink
from fedgalore.federated.seeding import round_seed, sample_clients
from fedgalore.protocol.payload import (
    Dense,
    Factored,
    GaLoreUpdate,
    Ledger,
    LowRank,
    MomentView,
    Payload,
    PayloadError,
    SeededLowRank,
    decode,
    encode,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import check_equivalence  # noqa: E402
from fedgalore_testing.runs import killed_and_resumed, strip_times, tiny_cfg  # noqa: E402


# ----------------------------------------------------------------------------- payloads
def test_payload_roundtrip_every_entry_type():
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = Payload(
        {
            "a": Dense(t(3, 4)),
            "b": LowRank(t(5, 2), t(2, 6)),
            "c": SeededLowRank(t(5, 2), 123456789012345, "right", (5, 6)),
            "d": GaLoreUpdate(-0.01, (LowRank(t(5, 2), t(2, 6)), SeededLowRank(t(5, 2), 7, "right", (5, 6))), (5, 6)),
            "e": MomentView(t(5, 2).abs(), "right", (5, 6), basis=t(2, 6)),
            "f": MomentView(t(2, 6).abs(), "left", (5, 6), seed=99),
            "g": Factored(t(5, 3), t(3, 3), t(6, 3)),
        },
        {"num_examples": 17, "loss": 0.5},
    )
    q = decode(encode(p))
    assert q.meta == p.meta and set(q.entries) == set(p.entries)
    w0 = t(5, 6)
    for k in ("a", "b", "c", "e", "f", "g"):
        assert torch.equal(q[k].materialize(), p[k].materialize())
    assert torch.equal(q["d"].materialize(w0), p["d"].materialize(w0))
    assert q["c"].seed == 123456789012345


def test_payload_decode_rejects_garbage():
    with pytest.raises(PayloadError):
        decode(b"\x00" * 4)
    with pytest.raises(PayloadError):
        decode(b"\xff" * 64)
    blob = encode(Payload({"a": Dense(torch.ones(2))}))
    with pytest.raises(PayloadError):
        decode(blob[: len(blob) // 2])


def test_ledger_counts_serialised_bytes():
    p = Payload({"a": Dense(torch.ones(10, 10)), "b": LowRank(torch.ones(10, 2), torch.ones(2, 10))})
    ledger = Ledger()
    n = ledger.record(1, 0, "up", p)
    assert n == len(encode(p))
    rec = ledger.records[0]
    assert rec["tensor_bytes"] == {"dense": 400, "lowrank": 160}
    assert rec["header_bytes"] == n - 560 > 0


def test_seeded_aggregate_equals_mean_of_dense_deltas():
    """A of factored GaLore uploads == Σ p_i ΔW_i computed densely (shared and private bases)."""
    from fedgalore.methods.fedgalore import aggregate_galore_updates

    g = torch.Generator().manual_seed(1)
    m, n, r = 12, 9, 3
    w0 = torch.randn(m, n, generator=g)
    ups = []
    for i in range(4):
        terms = (
            SeededLowRank(torch.randn(m, r, generator=g), 555, "right", (m, n)),  # shared seeded basis
            LowRank(torch.randn(m, r, generator=g), torch.linalg.qr(torch.randn(n, r, generator=g))[0].T),  # private
        )
        ups.append(GaLoreUpdate(-0.001 * (i + 1), terms, (m, n)))
    w = [0.1, 0.2, 0.3, 0.4]
    dense = sum(wi * u.materialize(w0) for wi, u in zip(w, ups))
    got = aggregate_galore_updates(ups, w, w0)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- sampling & config
def test_sampling_is_uniform_without_replacement_and_deterministic():
    a = sample_clients(0, 3, 50, 5)
    assert a == sample_clients(0, 3, 50, 5) and len(set(a)) == 5
    assert sample_clients(0, 4, 50, 5) != a
    assert sample_clients(0, 0, 4, None) == [0, 1, 2, 3]
    counts = torch.zeros(10)
    for k in range(2000):
        for c in sample_clients(1, k, 10, 3):
            counts[c] += 1
    assert counts.min() > 500 and counts.max() < 700  # expectation 600
    assert round_seed(0, 1) != round_seed(0, 2) and round_seed(0, 1) == round_seed(0, 1)


@pytest.mark.parametrize(
    "patch, msg",
    [
        ({"federation": {"num_clients": 3, "clients_per_round": 5}}, "clients_per_round"),
        ({"federation": {"partition": {"kind": "dirichlet", "alpha": 0.0}}}, "alpha"),
        ({"method": {"name": "fedavg_full", "rank": 0}}, "rank"),
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"trian": {}}, "unknown config key trian"),
        ({"federation": {"rounds": 2.5}}, "integer"),
    ],
)
def test_config_errors_are_one_clear_line(patch, msg):
    with pytest.raises(ConfigError) as exc:
        FederatedConfig.from_dict(patch)
    assert msg in str(exc.value) and "\n" not in str(exc.value)


def test_invalid_yaml_is_one_line_with_its_place(tmp_path):
    from fedgalore.job.config import load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("method:\n  name: fedgalore\n rank: 8\n")  # rank indented one space less than name
    with pytest.raises(ConfigError) as exc:
        load_config(bad)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"config file {bad} is not valid YAML: ") and "at line 3, column 2" in msg


def test_rank_larger_than_matrix_is_a_config_error(tmp_path):
    cfg = tiny_cfg(tmp_path)
    cfg.method.rank = 1000
    with pytest.raises(ConfigError, match="exceeds the smallest adapted matrix"):
        fedgalore.run(cfg)


# ----------------------------------------------------------------------------- the loop
def test_run_writes_run_directory_and_learns(tmp_path):
    cfg = tiny_cfg(tmp_path, rounds=8)
    cfg.federation.clients_per_round = 6
    cfg.train.local_epochs = 3
    res = fedgalore.run(cfg)
    d = res.run_dir
    for f in ("config.yaml", "metrics.jsonl", "metrics.csv", "clients.jsonl", "ledger.jsonl", "diagnostics.jsonl",
              "partition.json", "environment.json", "summary.json", "task.json"):
        assert (d / f).exists(), f
    s = json.loads((d / "summary.json").read_text())
    assert s["status"] == "finished" and s["rounds_completed"] == 8
    env = json.loads((d / "environment.json").read_text())
    assert env["cpu"] != "" and env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    from fedgalore.optim import cpu_kernels

    assert env["cpu_kernels"] == {"available": cpu_kernels.available(), "reason": cpu_kernels.reason()}
    first = res.history[0]["eval/accuracy"]
    assert s["final"]["accuracy"] > max(first, 0.5)  # it learns
    part = json.loads((d / "partition.json").read_text())
    assert sum(part["sizes"]) == 160 and len(part["histograms"]) == 6
    # ledger: one down + one up record per sampled client per round, bytes = serialised sizes
    ledger = [json.loads(line) for line in (d / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 8 * 6 * 2
    assert s["bytes_up_total"] == sum(r["bytes"] for r in ledger if r["direction"] == "up")
    diag = [json.loads(line) for line in (d / "diagnostics.jsonl").read_text().splitlines()]
    assert 0 <= diag[0]["tail_energy_mean"] <= 1 and diag[0]["drift_mean"] > 0


def test_diagnostics_off_skips_the_sync_mismatch_diagnostics_and_changes_no_result(tmp_path):
    """``diagnostics: false`` reaches FedGaLore's sync (round context), its clients (client
    context: no shadow cold moment, no moment numbers in the upload's meta) and the aggregate (no
    dense ΔW): none of it is computed, and the run's metrics, downlink bytes and final state are
    the same bits; the uploads are smaller by the numbers they no longer carry."""
    runs = {}
    for flag in (True, False):
        cfg = tiny_cfg(tmp_path / str(flag), method="fedgalore", rounds=2, diagnostics=flag)
        res = fedgalore.run(cfg)
        diag = [json.loads(line) for line in (res.run_dir / "diagnostics.jsonl").read_text().splitlines()]
        runs[flag] = (res, diag)
    (on, d_on), (off, d_off) = runs[True], runs[False]
    up = ("bytes_up", "cum_bytes_up")  # without diagnostics the uploads do not carry the clients' numbers
    assert [{k: v for k, v in r.items() if k not in up} for r in strip_times(on.history)] == \
        [{k: v for k, v in r.items() if k not in up} for r in strip_times(off.history)]
    assert all(0 < a["bytes_up"] - b["bytes_up"] < 2000 for a, b in zip(on.history, off.history))
    assert "mismatch_before" in d_on[0] and "mismatch_before" not in d_off[0]
    assert d_on[0]["joint_rank"] == d_off[0]["joint_rank"] > 0
    # the clients skip the shadow cold moment and the aggregate its dense ΔW: the same bits
    assert "update_norm_vs_cold" in d_on[0] and "update_norm_vs_cold" not in d_off[0]
    assert "tail_energy_mean" in d_on[0] and "tail_energy_mean" not in d_off[0]
    assert check_equivalence._state(on.run_dir)[1] == check_equivalence._state(off.run_dir)[1]  # same process: same bits


@pytest.mark.parametrize("method", ["fedavg_full", "fedgalore"])
def test_resume_equals_uninterrupted(tmp_path, method):
    opts = {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1} if method == "fedgalore" else {}
    full, resumed = killed_and_resumed(tiny_cfg(tmp_path / "a", method, rounds=4, method_options=opts),
                                       tiny_cfg(tmp_path / "b", method, rounds=4, method_options=opts))
    assert resumed.summary["bytes_up_total"] == full.summary["bytes_up_total"]


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path):
    cfg = tiny_cfg(tmp_path, rounds=3)
    full = fedgalore.run(cfg)
    d = full.run_dir
    (d / "checkpoints" / "round_0003" / "state.safetensors").write_bytes(b"garbage")
    # mark the run unfinished so resume recomputes round 3 from checkpoint 2
    s = json.loads((d / "summary.json").read_text())
    s["status"] = "running"
    (d / "summary.json").write_text(json.dumps(s))
    msgs = []

    class Rec(ProgressSink):
        def message(self, text):
            msgs.append(text)

    resumed = fedgalore.resume(d, progress=Rec())
    assert any("unreadable" in m for m in msgs)
    assert strip_times(resumed.history) == strip_times(full.history)


def test_a_method_defined_outside_the_package_runs_unchanged(tmp_path, capsys, monkeypatch):
    """Adding a method needs no change in the round loop, the config loader or the CLI: a
    FedSGD-style head-only method with its options dataclass is one class each."""
    from dataclasses import dataclass

    import fedgalore.methods.base as methods_base

    # registered for this test only: a later test in this process that loops over available_methods()
    # (tests/privacy/test_privacy.py) would otherwise run it too
    monkeypatch.setattr(methods_base, "_REGISTRY", dict(methods_base._REGISTRY))

    from fedgalore.cli import main
    from fedgalore.federated.client import local_train
    from fedgalore.methods.base import Method, MethodError, MethodOptions, load_params, named_params, option, register
    from fedgalore.protocol.state import ServerState

    @dataclass(frozen=True)
    class HeadOnlySGDOptions(MethodOptions):
        momentum: float = option(0.0, "SGD momentum of the head")

    @register
    class HeadOnlySGD(Method):
        name = "test_head_only_sgd"
        summary = "the head alone, trained with SGD"
        options_class = HeadOnlySGDOptions

        def setup(self, model, target_modules, head_params):
            self.heads = list(head_params)
            model.requires_grad_(False)
            for p in named_params(model, self.heads).values():
                p.requires_grad_(True)
            return model

        def init_server_state(self, model):
            return ServerState({n: p.detach().clone() for n, p in named_params(model, self.heads).items()})

        def client_update(self, model, broadcast, ctx):
            start = {n: broadcast[n].materialize() for n in self.heads}
            load_params(model, start)
            ps = named_params(model, self.heads)
            opt = torch.optim.SGD(ps.values(), lr=ctx.train.lr, momentum=self.options.momentum)
            stats = local_train(model, opt, ctx, ps.values())
            return Payload({n: Dense(ps[n].detach() - start[n]) for n in self.heads}, {"num_examples": ctx.num_examples, **stats})

        def aggregate(self, state, uploads, weights, ctx):
            for n in self.heads:
                state.params[n] += sum(w * u[n].materialize() for u, w in zip(uploads, weights))
            return {}

        def load_global(self, model, state):
            load_params(model, state.params)

    res = fedgalore.run(tiny_cfg(tmp_path, "test_head_only_sgd", rounds=2, method_options={"momentum": 0.5}))
    assert res.summary["rounds_completed"] == 2
    assert res.history[-1]["bytes_up"] > 0
    assert json.loads((res.run_dir / "environment.json").read_text())["method"] == {"name": "test_head_only_sgd", "rank": 4, "momentum": 0.5}
    # its options are listed with their default and doc, and a wrong one fails when the config is loaded
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "test_head_only_sgd" in out and "the head alone, trained with SGD" in out
    assert re.search(r"^ +momentum +0\.0 +SGD momentum of the head$", out, re.M)
    with pytest.raises(MethodError, match="method 'test_head_only_sgd': option momentum must be a number, got 'fast'"):
        tiny_cfg(tmp_path, "test_head_only_sgd", method_options={"momentum": "fast"})


def test_failing_client_is_dropped_and_weights_renormalised(tmp_path, monkeypatch):
    from fedgalore.methods.fedavg_full import FedAvgFull

    orig = FedAvgFull.client_update

    def flaky(self, model, broadcast, ctx):
        if ctx.client == 0:
            raise RuntimeError("disk on fire")
        return orig(self, model, broadcast, ctx)

    monkeypatch.setattr(FedAvgFull, "client_update", flaky)
    cfg = tiny_cfg(tmp_path, rounds=2)
    cfg.federation.clients_per_round = None
    res = fedgalore.run(cfg)
    assert all(h["dropped"] == [0] for h in res.history)
    clients = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert any("disk on fire" in c.get("error", "") for c in clients)
    assert all(torch.isfinite(torch.tensor(h["eval/loss"])) for h in res.history)


def test_fedgalore_identity_no_sync_equals_fedavg_full(tmp_path):
    """With the identity projector (basis = I, scale 1) and no sync, FedGaLore is FedAvg-Full
    with AdamW, round for round (same clients, same batches, same dropout)."""
    opts = {"projector": "identity", "scale": 1.0, "sync": "none"}
    a = fedgalore.run(tiny_cfg(tmp_path / "a", "fedgalore", rounds=3, method_options=opts))
    b = fedgalore.run(tiny_cfg(tmp_path / "b", "fedavg_full", rounds=3))
    for ha, hb in zip(a.history, b.history):
        assert ha["clients"] == hb["clients"]
        assert ha["train_loss"] == pytest.approx(hb["train_loss"], rel=1e-4)
        assert ha["eval/loss"] == pytest.approx(hb["eval/loss"], rel=1e-4)
        assert ha["eval/accuracy"] == hb["eval/accuracy"]


def test_eval_last_adds_the_last_rounds_and_changes_nothing_else(tmp_path):
    """``federation.eval_last = N`` evaluates after each of the last N rounds on top of every
    ``eval_every``-th round and the last (test and validation alike); 0 (default) keeps the
    old schedule; evaluation changes no training (same losses, bytes, final metrics); a negative
    value is one clear line."""
    fed = {"num_clients": 6, "clients_per_round": 3, "rounds": 6, "eval_every": 4, "validation_fraction": 0.25,
           "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}}
    runs = {n: fedgalore.run(tiny_cfg(tmp_path / str(n), federation={**fed, "eval_last": n})) for n in (0, 2)}
    evaluated = {n: [h["round"] for h in r.history if "eval/accuracy" in h] for n, r in runs.items()}
    assert evaluated == {0: [4, 6], 2: [4, 5, 6]}
    assert all("eval/val_accuracy" in h for h in runs[2].history if "eval/accuracy" in h)
    assert [h["train_loss"] for h in runs[0].history] == [h["train_loss"] for h in runs[2].history]
    assert runs[0].summary["final"] == runs[2].summary["final"]
    assert runs[0].summary["bytes_up_total"] == runs[2].summary["bytes_up_total"]
    with pytest.raises(ConfigError, match="eval_last") as exc:
        tiny_cfg(tmp_path, federation={**fed, "eval_last": -1})
    assert "\n" not in str(exc.value)
