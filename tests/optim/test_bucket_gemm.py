"""The stacked GEMMs of a bucket (issue 43; group key ``bucket_gemm``, fedgalore.optim.kernels):
the projection of the matrices of one weight shape and side as one ``bmm``, their back-projection as
one ``bmm`` and two multi-tensor ops. Equal to the per-matrix GEMMs to fp32 rounding on every path
of the step (both sides, bias corrections, the cold cap, compat, refreshes that move the moments);
a non-finite matrix is skipped (or named) alone; low-precision weights keep their per-matrix path;
large buckets are cut into chunks; ``auto`` keeps the CPU per matrix."""
from __future__ import annotations

import pytest
import torch

import fedgalore.optim.kernels as kernels
from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW

pytestmark = pytest.mark.isa

#: two shapes of each side, two matrices each, and a right-side shape whose moments have the
#: shape of another's (24 x 4) but whose weights do not: one moment shape, two GEMM buckets
SHAPES = [(24, 16), (16, 40), (24, 16), (32, 32), (16, 40), (32, 32), (24, 20), (24, 20)]

VARIANTS = {
    "steps": {},
    "weight-cap": {"bias_correction": "weight", "cap_to_cold": True},
    "track-cold": {"track_cold": True},
    "compat": {"galore_torch_compat": True},
    "svd-tau3": {"projector": "svd", "update_proj_gap": 3},
    "rsvd-reset": {"projector": "rsvd", "update_proj_gap": 2, "moment_transfer": "reset"},
    "epoch": {"projector": "rsvd_then_random", "seeded_from_step": 3},
}


def _params(seed: int = 0, dtypes=None) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    return [torch.nn.Parameter((0.1 * torch.randn(*s, generator=g)).to(d)) for s, d in zip(SHAPES, dtypes)]


def _grads(t: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(*p.shape, generator=g).to(p.dtype) for p in params]


def _opt(params, gemm: str, **group) -> GaLoreAdamW:
    base = {"rank": 4, "projector": "random", "update_proj_gap": 1000, "scale": 0.5, "bucket_gemm": gemm, **group}
    return GaLoreAdamW([{"params": [(f"w{i}", p) for i, p in enumerate(params)], **base}],
                       lr=1e-2, weight_decay=0.1, projection_seed=7)


def _run(opt, params, steps: int, bad: dict | None = None) -> None:
    for t in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(t, params))):
            if bad and (t, i) in bad:
                g.view(-1)[0] = bad[(t, i)]
            p.grad = g
        opt.step()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)


@pytest.fixture
def counted(monkeypatch):
    """How many matrices each stacked projection / back-projection call took."""
    calls: dict[str, list[int]] = {"project": [], "back": []}
    proj, back = kernels.project_stacked, kernels.decay_back_project_stacked

    def p(gs, bases, side):
        calls["project"].append(len(gs))
        return proj(gs, bases, side)

    def b(ws, u, bases, side, decays, coefs):
        calls["back"].append(len(ws))
        return back(ws, u, bases, side, decays, coefs)

    monkeypatch.setattr(kernels, "project_stacked", p)
    monkeypatch.setattr(kernels, "decay_back_project_stacked", b)
    return calls


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_stacked_gemms_equal_the_per_matrix_step(variant, counted):
    """Eight matrices (four GEMM buckets of two) stepped with stacked GEMMs against the per-matrix
    GEMMs: the same weights, moments and update record to fp32 rounding over 6 steps, one stacked
    projection and back-projection per bucket and step."""
    opts = VARIANTS[variant]
    a, b = _params(), _params()
    oa, ob = _opt(a, "stacked", **opts), _opt(b, "per_matrix", **opts)
    client_protocol.mark(oa)
    client_protocol.mark(ob)
    _run(oa, a, 6)
    _run(ob, b, 6)
    assert counted["project"] == [2] * 24 and counted["back"] == [2] * 24
    for pa, pb, w0 in zip(a, b, _params()):
        assert _close(pa, pb) and not _close(pa, w0)
        for k in ("exp_avg", "exp_avg_sq", "v_weight", "cold_v"):
            if getattr(ob.state[pb], k) is not None:
                assert _close(getattr(oa.state[pa], k), getattr(ob.state[pb], k)), k
    ua, ub = client_protocol.export_update(oa), client_protocol.export_update(ob)
    for n, w0 in zip(ua, _params()):
        assert _close(ua[n].materialize(w0.detach()), ub[n].materialize(w0.detach())), n


def test_auto_keeps_the_cpu_per_matrix(counted):
    params = _params()
    _run(_opt(params, "auto"), params, 2)
    assert counted == {"project": [], "back": []}


def test_chunks_of_a_large_bucket(monkeypatch, counted):
    """A bucket whose stack would pass STACK_BYTES is cut into chunks; the step is the same."""
    monkeypatch.setattr(kernels, "STACK_BYTES", 24 * 16 * 4)  # one matrix of the 24x16 shape per chunk
    a, b = _params(), _params()
    _run(_opt(a, "stacked"), a, 3)
    _run(_opt(b, "per_matrix"), b, 3)
    assert 1 in counted["project"]
    for pa, pb in zip(a, b):
        assert _close(pa, pb)


def test_low_precision_weights_keep_their_path(counted):
    """bf16 matrices in a stacked group take the per-matrix step (their compensated working
    weight); the fp32 ones stack; both equal the per-matrix run."""
    dtypes = [torch.bfloat16 if i % 4 == 0 else torch.float32 for i in range(len(SHAPES))]
    a, b = _params(dtypes=dtypes), _params(dtypes=dtypes)
    _run(_opt(a, "stacked"), a, 4)
    _run(_opt(b, "per_matrix"), b, 4)
    assert counted["project"] and all(n <= 2 for n in counted["project"])
    for pa, pb in zip(a, b):
        assert pa.dtype == pb.dtype and _close(pa, pb)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_matrix_of_a_stacked_bucket(bad):
    """Under ``skip`` only the bad matrix misses its step (the other of its bucket steps as
    per-matrix); under ``raise`` the error names it."""
    a, b = _params(), _params()
    oa = _opt(a, "stacked", nonfinite="skip")
    ob = _opt(b, "per_matrix", nonfinite="skip")
    _run(oa, a, 3, bad={(1, 2): bad})
    _run(ob, b, 3, bad={(1, 2): bad})
    assert oa.state[a[2]].skipped == 1 and oa.state[a[0]].skipped == 0
    for pa, pb in zip(a, b):
        assert torch.isfinite(pa).all() and _close(pa, pb)
    c = _params()
    with pytest.raises(FloatingPointError, match="'w2'"):
        _run(_opt(c, "stacked"), c, 3, bad={(1, 2): bad})


def test_unknown_bucket_gemm_is_refused():
    with pytest.raises(ValueError, match="bucket_gemm"):
        _opt(_params(), "bmm")
