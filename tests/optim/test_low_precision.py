"""bf16 / fp16 clients train on what they upload (issue 40, defect 4).

GaLoreAdamW records the *intended* fp32 update of every GaLore matrix (the exact low-rank record
the client uploads). With bf16 weights most of a small step used to be rounded away, so the
client's own model moved by a third of what it uploaded and 90 % of its entries never changed
(512², r 32, lr 1e-4, |W| ~ 0.02). ``low_precision="compensated"`` (the default) keeps what the
rounding lost and adds it back on the next step; ``"master"`` keeps an fp32 master copy. Either
way the client's own ``W_T − W_0`` equals its upload to the weights' resolution. For every
method, the upload is checked against the client's own change of its effective weights."""
from __future__ import annotations

import pytest
import torch

from fedgalore.optim import client_protocol
from fedgalore.methods.base import available_methods, get_method
from fedgalore.optim.galore_adamw import GaLoreAdamW
from fedgalore.protocol.payload import transfer
from fedgalore.protocol.state import ClientContext, RoundContext
from fedgalore.protocol.train_config import TrainConfig
from fedgalore.tasks.base import resolve_target_modules
from fedgalore.tasks.synthetic import TinyTextTask


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the spacing of ``w``'s dtype at each entry's magnitude (fp32 for the comparison)."""
    wf = w.float().abs()
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[w.dtype]
    tiny = torch.finfo(w.dtype).tiny
    exp = torch.floor(torch.log2(wf.clamp_min(tiny)))
    return torch.pow(2.0, exp - mant) / 2


def _train(dtype, mode, m=128, n=96, r=8, lr=1e-4, steps=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(m, n, generator=g) * 0.02).to(dtype))
    w0 = w.detach().clone()
    opt = GaLoreAdamW([{"params": [("w", w)], "rank": r, "update_proj_gap": 200, "projector": "rsvd",
                        "low_precision": mode}], lr=lr, weight_decay=0.01)
    client_protocol.mark(opt)
    for _ in range(steps):
        w.grad = (torch.randn(m, n, generator=g) * 0.01).to(dtype)
        opt.step()
    record = client_protocol.export_update(opt)["w"].materialize(w0.float())
    return w.detach(), w0, record


def test_bf16_without_compensation_loses_most_of_the_update():
    """The defect as measured (the baseline of the fix): with the rounding lost, the bf16 client's
    weights move by about half of what it uploads and most entries never change."""
    w, w0, record = _train(torch.bfloat16, "off")
    assert float((w.float() - w0.float()).norm() / record.norm()) < 0.7
    assert float((w == w0).float().mean()) > 0.5


@pytest.mark.parametrize("mode", ["compensated", "master"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_client_moves_by_what_it_uploads(dtype, mode):
    w, w0, record = _train(dtype, mode)
    actual = w.float() - w0.float()
    # entrywise: the upload and the client's own change differ by at most one unit of the weights'
    # dtype (the rounding W_T holds back, at the larger of |W_0| and |W_T|)
    # (and, below the dtype's smallest normal number, the subnormal spacing: a residual smaller than
    # it cannot be kept, once per step)
    ulp = 2 * _half_ulp(torch.maximum(w.float().abs(), w0.float().abs()).to(dtype))
    sub = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}[dtype]
    per = 1.01 if dtype != torch.float32 else 14  # fp32 has no compensation: its own rounding, once per step
    # (fp32: the record's own fp32 rounding, relative to the update, bounds it too)
    slack = 1e-4 * float(record.abs().max()) if dtype == torch.float32 else 0.0
    assert bool(((actual - record).abs() <= ulp * per + 12 * sub + slack + 1e-12).all())
    assert float((actual - record).norm() / record.norm()) < (0.5 if dtype == torch.bfloat16 else 0.1)
    if dtype != torch.float32:
        # and far more entries move than without compensation
        w_off, w0_off, _ = _train(dtype, "off")
        assert float((w != w0).float().mean()) > float((w_off != w0_off).float().mean())


def test_compensated_and_master_make_the_same_weights():
    """Both keep the lost rounding (as a bf16 residual or in an fp32 master): the weights agree
    to within a unit of bf16 rounding, and the fp32 state the two cost differs (2 vs 4 bytes
    per entry)."""
    wc, _, rc = _train(torch.bfloat16, "compensated")
    wm, _, rm = _train(torch.bfloat16, "master")
    torch.testing.assert_close(rc, rm, rtol=1e-4, atol=1e-7)
    assert bool(((wc.float() - wm.float()).abs() <= 2 * _half_ulp(wm) + 1e-12).all())


def test_eps_zero_with_a_silent_coordinate_is_caught_by_nonfinite():
    """eps = 0 and a projected-gradient row that is 0 where the second moment is 0: the update
    would be 0/0 = NaN in W. ``nonfinite: raise`` names the parameter; ``skip`` leaves W as it was."""
    def problem(policy):
        w = torch.nn.Parameter(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)))
        opt = GaLoreAdamW([{"params": [("w", w)], "rank": 3, "projector": "svd", "nonfinite": policy}], lr=1e-2, eps=0.0)
        g = torch.zeros(12, 8)
        g[:6] = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))  # rows 6-11 silent
        w.grad = g
        return w, opt
    w, opt = problem("raise")
    with pytest.raises(FloatingPointError, match="'w'.*eps = 0"):
        opt.step()
    w, opt = problem("skip")
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w.detach(), before) and opt.state[w].skipped == 1
    assert bool(torch.isfinite(w).all())


# ----------------------------------------------------------------------------- every method
def _effective(method, model, targets):
    """The client's effective weight of every adapted matrix: the weight itself, or for a LoRA
    method base + scaling · B A."""
    out = {}
    for t in targets:
        if hasattr(method, "lora_a"):
            base = method.base_weight(model, t).detach().float()
            out[t] = base + method.scaling * method.adapter_product(model, t)  # B A (Fed-SB: B R A)
        else:
            out[t] = dict(model.named_parameters())[f"{t}.weight"].detach().float().clone()
    return out


@pytest.fixture(scope="module")
def task():
    return TinyTextTask(n_train=64, n_test=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# the built-in methods only: other test modules register deliberately faulty ones (test_faults.py)
@pytest.mark.parametrize("name", [m for m in sorted(available_methods()) if not m.startswith("test_")])
def test_every_methods_upload_is_the_clients_own_change(task, name, dtype):
    """For every method at bf16 and fp32 (fp16: above, at the optimizer; a whole fp16 model needs
    loss scaling, which no method has): the dense update the server reads from the upload
    (``client_deltas``) equals the client's own change of its effective weights, ``W_T − W_0``,
    to the rounding of the weights' dtype (measured from the weights as they were when training
    began, after the broadcast was loaded into them)."""
    meth = get_method(name, rank=4)
    model = task.build_model().to(dtype)
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    heads = [n for n, _ in model.named_parameters() if n.startswith("classifier.")]
    model = meth.setup(model, targets, heads)
    state = meth.init_server_state(model)
    bcast = meth.broadcast(state, RoundContext(0, 2, 1234, [0], [1.0]))
    start: dict = {}

    shared_a = name == "fedsa_lora"  # its server compares the change of the shared A (it never learns a site's B)
    measure = (lambda: {t: meth.lora_a(model, t).detach().float().clone() for t in targets}) if shared_a else (
        lambda: _effective(meth, model, targets))

    def at_step(micro, loss):  # before the first optimizer step: the weights training starts from
        if micro == 0:
            start.update(measure())

    idx = list(range(16))
    steps = 6
    tc = TrainConfig(lr=1e-3, batch_size=16, local_steps=steps)
    ctx = ClientContext(0, 2, 0, 1234, 16, tc, targets, heads, task.loss,
                        lambda: (task.train_set().batch(idx) for _ in range(steps)), steps, steps, on_step=at_step,
                        state={} if meth.traits.keeps_client_state else None)  # FedSA-LoRA keeps its B in the site's store
    upload = meth.client_update(model, transfer(bcast), ctx)
    end = measure()
    deltas = meth.client_deltas(state, upload)
    weight_names = {t: next(k for k in deltas if k.startswith(t)) for t in targets}
    for t in targets:
        up = deltas[weight_names[t]].float()
        own = end[t] - start[t]
        assert float(up.norm()) > 0, f"{name}: no update for {t}"
        # the broadcast's own rounding into the client's dtype (W_0 = round(broadcast)) and W_T's
        # rounding bound the difference; LoRA methods upload their factors, so only the products'
        # rounding remains
        mag = torch.maximum(end[t].abs(), start[t].abs()).to(dtype)
        bound = 2 * _half_ulp(mag) * (1.01 if dtype != torch.float32 else steps + 2)  # fp32: its rounding, once per step
        assert bool(((up - own).abs() <= bound).all()), (
            f"{name} {dtype}: upload − own change max {float((up - own).abs().max()):.3g}, ‖own‖ {float(own.norm()):.3g}")
