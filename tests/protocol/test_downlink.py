"""The factored downlink (issue 18, fedgalore.protocol.downlink): a client that applies the chain
of factored updates holds the server's dense model, over rounds it missed too."""
from __future__ import annotations

import random

import pytest
import torch

from fedgalore.protocol.downlink import (
    ClientCache,
    DownlinkError,
    apply_update,
    chain_versions,
    client_payload,
    dense_bytes,
    reconstruct,
    record_update,
    tensor_bytes,
    version,
    weighted_update,
)
from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, Payload, SeededLowRank, decode, encode
from fedgalore.protocol.state import ServerState


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _client_update(g: torch.Generator, shape, rank, round_seed: int, decay: float) -> GaLoreUpdate:
    m, n = shape
    data = LowRank(torch.randn(m, rank, generator=g) * 1e-2, torch.linalg.qr(torch.randn(n, rank, generator=g))[0].T.contiguous())
    seeded = SeededLowRank(torch.randn(m, rank, generator=g) * 1e-2, round_seed, "right", shape)
    return GaLoreUpdate(decay, (data, seeded), shape)


def test_weighted_update_is_the_dense_aggregate():
    from fedgalore.methods.fedgalore import aggregate_galore_updates

    g = torch.Generator().manual_seed(0)
    shape = (24, 40)
    w0 = torch.randn(shape, generator=g)
    ups = [_client_update(g, shape, 3, 11, -1e-3 * (i + 1)) for i in range(4)]
    p = [0.1, 0.2, 0.3, 0.4]
    fac = weighted_update(ups, p)
    assert len(fac.terms) == 4 + 1  # four data-driven terms, the seeded ones merged into one
    dense = aggregate_galore_updates(ups, p, w0)
    assert _rel(fac.materialize(w0), dense) < 1e-6
    w = w0.clone()
    delta = apply_update(w, fac)
    assert _rel(delta, dense) < 1e-6
    assert _rel(w, w0 + dense) < 1e-6  # W + decay·W, then one GEMM of the stacked factors into W
    w_fast = w0.clone()
    assert apply_update(w_fast, fac, return_delta=False) is None
    assert torch.equal(w_fast, w)  # asking for ΔW changes no bit of W


def test_chain_is_pruned_below_dense_and_client_payload_picks_the_smaller():
    g = torch.Generator().manual_seed(1)
    shape = (32, 32)  # dense 4096 B; one update: data-driven 2*32*2*4 + seeded 32*2*4 = 768 B
    state = ServerState(params={"w": torch.randn(shape, generator=g), "head": torch.randn(3, generator=g)})
    for k in range(8):
        upd = weighted_update([_client_update(g, shape, 2, 100 + k, 0.0)], [1.0])
        apply_update(state.params["w"], upd)
        record_update(state, {"w": upd})
    assert version(state) == 8
    kept = chain_versions(state, "w")
    assert sum(tensor_bytes(state.moments[f"downlink/{v}/w"]) for v in kept) < dense_bytes(state.params["w"])
    assert kept == list(range(8 - len(kept) + 1, 9)) and len(kept) == 5  # 5 x 768 < 4096 <= 6 x 768
    dense = Payload({n: Dense(t) for n, t in state.params.items()}, {"round": 8})
    assert client_payload(state, dense, ["w"], None) is dense
    assert client_payload(state, dense, ["w"], 2) is dense  # behind the chain: dense
    # from 5: three updates (headers included) plus the fingerprint exceed the dense matrix
    assert "w" in client_payload(state, dense, ["w"], 5).entries
    p = client_payload(state, dense, ["w"], 6)
    assert "w" not in p.entries and sorted(k for k in p.entries if k.startswith("downlink/")) == ["downlink/7/w", "downlink/8/w"]
    assert "downlink_check/w" in p.entries  # the server's fingerprint of W_8 travels with the chain
    assert p.meta["downlink"] == {"from": 6, "to": 8} and p.meta["round"] == 8
    assert p.nbytes() < dense.nbytes()
    tiny = ServerState(params={"w": torch.randn(4, 4, generator=g)})  # 64 B dense: the chain's headers alone are more
    upd = weighted_update([_client_update(g, (4, 4), 1, 7, 0.0)], [1.0])
    apply_update(tiny.params["w"], upd)
    record_update(tiny, {"w": upd})
    tiny_dense = Payload({"w": Dense(tiny.params["w"])}, {})
    assert "w" in client_payload(tiny, tiny_dense, ["w"], 0).entries
    up_to_date = client_payload(state, dense, ["w"], 8)  # nothing to send for the matrix
    assert "w" not in up_to_date.entries and not any(k.startswith("downlink/") for k in up_to_date.entries)


def test_cache_at_another_version_is_refused():
    g = torch.Generator().manual_seed(2)
    shape = (64, 64)  # large enough that a 2-update chain, headers included, is below dense
    state = ServerState(params={"w": torch.randn(shape, generator=g)})
    w0 = state.params["w"].clone()
    for k in range(2):
        upd = weighted_update([_client_update(g, shape, 1, k, 0.0)], [1.0])
        apply_update(state.params["w"], upd)
        record_update(state, {"w": upd})
    p = decode(encode(client_payload(state, Payload({"w": Dense(state.params["w"])}), ["w"], 0)))
    with pytest.raises(DownlinkError, match="holds 1"):
        reconstruct(p, ["w"], ClientCache(1, {"w": w0}))
    with pytest.raises(DownlinkError, match="holds None"):
        reconstruct(p, ["w"], None)
    assert torch.equal(reconstruct(p, ["w"], ClientCache(0, {"w": w0}))["w"], state.params["w"])
    # in place: only on a cache that owns its tensors, only after the whole chain is checked
    shared = ClientCache(0, {"w": w0.clone()})
    got = reconstruct(p, ["w"], shared, in_place=True)["w"]
    assert torch.equal(shared.params["w"], w0) and got is not shared.params["w"]
    own = ClientCache(0, {"w": w0.clone()}, owned=True)
    got = reconstruct(p, ["w"], own, in_place=True)["w"]
    assert got is own.params["w"] and torch.equal(got, state.params["w"])
    missing = Payload({k: e for k, e in p.entries.items() if not k.startswith("downlink/2/")}, dict(p.meta))
    mine = ClientCache(0, {"w": w0.clone(), "v": w0.clone()}, owned=True)
    with pytest.raises(DownlinkError, match="version 2 missing"):
        reconstruct(missing, ["w"], mine, in_place=True)
    assert torch.equal(mine.params["w"], w0)  # refused before anything was applied


def test_partial_participation_clients_hold_the_server_model_over_missed_rounds():
    """12 rounds, 6 clients, 2 per round (some absent for many rounds), weight decay, two matrix
    shapes and a dense head: every client's reconstruction equals the server's W (≤ 1e-6
    relative, Frobenius), what went over the wire is factors whenever that is smaller, and the
    bytes are the encoded payload's."""
    g = torch.Generator().manual_seed(3)
    rng = random.Random(0)
    shapes = {"a": (48, 64), "b": (64, 16)}
    state = ServerState(params={n: torch.randn(s, generator=g) for n, s in shapes.items()} | {"head": torch.randn(5, 4, generator=g)})
    base = {n: state.params[n].clone() for n in shapes}  # W_0: the public model every client builds
    caches: dict[int, ClientCache] = {}
    chained = dense_sends = 0
    for k in range(12):
        sampled = rng.sample(range(6), 2)
        dense = Payload({n: Dense(t.clone()) for n, t in state.params.items()}, {"round": k})
        for c in sampled:
            held = caches[c].version if c in caches else (0 if c % 2 == 0 else None)  # odd clients start empty
            msg = client_payload(state, dense, list(shapes), held)
            blob = encode(msg)
            assert len(blob) == msg.nbytes()
            got = decode(blob)
            cache = caches.get(c) or (ClientCache(0, dict(base)) if held == 0 else None)
            w = reconstruct(got, list(shapes), cache)
            for n in shapes:
                assert _rel(w[n], state.params[n]) <= 1e-6
            chained += any(key.startswith("downlink/") for key in got.entries)
            dense_sends += all(n in got.entries for n in shapes)
            caches[c] = ClientCache(k, w)
        # the round's aggregate: K = 2 clients' exact GaLore records, with weight decay
        p = [0.4, 0.6]
        for n, s in shapes.items():
            upd = weighted_update([_client_update(g, s, 2, 1000 * k + j, -2e-3) for j in range(2)], p)
            apply_update(state.params[n], upd)
            record_update(state, {n: upd}, new_version=k + 1)
        state.params["head"] += torch.randn(5, 4, generator=g) * 1e-2
    assert chained > 5 and dense_sends >= 3


# ----------------------------------------------------------------------------- in the round loop
def _fed_cfg(tmp_path, downlink: str, rounds: int = 6, method: str = "fedgalore", **over):
    from fedgalore_testing.runs import tiny_cfg

    opts = {"update_proj_gap": 2} if method.startswith("fedgalore") else {}
    opts.update(over.pop("method_options", {}))
    cfg = tiny_cfg(tmp_path, method, rounds=rounds, method_options={**opts, "downlink": downlink}, **over)
    cfg.federation.clients_per_round = 2  # 6 clients, 2 a round: most miss several rounds
    return cfg


MERGING = [("fedgalore", {}), ("flora", {}), ("fr_lora", {}), ("fr_lora", {"freeze_a": False})]


@pytest.mark.parametrize("method,options", MERGING, ids=["fedgalore", "flora", "fr_lora", "fr_lora_train_a"])
def test_federation_clients_hold_the_server_model_and_the_ledger_counts_what_was_sent(tmp_path, method, options):
    """Sequential backend whose clients keep their model (``keep_client_models``), partial
    participation: every sampled client's reconstructed start model is the server's W_k (≤ 1e-6
    relative), the ledger's bytes_down is each client's encoded message (factors, not dense), and
    after the run every client — sampled or not — reaches the final server model from what it
    holds."""
    import fedgalore
    from fedgalore.engine.backends.sequential import SequentialBackend
    from fedgalore.engine.loop import Federation
    from fedgalore.protocol.state import RoundContext

    class Watch(SequentialBackend):
        fed = None
        sent: list[tuple[int, int, int]] = []
        errors: list[float] = []

        def run_clients(self, broadcast, jobs, progress=None):
            for j in jobs:
                blob = broadcast[j.client] if isinstance(broadcast, dict) else broadcast
                # in process the message itself is handed over; the ledger computed its size
                self.sent.append((j.round + 1, j.client, len(blob) if isinstance(blob, bytes) else len(encode(blob))))
            out = super().run_clients(broadcast, jobs, progress)
            for j in jobs:
                cache = self.runtime.client_state[j.client]["downlink"]
                assert cache.version == j.round
                for n, w in self.fed.state.params.items():
                    if n in cache.params:
                        self.errors.append(_rel(cache.params[n], w))
            return out

    backend = Watch(keep_client_models=True)
    backend.sent, backend.errors = [], []
    fed = Federation(_fed_cfg(tmp_path, "factored", method=method, method_options=options), run_dir=tmp_path / "f", backend=backend)
    backend.fed = fed
    res = fed.run()
    assert backend.errors and max(backend.errors) <= 1e-6
    down = [(r["round"], r["client"], r["bytes"]) for r in fed.ledger.records if r["direction"] == "down"]
    assert down == backend.sent
    dense = fedgalore.run(_fed_cfg(tmp_path, "dense", method=method, method_options=options), run_dir=tmp_path / "d")
    per_round_dense = [r["bytes_down"] for r in dense.history]
    per_round = [r["bytes_down"] for r in res.history]
    assert per_round[0] < per_round_dense[0] / 10  # round 1: every client holds W_0, only head + meta travel
    assert sum(per_round) < 0.85 * sum(per_round_dense)  # tiny 32x32 matrices at r = 4, K = 2: factors are half of dense
    # the model itself: the server applies the same arithmetic under either downlink
    assert res.final == dense.final
    # after the run, every client (held version or the public W_0) reaches the final model
    method, state = fed.method, fed.state
    names = method.downlink_names()
    k = len(res.history)
    rctx = RoundContext(k, k + 1, 0, list(range(6)), [1 / 6] * 6)
    common = method.broadcast(state, rctx)
    held = backend.client_versions(method, list(range(6)))
    assert sorted(held) == list(range(6)) and all(v is not None for v in held.values())
    for c in range(6):
        msg = decode(encode(method.client_broadcast(state, rctx, common, held[c])))
        w = method.reconstruct_targets(msg, fed.runtime.client_state[c])
        for n in names:
            assert _rel(w[n], state.params[n]) <= 1e-6


def _strip(history, drop=()):
    from fedgalore_testing.runs import strip_times

    return [{k: v for k, v in r.items() if k not in drop} for r in strip_times(history)]


@pytest.mark.parametrize("method", ["fedgalore", "flora", "fr_lora"])
def test_the_default_counts_what_a_client_that_kept_its_model_receives(tmp_path, method):
    """The default (``downlink: auto`` → factored, clients that keep nothing in the simulation)
    hands clients the dense model but counts, client by client and byte for byte, the messages
    that clients keeping their model receive and rebuild W from (``keep_client_models``); the
    training is bit-identical to the dense downlink's, only bytes_down differs."""
    from fedgalore.engine.backends.sequential import SequentialBackend
    from fedgalore.engine.loop import Federation
    from fedgalore_testing.runs import tiny_cfg

    def cfg():
        c = tiny_cfg(tmp_path, method, rounds=6, method_options={"update_proj_gap": 2} if method == "fedgalore" else {})
        c.federation.clients_per_round = 2
        return c

    assert cfg().method.typed_options().downlink == "auto"
    acc = Federation(cfg(), run_dir=tmp_path / "a")
    assert acc.method.options.downlink == "factored" and acc.runtime.client_state is None
    acc_res = acc.run()
    rep = Federation(cfg(), run_dir=tmp_path / "r", backend=SequentialBackend(keep_client_models=True))
    rep_res = rep.run()
    ledger = lambda f: [(r["round"], r["client"], r["direction"], r["bytes"]) for r in f.ledger.records]  # noqa: E731
    assert ledger(acc) == ledger(rep)
    assert _strip(acc_res.history) == _strip(rep_res.history) and acc_res.final == rep_res.final
    dense_cfg = cfg()
    dense_cfg.method.options["downlink"] = "dense"
    dense = Federation(dense_cfg, run_dir=tmp_path / "d")
    dense_res = dense.run()
    drop = ("bytes_down", "cum_bytes_down")
    assert _strip(acc_res.history, drop) == _strip(dense_res.history, drop) and acc_res.final == dense_res.final
    for n, w in dense.state.params.items():
        assert torch.equal(w, acc.state.params[n])
    assert sum(r["bytes_down"] for r in acc_res.history) < 0.85 * sum(r["bytes_down"] for r in dense_res.history)


def test_factored_downlink_resumes_to_the_same_model_and_bytes(tmp_path):
    """Killed inside round 3 and resumed (the default, counting mode): the same metrics, server
    state and bytes as one run — the server's record of which version each client holds is
    checkpointed."""
    import fedgalore
    from fedgalore_testing.runs import _Kill

    ref = fedgalore.run(_fed_cfg(tmp_path, "factored", rounds=4), run_dir=tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(_fed_cfg(tmp_path, "factored", rounds=4), run_dir=tmp_path / "r", progress=_Kill(at_round=2))
    got = fedgalore.resume(tmp_path / "r")
    assert _strip(got.history) == _strip(ref.history)
    assert got.final == ref.final


def test_factored_downlink_on_a_deployment_without_client_models_says_it_sends_dense(tmp_path):
    """A deployment backend whose clients keep no model between rounds (Flower today) ships
    what it counts: the run says once that every client gets the dense model, and the ledger
    shows the dense bytes."""
    from fedgalore.engine.backends.sequential import SequentialBackend
    from fedgalore.engine.loop import Federation

    class Deployed(SequentialBackend):
        simulated = False

    messages: list[str] = []

    class Sink:
        def __getattr__(self, name):
            return lambda *a, **k: None

        def message(self, text):
            messages.append(text)

    fed = Federation(_fed_cfg(tmp_path, "factored", rounds=2), run_dir=tmp_path / "s", backend=Deployed(), progress=Sink())
    res = fed.run()
    assert sum("receives the dense model" in m for m in messages) == 1
    dense = Federation(_fed_cfg(tmp_path, "dense", rounds=2), run_dir=tmp_path / "d", progress=Sink()).run()
    for f, d in zip(res.history, dense.history):  # dense tensors; only the header's model version differs
        assert d["bytes_down"] <= f["bytes_down"] <= d["bytes_down"] + 16 * 3


def test_sequential_backend_options_are_checked():
    from fedgalore.engine.backends import make_backend
    from fedgalore.job.config import ConfigError

    with pytest.raises(ConfigError, match="keep_client_models"):
        make_backend("sequential", {"keep_models": True})
    with pytest.raises(ConfigError, match="true or false"):
        make_backend("sequential", {"keep_client_models": "yes"})
    assert make_backend("sequential", {"keep_client_models": True}).keeps_client_state
