"""Secure aggregation (issue 42): Flower's SecAgg+ carrying fedgalore's uploads.

* every method × sync mode is supported under ``federation.secure_aggregation`` or refused in one
  line naming the option — before any round and before the backend's own refusal;
* the carriage is exact: :func:`~fedgalore.flower.secagg.summable` / :func:`from_summed` give back
  every entry kind, and the weighted mean of carried uploads equals A's weighted mean;
* a federation run through Flower's own ``SecAggPlusWorkflow`` and ``secaggplus_mod`` (the real
  ClientApp handlers on an in-process Grid, each node with its own Context) gives the same global
  model as the same run without it, within the stated quantisation error; what the server receives
  from each node is masked (values beyond the quantisation range: no unmasked upload has them);
  a node lost after sharing its keys is survived. tests/flower/test_flower_deploy.py runs it on a real
  SuperLink and SuperNodes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from fedgalore.job.config import ConfigError, FederatedConfig  # noqa: E402
from fedgalore.flower.secagg import from_summed, summable  # noqa: E402
from fedgalore.jsonl import read_jsonl  # noqa: E402
from fedgalore.methods.base import available_methods, method_class  # noqa: E402
from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank  # noqa: E402

from fedgalore_testing.flower import SecAggGrid, _task_identity  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def cfg_dict(tmp_path: Path, method: str, options: dict | None = None, backend: str = "flower", **fed) -> dict:
    return {
        "name": "sa", "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 120, "n_test": 48}},
        "method": {"name": method, "rank": 4, "options": options or {}},
        "federation": {"num_clients": 3, "clients_per_round": None, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 1.0, "min_size": 5},
                       "secure_aggregation": {"num_shares": 3, "reconstruction_threshold": 2}, **fed},
        "train": {"lr": 1e-2, "batch_size": 16, "local_steps": 2},
        "backend": {"name": backend},
        "output": {"dir": str(tmp_path), "progress": "quiet", "keep_checkpoints": 3},
    }


# ----------------------------------------------------------------------------- what is allowed
SUPPORTED = [
    ("fedavg_full", {}), ("fedit", {}), ("ffa_lora", {}), ("fr_lora", {}),
    ("fedgalore", {"projector": "random", "sync": "aggregate"}),
    ("fedgalore", {"projector": "random", "sync": "mean", "moment_protocol": "paper"}),
    ("fedgalore", {"projector": "random", "sync": "none"}),
    ("fedgalore_minus", {"projector": "random"}),
    ("fed_sb", {}), ("hetlora", {"aggregation": "weights"}), ("fedsa_lora", {}),
]
REFUSED = [
    ("flora", {}, "method 'flora' combines each client's upload on its own"),
    ("lora_fair", {}, "method 'lora_fair' combines each client's upload on its own"),
    ("fr_lora", {"uniform_average": True}, "method.options.uniform_average"),
    ("fedgalore", {}, "method.options.projector='rsvd_then_random'"),
    ("fedgalore", {"projector": "random"}, "sync=ajive"),
    ("fedgalore", {"projector": "random", "sync": "mean_svd", "moment_protocol": "paper"}, "sync=mean_svd"),
    ("fedgalore", {"projector": "random", "sync": "mean"}, "evidence"),
    ("fedgalore_mean", {"projector": "random"}, "evidence"),
    ("fedgalore_minus", {}, "method.options.projector="),
    ("fedex_lora", {}, "method 'fedex_lora' combines each client's upload on its own"),
    ("flexlora", {}, "method 'flexlora' combines each client's upload on its own"),
    ("hetlora", {}, "method.options.aggregation=weights"),
]


def test_every_method_is_supported_or_refused_in_one_line(tmp_path):
    named = {m for m, _ in SUPPORTED} | {m for m, _, _ in REFUSED}
    ours = {m for m in available_methods() if method_class(m).__module__.startswith("fedgalore.")}  # not other tests' plugins
    assert named == ours  # every method fedgalore registers is decided here
    for m, o in SUPPORTED:
        FederatedConfig.from_dict(cfg_dict(tmp_path, m, o))
    for m, o, words in REFUSED:
        for backend in ("flower", "sequential"):  # the method's refusal (config) comes before the backend's (run)
            with pytest.raises(ConfigError) as e:
                FederatedConfig.from_dict(cfg_dict(tmp_path, m, o, backend=backend))
            msg = str(e.value)
            assert "\n" not in msg and words in msg and "federation.secure_aggregation" in msg, msg


@pytest.mark.parametrize("fed, words", [
    ({"robust": {"kind": "norm_filter"}}, "use one of the two"),
    ({"max_update_norm": 5.0}, "federation.max_update_norm=null"),
    ({"clip_update_norm": 5.0}, "federation.clip_update_norm=null"),
])
def test_what_secure_aggregation_excludes_is_one_line(tmp_path, fed, words):
    with pytest.raises(ConfigError, match=words):
        FederatedConfig.from_dict(cfg_dict(tmp_path, "fedavg_full", **fed))


def test_central_client_dp_and_non_flower_backends_are_refused(tmp_path):
    d = cfg_dict(tmp_path, "fedavg_full")
    d["privacy"] = {"client": {"clip": 0.5, "noise_multiplier": 1.0}}
    with pytest.raises(ConfigError, match="privacy.client.noise: distributed"):
        FederatedConfig.from_dict(d)
    d["privacy"]["client"]["noise"] = "distributed"
    FederatedConfig.from_dict(d)
    import fedgalore

    with pytest.raises(ConfigError, match="runs Flower's SecAgg\\+ between SuperNodes, and the sequential backend has none"):
        fedgalore.run(FederatedConfig.from_dict(cfg_dict(tmp_path, "fedavg_full", backend="sequential")))
    assert not (tmp_path / "sa").exists() or not list((tmp_path / "sa").glob("*/checkpoints"))  # refused before the model loads
    bad = cfg_dict(tmp_path, "fedavg_full")
    bad["federation"]["secure_aggregation"] = {"num_shares": 3, "reconstruction_threshold": 3}
    with pytest.raises(ConfigError, match="reconstruction_threshold=3 must be below num_shares=3"):
        FederatedConfig.from_dict(bad)


# ----------------------------------------------------------------------------- the carriage
def _payload(g: torch.Generator, scale: float = 1.0) -> Payload:
    t = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    return Payload({
        "w": Dense(t(3, 4)),
        "pair": LowRank(t(5, 2), t(2, 6)),
        "upd": GaLoreUpdate(-0.01 * scale, (SeededLowRank(t(5, 2), 11, "right", (5, 6)),
                                            SeededLowRank(t(2, 6), 12, "left", (5, 6))), (5, 6)),
        "moment/upd": MomentView(t(5, 2).abs(), "right", (5, 6), seed=11),
        "head": Dense(t(4).to(torch.bfloat16)),
    }, {"round": 1, "kind": "x", "loss": 0.3, "dp_clip_bit": 0.25 * scale})


def test_summable_round_trip_is_exact_for_every_entry_kind():
    p = _payload(torch.Generator().manual_seed(0))
    arrays, layout = summable(p)
    q = from_summed(layout, arrays)
    assert set(q.entries) == set(p.entries) and q.meta == {"dp_clip_bit": 0.25}  # the client's own meta (statistics, names) stays home
    for k, e in p.entries.items():
        f = q.entries[k]
        assert type(f) is type(e)
        if isinstance(e, GaLoreUpdate):
            assert f.decay == e.decay and [t.seed for t in f.terms] == [t.seed for t in e.terms]
        w0 = torch.ones(5, 6)
        got, want = (f.materialize(w0), e.materialize(w0)) if isinstance(e, GaLoreUpdate) else (f.materialize(), e.materialize())
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert "11" in layout and "0.3" not in layout and '"x"' not in layout  # public seeds travel in the clear, values do not


def test_weighted_mean_of_carried_uploads_is_the_mean_of_the_updates():
    """x̄ = Σ w_i x_i / Σ w_i taken arraywise on the carried form is, entry by entry, the weighted mean
    A computes — including each GaLore record's decay (summed as a one-element array)."""
    g = torch.Generator().manual_seed(1)
    ps, w = [_payload(g, s) for s in (1.0, 2.0, 0.5)], [5, 3, 2]
    carried = [summable(p) for p in ps]
    assert len({lay for _, lay in carried}) == 1
    mean = [sum(wi * a[j] for wi, (a, _) in zip(w, carried)) / sum(w) for j in range(len(carried[0][0]))]
    q = from_summed(carried[0][1], mean)
    from fedgalore.methods.fedgalore import aggregate_galore_updates

    want = aggregate_galore_updates([p.entries["upd"] for p in ps], [x / sum(w) for x in w], torch.eye(5, 6))
    assert torch.allclose(q.entries["upd"].materialize(torch.eye(5, 6)), want, atol=1e-6)
    assert q.entries["upd"].decay == pytest.approx(sum(wi * p.entries["upd"].decay for wi, p in zip(w, ps)) / sum(w))
    # client-level DP's noised clip bit is summed too (adaptive clipping reads the mean share)
    assert q.meta["dp_clip_bit"] == pytest.approx(sum(wi * p.meta["dp_clip_bit"] for wi, p in zip(w, ps)) / sum(w))


# ----------------------------------------------------------------------------- a federation under SecAgg+
def run_flower(tmp_path: Path, method: str, options: dict, secure: bool, grid=None, **fed):
    from fedgalore.flower.strategy import FedGaLoreStrategy

    d = cfg_dict(tmp_path, method, options, **fed)
    if not secure:
        d["federation"].pop("secure_aggregation")
    cfg = FederatedConfig.from_dict(d)
    grid = grid or SecAggGrid({101 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)})
    run_dir = tmp_path / ("secure" if secure else "plain")
    res = FedGaLoreStrategy(cfg, run_dir=run_dir).start(grid)
    return res, run_dir


def _global(run_dir: Path, round_done: int) -> dict[str, torch.Tensor]:
    from fedgalore.federated.checkpoint import load_checkpoint

    state, _ = load_checkpoint(run_dir, round_done)
    return {k: v.float() for k, v in state.params.items()}


@pytest.mark.parametrize("method, options", [("fedavg_full", {}), ("fedgalore", {"projector": "random", "sync": "aggregate"}),
                                             ("fed_sb", {})])  # Fed-SB: A is the mean of the r×r R_i
def test_secagg_federation_equals_the_plain_one_within_quantisation(tmp_path, method, options):
    """Round 1's global model is the plain run's within one quantisation step per value,
    2c/Q = 3.8e-6 (Flower's stochastic rounding of each client's value, averaged); round 2 then
    trains from a model that differs by that much, and AdamW's normalised first steps turn such
    differences into up to lr-sized ones on coordinates whose gradient is near zero — so the
    runs agree in accuracy, not bit for bit."""
    sa = {"num_shares": 3, "reconstruction_threshold": 2, "clipping_range": 8.0, "quantization_range": 2**22}
    plain, pdir = run_flower(tmp_path, method, options, secure=False)
    secure, sdir = run_flower(tmp_path, method, options, secure=True, secure_aggregation=sa)
    a, b = _global(pdir, 1), _global(sdir, 1)
    step = 2 * sa["clipping_range"] / sa["quantization_range"]
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert 0 < worst < 1.5 * step, worst  # really through the quantised sum, and within its error
    msgs = [r for r in read_jsonl(sdir / "flower_messages.jsonl") if r["type"] == "train_secagg"]
    assert len(msgs) == 6 and all(r["summed"] for r in msgs)
    # what the server received from each node is masked: values spread over the 2^32 modulus, which no
    # unmasked quantised value (< quantization_range = 2^22) can reach
    assert all(max(r["masked_head"]) >= sa["quantization_range"] for r in msgs)
    ups = [r for r in read_jsonl(sdir / "ledger.jsonl") if r["direction"] == "up"]
    assert len(ups) == 6 and all(r["bytes"] > 0 for r in ups)
    assert plain.summary["final"]["accuracy"] == pytest.approx(secure.summary["final"]["accuracy"], abs=0.05)


def test_a_node_lost_after_sharing_its_keys_is_survived(tmp_path):
    """Node 103 answers setup and share-keys of round 2, then never again: Flower's unmask stage
    recovers its pairwise masks from its neighbours' shares; the round sums the other two."""
    grid = SecAggGrid({101 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}, lose=103, lose_at=7)
    res, sdir = run_flower(tmp_path, "fedavg_full", {}, secure=True, grid=grid, min_clients=2, max_round_retries=0)
    assert res.summary["rounds_completed"] == 2
    recs = [r for r in read_jsonl(sdir / "clients.jsonl") if r["round"] == 2]
    lost = [r for r in recs if r["client"] == 2]
    assert lost and "secure aggregation" in lost[0]["error"]
    assert sorted(r["client"] for r in recs if "error" not in r) == [0, 1]


def test_a_client_whose_layout_differs_is_held_back_before_flower_sums(tmp_path, monkeypatch):
    """Client 2 uploads one array more than the others (as a FedGaLore site with another number of
    refreshes would): its collect-stage reply is held back before Flower adds it (numpy would
    broadcast or fail), Flower recovers its masks as for a lost node, the round sums clients 0 and 1,
    and client 2's record says why."""
    from fedgalore.flower import secagg

    real = secagg.summable

    def odd(payload):
        arrays, layout = real(payload)
        if "client 2" in str(payload.meta.get("who", "")):
            return arrays + [np.zeros(3)], layout.replace('"tensors": [', '"tensors": ["extra", ', 1)
        return arrays, layout

    from fedgalore.engine.runtime import Runtime

    real_exec = Runtime.execute

    def tagged(self, job, broadcast, client_state=None, **kw):
        res = real_exec(self, job, broadcast, client_state=client_state, **kw)
        if res.upload is not None:
            from fedgalore.protocol.payload import decode, encode

            p = decode(res.upload)
            res.upload = encode(Payload(p.entries, {**p.meta, "who": f"client {job.client}"}))
        return res

    monkeypatch.setattr(Runtime, "execute", tagged)
    monkeypatch.setattr(secagg, "summable", odd)
    res, sdir = run_flower(tmp_path, "fedavg_full", {}, secure=True, rounds=1, min_clients=2, max_round_retries=0)
    assert res.summary["rounds_completed"] == 1
    recs = read_jsonl(sdir / "clients.jsonl")
    assert sorted(r["client"] for r in recs if "error" not in r) == [0, 1]
    bad = [r for r in recs if r["client"] == 2][0]
    assert "layout differs from the round's majority" in bad["error"]
    msgs = [r for r in read_jsonl(sdir / "flower_messages.jsonl") if r["type"] == "train_secagg"]
    assert [r["client"] for r in msgs if r["held_back"]] == [2]


def test_distributed_client_dp_under_secagg_accounts_the_lost_nodes_noise(tmp_path, caplog):
    """privacy.client with distributed noise: each site adds N(0, σ²C²/K) before masking, so the SecAgg+
    sum carries σ; a node lost mid-round leaves σ·√(2/3), which the accountant counts and the log says."""
    pytest.importorskip("dp_accounting")
    grid = SecAggGrid({101 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}, lose=103, lose_at=7)
    d = cfg_dict(tmp_path, "fedavg_full", min_clients=2, max_round_retries=0, num_clients=3)
    d["privacy"] = {"client": {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-3, "noise": "distributed",
                               "adaptive_clipping": {"target_quantile": 0.5}}}
    from fedgalore.flower.strategy import FedGaLoreStrategy

    with caplog.at_level("WARNING", logger="fedgalore"):
        res = FedGaLoreStrategy(FederatedConfig.from_dict(d), run_dir=tmp_path / "dp").start(grid)
    assert res.summary["rounds_completed"] == 2
    # each site's noised clip bit goes into the masked sum only, never into its clear result record
    assert not any("dp_clip_bit" in r for r in read_jsonl(tmp_path / "dp" / "clients.jsonl"))
    assert "2 of 3 clients' noised uploads reached the sum; it carries noise multiplier 0.8165 instead of 1" in caplog.text
    priv = json.loads((tmp_path / "dp" / "privacy.json").read_text())
    assert "0.8165" in json.dumps(priv) or any(abs(float(x) - (2 / 3) ** 0.5) < 1e-4 for x in _numbers(priv))


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj
