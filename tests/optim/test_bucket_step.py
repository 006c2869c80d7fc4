"""GaLore's moments as data (issue 43, fedgalore.optim.bucket): matrices of one shape are stepped as
one stacked bucket. The bucketed step equals the step of each matrix alone (its own group: a bucket
of one) bit for bit on every path of the torch algebra (steps / weight bias correction, the cold
cap, track_cold, compat, left and right sides, refreshes that replace the moments); the state stays
per parameter (views into the stacks) through state_dict, pickling and warm starts; a non-finite
matrix is skipped alone; one moment call per bucket."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fedgalore.optim.bucket as bucket
from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW
from fedgalore.optim import kernels

pytestmark = pytest.mark.isa

#: three shapes, two matrices of each (interleaved, as a model's layers), both sides
SHAPES = [(24, 16), (16, 40), (24, 16), (32, 32), (16, 40), (32, 32)]

VARIANTS = {
    "steps": {},
    "weight": {"bias_correction": "weight"},
    "weight-cap": {"bias_correction": "weight", "cap_to_cold": True},
    "track-cold": {"track_cold": True},
    "compat": {"galore_torch_compat": True},
    "svd-tau3": {"projector": "svd", "update_proj_gap": 3},
    "reset": {"projector": "rsvd", "update_proj_gap": 2, "moment_transfer": "reset"},
}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The torch algebra for every size (the AVX2 kernel path is per matrix and has its own tests)."""
    monkeypatch.setattr(kernels, "ONEDNN_MIN_NUMEL", 1 << 62)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.1 * torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(t: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _opt(params, together: bool, **group) -> GaLoreAdamW:
    base = {"rank": 4, "projector": "random", "update_proj_gap": 1000, "scale": 0.5, **group}
    named = [(f"w{i}", p) for i, p in enumerate(params)]
    groups = [{"params": named, **base}] if together else [{"params": [np_], **base} for np_ in named]
    return GaLoreAdamW(groups, lr=1e-2, weight_decay=0.1, projection_seed=7)


def _run(opt, params, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(t)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_bucket_steps_exactly_as_each_matrix_alone(variant):
    """Six matrices in one group (three buckets of two) against each in its own group (six buckets
    of one): the same weights, moments and update record, bit for bit, over refreshes."""
    opts = VARIANTS[variant]
    a, b = _params(), _params()
    oa, ob = _opt(a, True, **opts), _opt(b, False, **opts)
    client_protocol.mark(oa)
    client_protocol.mark(ob)
    _run(oa, a, 7)
    _run(ob, b, 7)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        sa, sb = oa.state[pa], ob.state[pb]
        for k in ("exp_avg", "exp_avg_sq", "v_weight", "cold_v"):
            assert (getattr(sa, k) is None) == (getattr(sb, k) is None)
            if getattr(sa, k) is not None:
                assert torch.equal(getattr(sa, k), getattr(sb, k)), k
    ua, ub = client_protocol.export_update(oa), client_protocol.export_update(ob)
    w0 = dict(zip(ua, _params()))
    for n in ua:
        assert torch.equal(ua[n].materialize(w0[n].detach()), ub[n].materialize(w0[n].detach())), n
    # the six matrices' moments live in three stacks of two (views), the lone ones in their own
    storages = {oa.state[p].exp_avg.untyped_storage().data_ptr() for p in a}
    assert len(storages) == 3
    assert oa.state[a[0]].exp_avg._base is not None and oa.state[a[0]].exp_avg._base.shape[0] == 2


def test_one_moment_call_per_bucket(monkeypatch):
    calls = []
    real = bucket.adam_moments

    def counted(r, *args, **kw):
        calls.append(r.shape[0])
        return real(r, *args, **kw)

    monkeypatch.setattr(bucket, "adam_moments", counted)
    params = _params()
    opt = _opt(params, True)
    _run(opt, params, 3)
    assert sorted(calls) == [2] * 9  # three buckets of two, three steps


def test_state_dict_pickle_and_resume_keep_the_run_exact():
    """state_dict (views of the stacks) loads into a fresh optimizer, pickles, and the continued
    run equals the uninterrupted one; the saved state is per parameter."""
    ref = _params()
    o_ref = _opt(ref, True, bias_correction="weight", cap_to_cold=True)
    _run(o_ref, ref, 6)
    cut = _params()
    o_cut = _opt(cut, True, bias_correction="weight", cap_to_cold=True)
    _run(o_cut, cut, 3)
    sd = o_cut.state_dict()
    assert all(sd["state"][i]["exp_avg"].shape == o_cut.state[p].exp_avg.shape for i, p in enumerate(cut))
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in cut]
    o_res = _opt(resumed, True, bias_correction="weight", cap_to_cold=True)
    o_res.load_state_dict(pickle.loads(pickle.dumps(copy.deepcopy(sd))))
    _run(o_res, resumed, 3, start=3)
    again = pickle.loads(pickle.dumps(o_cut))  # the optimizer itself (a site's helper ranks get it so)
    assert isinstance(again._buckets, bucket.MomentBuckets)
    for p, q in zip(ref, resumed):
        assert torch.equal(p, q)


def test_replaced_moments_are_restacked():
    """A state tensor replaced from outside (as a refresh's moment move or a warm start does) is
    noticed: the bucket is stacked again from the states, nothing is lost."""
    params = _params()
    opt = _opt(params, True)
    _run(opt, params, 2)
    st = opt.state[params[0]]
    st.exp_avg_sq = st.exp_avg_sq.clone() * 2  # no longer a view of its stack
    expect = st.exp_avg_sq.clone()
    twin = _params()
    o2 = _opt(twin, False)
    _run(o2, twin, 2)
    o2.state[twin[0]].exp_avg_sq.mul_(2)
    _run(opt, params, 1, start=2)
    _run(o2, twin, 1, start=2)
    assert torch.equal(params[0], twin[0]) and not torch.equal(expect, st.exp_avg_sq)
    assert opt.state[params[0]].exp_avg_sq._base is not None


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_non_finite_matrix_in_a_bucket_is_handled_alone(policy):
    params = _params()
    opt = GaLoreAdamW([{"params": [(f"w{i}", p) for i, p in enumerate(params)], "rank": 4, "projector": "random",
                        "update_proj_gap": 1000}], lr=1e-2, nonfinite=policy)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(0)):
        p.grad = g.clone()
    params[2].grad[3, 5] = float("nan")  # the second matrix of the first bucket
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="'w2'"):
            opt.step()
        return
    opt.step()
    assert torch.equal(params[2], before[2]) and opt.state[params[2]].skipped == 1 and opt.state[params[2]].step == 0
    for i in (0, 1, 3, 4, 5):
        assert not torch.equal(params[i], before[i]) and opt.state[params[i]].step == 1
