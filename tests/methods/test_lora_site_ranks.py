"""LoRA methods at a rank per site (``federation.site_ranks``; fedgalore.methods.lora_common):
FLoRA, FlexLoRA and HetLoRA with sites at ranks 2, 4 and 8 — adapters prepared at the frame rank
with the method's scaling, each upload of its site's shape, the masked tail exactly zero (and
AdamW's moments there), FLoRA's stacked aggregate exact at mixed ranks; every other LoRA method
refuses site ranks in one line."""
from __future__ import annotations

import pytest
import torch

import fedgalore.methods  # noqa: F401  (registers the built-in methods)
from fedgalore.methods.base import MethodError, available_methods, get_method, method_class
from fedgalore.methods.lora_common import LoraMethod, pair_key, w_key
from fedgalore.protocol.state import ClientContext, RoundContext
from fedgalore.protocol.train_config import TrainConfig
from fedgalore.tasks.base import resolve_target_modules
from fedgalore.tasks.synthetic import TinyTextTask


RANKS = [2, 4, 8]
#: the package's LoRA methods, by whether they declare site ranks (MethodTraits.site_ranks)
_LORA = [n for n in available_methods() if issubclass(method_class(n), LoraMethod)
         and method_class(n).__module__.startswith("fedgalore.methods.")]
SITE_METHODS = [n for n in _LORA if method_class(n).traits.site_ranks]
OTHER_METHODS = [n for n in _LORA if not method_class(n).traits.site_ranks]


@pytest.fixture(scope="module")
def task():
    return TinyTextTask(n_train=96, n_test=32)


def prepared(task, name, site_ranks=RANKS, rank=4, **options):
    meth = get_method(name, rank=rank, **options)
    meth.use_site_ranks(site_ranks)
    model = task.build_model()
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    heads_ = [n for n, _ in model.named_parameters() if n.startswith("classifier.")]
    return meth, meth.setup(model, targets, heads_), targets, heads_


def ctx_for(task, targets, heads_, client, steps=3, rnd=0):
    idx = list(range(16 * client, 16 * client + 16))

    def batches():
        for _ in range(steps):
            yield task.train_set().batch(idx)

    tc = TrainConfig(lr=1e-2, batch_size=16, local_steps=steps, weight_decay=0.01)
    return ClientContext(rnd, 2, client, 1234 + rnd, 16, tc, targets, heads_, task.loss, batches, steps, steps)


@pytest.mark.parametrize("name", SITE_METHODS)
def test_each_site_trains_and_uploads_its_own_rank(task, name):
    meth, model, targets, heads_ = prepared(task, name)
    assert meth.frame_rank == 8
    layer = meth.layer(model, targets[0])
    assert layer.r["default"] == 8 and layer.scaling["default"] == pytest.approx(meth.scaling, rel=1e-12)
    assert meth.scaling == 2.0  # α = 2·method.rank: s = 2 at every site, PEFT's α_i = 2·r_i rule
    state = meth.init_server_state(model)
    bc = meth.broadcast(state, RoundContext(0, 2, 1234, [0, 1, 2], [0.2, 0.5, 0.3]))
    ups = []
    for client, r in enumerate(RANKS):
        up = meth.client_update(model, bc, ctx_for(task, targets, heads_, client))
        ups.append(up)
        for m in targets:
            out_f, in_f = meth.shapes[m]
            e = up[pair_key(m)]
            assert tuple(e.left.shape) == (out_f, r) and tuple(e.right.shape) == (r, in_f)
            a, b = meth.lora_a(model, m).detach(), meth.lora_b(model, m).detach()
            assert not a[r:].any() and not b[:, r:].any(), f"site {client}: the tail past rank {r} moved"
            assert torch.equal(e.left, b[:, :r]) and torch.equal(e.right, a[:r])
            assert b[:, :r].any()  # the leading block trained
        assert meth.validate_upload(state, up, None) is None
    # an upload of another site's rank is rejected
    forged = type(ups[0])(ups[2].entries, {**ups[2].meta, "client": 0})
    assert "!=" in meth.validate_upload(state, forged, None)
    # the hooks are gone after the round: a full-rank gradient reaches the tail again
    model.zero_grad()
    batch = task.train_set().batch(list(range(8)))
    task.loss(model, batch).backward()
    grads = [meth.lora_b(model, m).grad for m in targets]
    assert any(g is not None and g[:, 2:].abs().sum() > 0 for g in grads)


def test_flora_stacking_at_mixed_ranks_is_the_exact_weighted_sum_of_products(task):
    meth, model, targets, heads_ = prepared(task, "flora")
    state = meth.init_server_state(model)
    w_old = {m: state.params[w_key(m)].clone() for m in targets}
    p = [0.2, 0.5, 0.3]
    rctx = RoundContext(0, 2, 1234, [0, 1, 2], p, True)
    bc = meth.broadcast(state, rctx)
    ups = [meth.client_update(model, bc, ctx_for(task, targets, heads_, c)) for c in range(3)]
    deltas = [meth.client_deltas(state, u) for u in ups]
    meth.aggregate(state, ups, p, rctx)
    for m in targets:
        want = meth.scaling * sum(pi * (u[pair_key(m)].left.float() @ u[pair_key(m)].right.float()) for pi, u in zip(p, ups))
        torch.testing.assert_close(state.params[w_key(m)] - w_old[m], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sum(pi * d[w_key(m)] for pi, d in zip(p, deltas)), want, rtol=1e-5, atol=1e-6)
    # client-level DP's reference of a rank-2 upload: the leading rows of the fresh frame-rank A it started from
    meth.init_adapters(model, meth.fresh_seed(1234, 0))
    ref = meth.release_reference(bc, pair_key(targets[0]), ups[0])
    assert torch.equal(ref.right, meth.lora_a(model, targets[0]).detach().float()[:2]) and ref.left.shape[1] == 2


@pytest.mark.parametrize("name", ["flexlora", "hetlora"])
def test_a_site_starts_from_the_leading_block_of_the_global_factors(task, name):
    meth, model, targets, heads_ = prepared(task, name)
    state = meth.init_server_state(model)
    g = torch.Generator().manual_seed(5)
    for m in targets:  # a non-trivial global pair
        state.params[f"{m}.lora_B.weight"] = torch.randn(state.params[f"{m}.lora_B.weight"].shape, generator=g)
    bc = meth.broadcast(state, RoundContext(0, 2, 1234, [0], [1.0]))
    ctx = ctx_for(task, targets, heads_, client=0)
    meth.load_broadcast(model, bc, ctx)
    adapters, heads = meth.trainable(model)
    opt = meth.build_optimizer(ctx, adapters, heads)
    with meth.site_rank_mask(model, opt, 0):
        for m in targets:
            b, a = meth.lora_b(model, m).detach(), meth.lora_a(model, m).detach()
            assert torch.equal(b[:, :2], state.params[f"{m}.lora_B.weight"][:, :2]) and not b[:, 2:].any()
            assert torch.equal(a[:2], state.params[f"{m}.lora_A.weight"][:2]) and not a[2:].any()


def test_the_mask_keeps_adamw_moments_zero_on_the_tail(task):
    meth, model, targets, heads_ = prepared(task, "hetlora")
    ctx = ctx_for(task, targets, heads_, client=0)
    meth.load_broadcast(model, meth.broadcast(meth.init_server_state(model), RoundContext(0, 2, 1234, [0], [1.0])), ctx)
    adapters, heads = meth.trainable(model)
    opt = meth.build_optimizer(ctx, adapters, heads)
    batch = task.train_set().batch(list(range(16)))
    with meth.site_rank_mask(model, opt, 0):
        for _ in range(3):
            opt.zero_grad()
            task.loss(model, batch).backward()
            for p in adapters:  # a gradient written past the hooks (record-level DP's noise) ...
                p.grad.add_(1e-3)
            opt.step()
    for m in targets:
        a, b = meth.lora_a(model, m), meth.lora_b(model, m)
        assert not a.detach()[2:].any() and not b.detach()[:, 2:].any()  # ... is zeroed after the step
        assert a.detach()[:2].any() and b.detach()[:, :2].any()
    # without the injected gradient the moments stay zero on the tail
    opt2 = meth.build_optimizer(ctx, adapters, heads)
    with meth.site_rank_mask(model, opt2, 0):
        opt2.zero_grad()
        task.loss(model, batch).backward()
        opt2.step()
    for m in targets:
        st = opt2.state[meth.lora_a(model, m)]
        assert not st["exp_avg"][2:].any() and not st["exp_avg_sq"][2:].any() and st["exp_avg"][:2].any()


def test_without_site_ranks_nothing_changes(task):
    meth, model, targets, _ = prepared(task, "flora", site_ranks=None)
    assert meth.frame_rank == 4 and meth.layer(model, targets[0]).r["default"] == 4
    assert meth.site_rank(0) is None
    # a site at the frame rank masks nothing either
    m2, _, _, _ = prepared(task, "hetlora", site_ranks=[8, 8, 2])
    assert m2.site_rank(0) is None and m2.site_rank(2) == 2


def test_both_lists_are_nonempty():
    assert SITE_METHODS and OTHER_METHODS


@pytest.mark.parametrize("name", OTHER_METHODS)
def test_other_lora_methods_refuse_site_ranks_in_one_line(name):
    with pytest.raises(MethodError) as err:
        get_method(name, rank=4).use_site_ranks([2, 4, 8])
    msg = str(err.value)
    assert "\n" not in msg and f"method {name!r}" in msg and "federation.site_ranks" in msg
