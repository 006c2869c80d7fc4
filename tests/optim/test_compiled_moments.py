"""The moment step compiled (issue 43: ``GaLoreAdamW(compile_moments=...)``, fedgalore.optim.bucket):
the per-step numbers (ε·c₂, the cold cap) enter as tensors, so a new step, a new learning rate or a
new bias correction never recompiles — counted with a counting backend — and the compiled step
equals the eager one."""
from __future__ import annotations

import pytest
import torch

from fedgalore.optim import GaLoreAdamW


torch_dynamo = pytest.importorskip("torch._dynamo.testing")

SHAPES = [(24, 16), (16, 40), (24, 16), (32, 32), (16, 40), (32, 32), (40, 8)]  # and a bucket of one


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(0.1 * torch.randn(*s, generator=g)) for s in SHAPES]


def _opt(params, compile_moments, **group) -> GaLoreAdamW:
    base = {"rank": 4, "projector": "rsvd_then_random", "update_proj_gap": 4, "scale": 0.5, **group}
    return GaLoreAdamW([{"params": [(f"w{i}", p) for i, p in enumerate(params)], **base}],
                       lr=1e-2, weight_decay=0.1, projection_seed=7, compile_moments=compile_moments)


def _step(opt, params, t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(*p.shape, generator=g)
    opt.param_groups[0]["lr"] = 1e-2 * (1.0 - t / 20)  # a schedule: a new learning rate every step
    opt.step()


@pytest.mark.parametrize("group", [{}, {"bias_correction": "weight", "cap_to_cold": True}], ids=["steps", "weight-cap"])
def test_no_recompilation_across_steps_and_equal_to_eager(group):
    torch._dynamo.reset()
    # dynamo's stricter float policy (a Python float argument is a constant: each new value
    # recompiles): the per-step numbers must reach the compiled code as tensors under either policy
    with torch._dynamo.config.patch(specialize_float=True):
        _run_both(group)


def _run_both(group) -> None:
    counter = torch_dynamo.CompileCounter()
    a, b = _params(), _params()
    oa, ob = _opt(a, counter, **group), _opt(b, False, **group)
    _step(oa, a, 0)
    _step(ob, b, 0)
    first = counter.frame_count
    assert 1 <= first <= 4  # the four bucket shapes: at most one graph each (or dynamic graphs)
    for t in range(1, 10):  # new lr, new c₂ every step, refreshes at steps 4 and 8
        _step(oa, a, t)
        _step(ob, b, t)
    assert counter.frame_count == first
    for pa, pb in zip(a, b):
        assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-7)
    for pa, pb in zip(a, b):
        assert torch.allclose(oa.state[pa].exp_avg_sq, ob.state[pb].exp_avg_sq, rtol=1e-5, atol=1e-12)


def test_compiled_optimizer_pickles_and_loads():
    import pickle

    params = _params()
    opt = _opt(params, "aot_eager")
    _step(opt, params, 0)
    again = pickle.loads(pickle.dumps(opt))
    assert again._compile == "aot_eager"
    fresh = _opt(_params(), "aot_eager")
    fresh.load_state_dict(opt.state_dict())


def test_a_failing_compile_is_one_clear_error():
    params = _params()
    opt = _opt(params, "no_such_backend")
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(*p.shape, generator=g)
    with pytest.raises(RuntimeError, match="compile_moments='no_such_backend'.*set compile_moments to False"):
        opt.step()
