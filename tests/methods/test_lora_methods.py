"""Federated LoRA baselines (FedIT, FFA-LoRA, FLoRA, FR-LoRA, LoRA-FAIR): server math, init,
communication and two rounds through the real round loop on TinyTextTask."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedgalore.engine.events import ProgressSink
from fedgalore.methods import fedit, ffa_lora, flora, fr_lora, lora_fair  # noqa: F401  (registration)
from fedgalore.methods.base import MethodError, get_method
from fedgalore.methods.fr_lora import pissa_factors
from fedgalore.methods.lora_common import a_key, b_key, pair_key, w_key
from fedgalore.methods.lora_fair import fair_correction
from fedgalore.protocol.payload import Dense, LowRank, Payload, encode
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState
from fedgalore.protocol.train_config import TrainConfig
from fedgalore.tasks.base import resolve_target_modules
from fedgalore.tasks.synthetic import TinyTextTask


NAMES = ["fedit", "ffa_lora", "flora", "fr_lora", "lora_fair"]
M, N, R = 6, 5, 2  # one adapted matrix W (M×N), rank R
MOD, HEAD = "lin", "head.weight"
P = [0.2, 0.5, 0.3]


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bare(name: str, **options):
    """A method whose model-side setup is skipped: one target ``lin`` and one head tensor."""
    meth = get_method(name, rank=R, **options)
    meth.targets, meth.heads = [MOD], [HEAD]
    return meth


def factors(k: int):
    return [(rand(M, R, seed=10 + i), rand(R, N, seed=20 + i)) for i in range(k)]


def heads(k: int):
    return [rand(3, 4, seed=30 + i) for i in range(k)]


def rctx(k=0, weights=P):
    return RoundContext(k, 2, 99, list(range(len(weights))), list(weights))


def pair_uploads(fs, hs, rnd=0):
    return [Payload({pair_key(MOD): LowRank(b, a), HEAD: Dense(h)}, {"num_examples": 10, "round": rnd}) for (b, a), h in zip(fs, hs)]


def wsum(ts, p=P):
    return sum(pi * t for pi, t in zip(p, ts))


# ----------------------------------------------------------------------------- server math
def test_fedit_is_product_of_averages_not_average_of_products():
    meth = bare("fedit")
    s = meth.scaling
    a0, b0 = rand(R, N, seed=1), torch.zeros(M, R)
    state = ServerState(params={a_key(MOD): a0, b_key(MOD): b0, HEAD: torch.zeros(3, 4)})
    fs, hs = factors(3), heads(3)
    delta = meth.aggregate(state, pair_uploads(fs, hs), P, rctx())
    b_bar, a_bar = wsum([b for b, _ in fs]), wsum([a for _, a in fs])
    torch.testing.assert_close(state.params[a_key(MOD)], a_bar)
    torch.testing.assert_close(state.params[b_key(MOD)], b_bar)
    torch.testing.assert_close(state.params[HEAD], wsum(hs))
    torch.testing.assert_close(delta[w_key(MOD)], s * b_bar @ a_bar)  # B0 = 0
    lifted_avg = s * wsum([b @ a for b, a in fs])
    assert (delta[w_key(MOD)] - lifted_avg).norm() > 1e-3 * lifted_avg.norm()


def test_ffa_lora_mean_b_is_exact():
    meth = bare("ffa_lora")
    s, a = meth.scaling, rand(R, N, seed=1)
    b_old = rand(M, R, seed=2)
    state = ServerState(params={b_key(MOD): b_old, HEAD: torch.zeros(3, 4)}, extras={a_key(MOD): a})
    bs, hs = [rand(M, R, seed=40 + i) for i in range(3)], heads(3)
    ups = [Payload({b_key(MOD): Dense(b), HEAD: Dense(h)}, {"num_examples": 5, "round": 0}) for b, h in zip(bs, hs)]
    # per-client lifted deltas: against the B̄ the clients started from (the round loop asks
    # before aggregating, when the state is still the round's start)
    cd = meth.client_deltas(state, ups[0])
    torch.testing.assert_close(cd[w_key(MOD)], s * (bs[0] - b_old) @ a)
    delta = meth.aggregate(state, ups, P, rctx())
    torch.testing.assert_close(delta[w_key(MOD)], wsum([s * (b - b_old) @ a for b in bs]))
    # the new global product equals the average of the client products exactly
    torch.testing.assert_close(s * state.params[b_key(MOD)] @ a, wsum([s * b @ a for b in bs]))
    torch.testing.assert_close(state.params[HEAD], wsum(hs))


def test_flora_stacking_merges_exact_weighted_sum_of_products():
    meth = bare("flora")
    s, w = meth.scaling, rand(M, N, seed=3)
    state = ServerState(params={w_key(MOD): w.clone(), HEAD: torch.zeros(3, 4)})
    fs, hs = factors(3), heads(3)
    ups = pair_uploads(fs, hs)
    delta = meth.aggregate(state, ups, P, rctx())
    target = s * wsum([b @ a for b, a in fs])
    torch.testing.assert_close(delta[w_key(MOD)], target)
    torch.testing.assert_close(state.params[w_key(MOD)], w + target)
    torch.testing.assert_close(meth.client_deltas(state, ups[1])[w_key(MOD)], s * fs[1][0] @ fs[1][1])


@pytest.mark.parametrize("freeze_a", [True, False])
@pytest.mark.parametrize("uniform", [False, True])
def test_fr_lora_base_update_and_reset(freeze_a, uniform):
    meth = bare("fr_lora", freeze_a=freeze_a, uniform_average=uniform)
    s, w = meth.scaling, rand(M, N, seed=4)
    b0, a0 = rand(M, R, seed=5), rand(R, N, seed=6)
    state = ServerState(params={w_key(MOD): w.clone(), HEAD: torch.zeros(3, 4)}, extras={a_key(MOD): a0, b_key(MOD): b0})
    fs, hs = factors(3), heads(3)
    if freeze_a:
        ups = [Payload({b_key(MOD): Dense(b), HEAD: Dense(h)}, {"num_examples": 1, "round": 0}) for (b, _), h in zip(fs, hs)]
        fs = [(b, a0) for b, _ in fs]
    else:
        ups = pair_uploads(fs, hs)
    p = [1 / 3] * 3 if uniform else P
    delta = meth.aggregate(state, ups, P, rctx())
    expected = s * (wsum([b for b, _ in fs], p) @ wsum([a for _, a in fs], p) - b0 @ a0)
    torch.testing.assert_close(delta[w_key(MOD)], expected)
    torch.testing.assert_close(state.params[w_key(MOD)], w + expected)
    torch.testing.assert_close(state.params[HEAD], wsum(hs, p))
    # adapters are reset: the server keeps (A0, B0) untouched
    assert torch.equal(state.extras[a_key(MOD)], a0) and torch.equal(state.extras[b_key(MOD)], b0)
    if freeze_a:  # A frozen: the merged update is the exact average of the client deltas
        torch.testing.assert_close(delta[w_key(MOD)], wsum([s * (b - b0) @ a0 for b, _ in fs], p))


def test_lora_fair_correction_strictly_reduces_residual():
    meth = bare("lora_fair")
    state = ServerState(params={a_key(MOD): rand(R, N, seed=7), b_key(MOD): torch.zeros(M, R), HEAD: torch.zeros(3, 4)})
    fs, hs = factors(3), heads(3)
    meth.aggregate(state, pair_uploads(fs, hs), P, rctx())
    b_bar, a_bar = wsum([b for b, _ in fs]), wsum([a for _, a in fs])
    target = wsum([b @ a for b, a in fs])
    torch.testing.assert_close(state.params[a_key(MOD)], a_bar)
    b_new = state.params[b_key(MOD)]
    before = (b_bar @ a_bar - target).norm()
    after = (b_new @ a_bar - target).norm()
    assert after < before * (1 - 1e-3)
    c = state.meta["correction"]
    assert c["rel_residual_after"] < c["rel_residual_before"]
    # with λ → 0 the correction is the least-squares optimum: residual ⟂ row space of Ā
    d0 = fair_correction(b_bar, a_bar, target, ridge_lambda=0.0)
    resid = (b_bar + d0) @ a_bar - target
    assert float((resid @ a_bar.T).abs().max()) < 1e-4
    # ridge objective: the closed form beats nearby perturbations
    lam = 1e-3 * float(torch.trace(a_bar @ a_bar.T)) / R
    obj = lambda d: float(((b_bar + d) @ a_bar - target).pow(2).sum() + lam * d.pow(2).sum())  # noqa: E731
    d = fair_correction(b_bar, a_bar, target)
    for i in range(3):
        assert obj(d) <= obj(d + 1e-2 * rand(M, R, seed=50 + i))


def test_lora_fair_cosine_objective_runs():
    fs = factors(3)
    b_bar, a_bar, target = wsum([b for b, _ in fs]), wsum([a for _, a in fs]), wsum([b @ a for b, a in fs])
    d = fair_correction(b_bar, a_bar, target, objective="cosine", cosine_steps=25, cosine_lr=1e-1)
    cos = lambda x: float(torch.nn.functional.cosine_similarity(x.reshape(-1), target.reshape(-1), dim=0))  # noqa: E731
    assert torch.isfinite(d).all() and cos((b_bar + d) @ a_bar) > cos(b_bar @ a_bar)


def test_unknown_and_bad_options_raise():
    with pytest.raises(MethodError):
        get_method("fedit", rank=4, freeze_a=True)
    with pytest.raises(MethodError):
        get_method("lora_fair", rank=4, objective="nope")
    with pytest.raises(MethodError):
        get_method("flora", rank=4, fresh_init="sometimes")
    with pytest.raises(MethodError):
        get_method("fr_lora", rank=4, freeze_a="false")
    assert get_method("fedit", rank=8).scaling == 2.0  # α = 2r by default (paper Table 9)
    assert get_method("fedit", rank=8, lora_alpha=8).scaling == 1.0


# ----------------------------------------------------------------------------- on TinyTextTask
@pytest.fixture(scope="module")
def task():
    return TinyTextTask(n_train=96, n_test=32)


def prepared(task, name, rank=4, check_rng=False, **options):
    meth = get_method(name, rank=rank, **options)
    model = task.build_model()
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    heads_ = [n for n, _ in model.named_parameters() if n.startswith("classifier.")]
    rng = torch.get_rng_state()
    model = meth.setup(model, targets, heads_)
    if check_rng:
        assert torch.equal(rng, torch.get_rng_state()), "setup touched the global RNG"
    return meth, model, targets, heads_


def client_ctx(task, targets, heads_, client=0, rnd=0, steps=2):
    idx = list(range(16 * client, 16 * client + 16))

    def batches():
        for _ in range(steps):
            yield task.train_set().batch(idx)

    tc = TrainConfig(lr=1e-2, batch_size=16, local_steps=steps)
    return ClientContext(rnd, 2, client, 1234 + rnd, 16, tc, targets, heads_, task.loss, batches, steps, steps)


def test_setup_is_deterministic_and_leaves_global_rng_alone(task):
    for name in ("fedit", "fr_lora"):
        m1, model1, targets, _ = prepared(task, name, check_rng=True)
        m2, model2, _, _ = prepared(task, name)
        s1, s2 = m1.init_server_state(model1), m2.init_server_state(model2)
        for k in s1.params:
            assert torch.equal(s1.params[k], s2.params[k]), k
        for mod in targets:
            assert torch.equal(m1.lora_a(model1, mod), m2.lora_a(model2, mod))
    m3, model3, targets, _ = prepared(task, "fedit", adapter_seed=1)
    assert not torch.equal(m1.lora_a(model1, targets[0]), m3.lora_a(model3, targets[0]))


def test_trainable_sets(task):
    for name, a_trains in [("fedit", True), ("ffa_lora", False), ("flora", True), ("fr_lora", False), ("lora_fair", True)]:
        meth, model, targets, heads_ = prepared(task, name)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert all(any(n.endswith(h) for n in trainable) for h in heads_), name
        assert any("lora_B" in n for n in trainable)
        assert any("lora_A" in n for n in trainable) == a_trains, name
        assert not any("base_layer" in n for n in trainable)
    meth, model, _, _ = prepared(task, "fr_lora", freeze_a=False)
    assert any("lora_A" in n and p.requires_grad for n, p in model.named_parameters())


def test_fr_lora_pissa_init_principal_part_and_unchanged_output(task):
    raw = task.build_model()
    batch = task.test_set().batch(list(range(8)))
    logits0 = raw(**batch).logits
    w0 = {n: m.weight.detach().clone() for n, m in raw.named_modules() if isinstance(m, torch.nn.Linear)}
    meth, model, targets, _ = prepared(task, "fr_lora")
    s = meth.scaling
    state = meth.init_server_state(model)
    for mod in targets:
        u, sv, vh = torch.linalg.svd(w0[mod], full_matrices=False)
        principal = u[:, :4] @ torch.diag(sv[:4]) @ vh[:4]
        b0, a0 = state.extras[b_key(mod)], state.extras[a_key(mod)]
        torch.testing.assert_close(s * b0 @ a0, principal, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state.params[w_key(mod)], w0[mod] - principal, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model(**batch).logits, logits0, atol=1e-5, rtol=1e-4)
    b, a = pissa_factors(w0[targets[0]], 4, s)  # deterministic (sign-fixed)
    assert torch.equal(b, state.extras[b_key(targets[0])]) and torch.equal(a, state.extras[a_key(targets[0])])


def test_uploads_and_bytes_ffa_is_half_of_fedit(task):
    sizes = {}
    for name in ("fedit", "ffa_lora"):
        meth, model, targets, heads_ = prepared(task, name)
        state = meth.init_server_state(model)
        up = meth.client_update(model, meth.broadcast(state, rctx(weights=[1.0])), client_ctx(task, targets, heads_))
        assert up.meta["num_examples"] == 16 and up.meta["steps"] == 2 and "loss_mean" in up.meta
        sizes[name] = len(encode(up))
        if name == "ffa_lora":
            assert set(up.entries) == {b_key(m) for m in targets} | set(heads_)
        else:
            assert set(up.entries) == {pair_key(m) for m in targets} | set(heads_)
    assert 0.45 < sizes["ffa_lora"] / sizes["fedit"] < 0.62, sizes


def test_flora_fresh_adapters_per_client_and_round(task):
    meth, model, targets, heads_ = prepared(task, "flora")
    state = meth.init_server_state(model)
    bc = meth.broadcast(state, rctx(weights=[1.0]))
    a = {}
    for client in (0, 1):
        up = meth.client_update(model, bc, client_ctx(task, targets, heads_, client=client, steps=1))
        a[client] = up[pair_key(targets[0])].right
    assert not torch.equal(a[0], a[1])
    up = meth.client_update(model, bc, client_ctx(task, targets, heads_, client=0, steps=1))
    assert torch.equal(up[pair_key(targets[0])].right, a[0])  # deterministic from (seed, round seed, client)


# ----------------------------------------------------------------------------- the real round loop
def loop_cfg(tmp_path: Path, name: str, rounds: int = 2):
    from fedgalore.job.config import FederatedConfig

    return FederatedConfig.from_dict(
        {
            "name": "t",
            "seed": 0,
            "task": {"name": "tiny_text", "options": {"n_train": 96, "n_test": 32}},
            "method": {"name": name, "rank": 4, "options": {}},
            "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": rounds, "partition": {"kind": "iid"}},
            "train": {"lr": 1e-2, "batch_size": 16, "local_steps": 2},
            "output": {"dir": str(tmp_path), "progress": "quiet"},
        }
    )


@pytest.mark.parametrize("name", NAMES)
def test_two_rounds_through_round_loop(tmp_path: Path, name: str):
    from fedgalore.engine.loop import Federation

    fed = Federation(loop_cfg(tmp_path, name))
    start = {k: v.clone() for k, v in fed.state.params.items()}
    result = fed.run()
    assert result.summary["status"] == "finished" and result.summary["rounds_completed"] == 2
    assert all(not h["dropped"] for h in result.history)
    assert 0.0 <= result.final["accuracy"] <= 1.0
    changed = [k for k in start if not torch.equal(start[k], fed.state.params[k])]
    assert any(not k.startswith("classifier") for k in changed), changed  # the adapted part moved
    assert result.summary["bytes_up_total"] > 0 and result.summary["bytes_down_total"] > 0


class _KillAfter(ProgressSink):
    def __init__(self, at_round: int) -> None:
        self.at = at_round

    def round_end(self, round, record):  # noqa: A002
        if round == self.at:
            raise KeyboardInterrupt("simulated kill")


@pytest.mark.parametrize("name", ["fr_lora", "lora_fair"])
def test_resume_equals_uninterrupted(tmp_path: Path, name: str):
    import fedgalore

    full = fedgalore.run(loop_cfg(tmp_path / "a", name, rounds=3))
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(loop_cfg(tmp_path / "b", name, rounds=3), progress=_KillAfter(1))  # dies in round 2
    resumed = fedgalore.resume(next((tmp_path / "b").iterdir()))
    strip = lambda hs: [{k: v for k, v in h.items() if not k.startswith("time")} for h in hs]  # noqa: E731
    assert strip(resumed.history) == strip(full.history)
    assert resumed.summary["final"] == full.summary["final"]


@pytest.mark.parametrize("fresh_init", ["per_client", "shared"])
def test_flora_release_reference_is_the_fresh_adapter_the_client_started_from(task, fresh_init):
    """Client-level DP clips FLoRA's change from what the client started from: (B = 0, its fresh
    A), rebuilt from public seeds out of the upload's shapes and client id and the broadcast's round
    seed — exactly the A the client drew — so the released change is the training's, not ‖A₀‖
    (which would fill the clip bound)."""
    meth, model, targets, heads_ = prepared(task, "flora", fresh_init=fresh_init)
    state = meth.init_server_state(model)
    bc = meth.broadcast(state, RoundContext(0, 2, 1234, [1], [1.0]))  # the round seed client_ctx's jobs carry
    up = meth.client_update(model, bc, client_ctx(task, targets, heads_, client=1, steps=1))
    meth.init_adapters(model, meth.fresh_seed(int(bc.meta["round_seed"]), 1))  # what client 1 started from
    for m in targets:
        ref = meth.release_reference(bc, pair_key(m), up)
        assert torch.equal(ref.right, meth.lora_a(model, m).detach().float())
        assert not ref.left.any() and ref.left.shape == up[pair_key(m)].left.shape
        change = (up[pair_key(m)].right.float() - ref.right).abs()
        assert 0 < float(change.max()) <= 1e-2 * 1.01  # the change is one Adam step's (≤ lr per entry), not A₀
    head = heads_[0]
    assert torch.equal(meth.release_reference(bc, head, up).tensor, bc[head].tensor)  # the head: the broadcast's
    assert meth.release_reference(bc, pair_key(targets[0])) is None  # without the upload: zero, as before


class _Said(ProgressSink):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


@pytest.mark.parametrize("name,sgd_lr,option,said", [
    ("ffa_lora", None, None, "method ffa_lora trains with SGD at lr 0.02 (the default); train.lr=0.01 is not used"),
    ("lora_fair", None, 0.5, "method lora_fair trains with SGD at lr 0.5 (option sgd_lr); train.lr=0.01 is not used"),
    ("ffa_lora", 0.3, None, None),  # train.sgd_lr set: nothing to say
    ("fedit", None, None, None),  # AdamW reads train.lr
])
def test_an_sgd_method_says_that_train_lr_is_not_its_rate(tmp_path, name, sgd_lr, option, said):
    """FFA-LoRA and LoRA-FAIR train with SGD at train.sgd_lr (else option sgd_lr, else 2e-2): a
    sweep of train.lr alone would change nothing, so the run says which rate it uses."""
    from fedgalore.engine.loop import Federation

    cfg = loop_cfg(tmp_path, name, rounds=1)
    cfg.train.sgd_lr = sgd_lr
    if option is not None:
        cfg.method.options["sgd_lr"] = option
    sink = _Said()
    Federation(cfg, progress=sink)
    notes = [line for line in sink.lines if "trains with SGD" in line]
    assert notes == ([] if said is None else [said + " — set train.sgd_lr to choose its rate"])
