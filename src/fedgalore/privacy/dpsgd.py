"""DP-SGD at one site, through Opacus, around each method's own optimizer (docs/privacy.md).

One client-round of record-level DP (Abadi et al. 2016), as :func:`fedgalore.federated.client.
local_train` runs it when the client's context carries a :class:`DPSGD`:

* **Batches** — Poisson sampling: every optimizer step takes each of the site's ``n`` examples
  independently with probability ``q`` (Opacus' ``UniformWithReplacementSampler``, the sampler of
  its ``DPDataLoader``; :func:`poisson_steps`), for the same number of steps ``T`` the engine's
  shuffled epochs would take. A step may be empty; it still adds noise and steps.
* **Per-example gradients** — Opacus' ``GradSampleModule`` hooks on the model: its own
  per-sample gradient rules for the layers it knows (``Linear``, ``Embedding``, ``LayerNorm``,
  ``Conv*``, ...) and, for a trainable layer it has no rule for, ``torch.func`` (``vmap`` of
  ``grad``), which Opacus falls back to itself (:func:`per_sample_support` says which layer
  takes which). A trainable layer with buffers (e.g. BatchNorm, whose statistics mix examples)
  cannot be made private: :func:`wrap_problem`.
* **Clip and noise** — Opacus' ``DPOptimizer`` around the method's optimizer (``GaLoreAdamW``,
  ``AdamW`` or ``SGD``, untouched): each example's gradient over all trained tensors together is
  clipped to L2 norm ``C``, the clipped gradients are summed, ``N(0, σ²C²I)`` is added, and the
  sum is divided by the expected batch ``q·n`` (:meth:`DPSGD.privatise`). ``p.grad`` then holds
  the privatised gradient and the method's optimizer steps on it — so whatever it derives from
  the gradient (GaLore's RSVD projector, both moments, the update record, AdamW's state, the
  uploaded second moment) is post-processing of the privatised gradients. The raw gradient
  autograd also leaves in ``p.grad`` is overwritten before the optimizer runs.

With ``train.grad_accum_steps = k`` the step's Poisson batch (expected ``q·n = batch_size·k``
examples) is cut into ``k`` micro-batches; their per-example gradients are concatenated and
clipped one by one, as in one batch.

Randomness (fedgalore.privacy.randomness): the caller passes the sampling's and the noise's seeds
— by default fresh OS entropy per client-round, with ``secure_mode=True`` (Opacus' secure
Gaussian sampling in ``DPOptimizer``, against floating-point attacks); under
``privacy.reproducible: true`` seeds derived from the run's seed, round and client, with
``secure_mode=False`` (reproducible, resumable, for studies — whoever knows the seed can
regenerate the noise). ``torchcsprng``, which Opacus' ``PrivacyEngine`` uses for secure mode, is
not used (it does not build for current torch): the generators are torch's, seeded with 63 bits of
OS entropy.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from fedgalore.privacy.randomness import entropy_seed

__all__ = ["DPSGD", "poisson_steps", "per_sample_support", "wrap_problem", "entropy_seed"]


def poisson_steps(num_examples: int, rate: float, steps: int, micro_batches: int, seed: int) -> list[np.ndarray]:
    """Positions (into the site's ``num_examples`` examples) of ``steps`` Poisson-sampled batches,
    each cut into ``micro_batches`` consecutive parts (some possibly empty): ``steps ×
    micro_batches`` arrays. Each example joins each step with probability ``rate``, independently
    (Opacus' ``UniformWithReplacementSampler`` on a generator seeded with ``seed``)."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    if steps <= 0 or num_examples <= 0:
        return []
    g = torch.Generator().manual_seed(int(seed))
    sampler = UniformWithReplacementSampler(num_samples=int(num_examples), sample_rate=float(rate), generator=g, steps=int(steps))
    out: list[np.ndarray] = []
    for idx in sampler:
        out += np.array_split(np.asarray(idx, dtype=np.int64), max(int(micro_batches), 1))
    return out


def _trainable_layers(model: nn.Module) -> list[nn.Module]:
    """The layers Opacus' ``GradSampleModule`` hooks (its ``iterate_submodules``): modules with
    trainable parameters of their own; a layer without a rule of Opacus is taken whole."""
    from opacus import GradSampleModule

    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        own = any(p.requires_grad for p in m.parameters(recurse=False))
        if own:
            out.append(m)
            if type(m) not in GradSampleModule.GRAD_SAMPLERS:
                return
        for c in m.children():
            visit(c)

    visit(model)
    return out


def per_sample_support(model: nn.Module) -> dict[str, list[str]]:
    """How each trainable layer's per-example gradients are computed: ``{"opacus": [layer
    types with Opacus' own rule], "torch_func": [layer types Opacus hands to torch.func]}``."""
    from opacus import GradSampleModule

    own, func = set(), set()
    for m in _trainable_layers(model):
        (own if type(m) in GradSampleModule.GRAD_SAMPLERS else func).add(type(m).__name__)
    return {"opacus": sorted(own), "torch_func": sorted(func)}


def wrap_problem(model: nn.Module) -> str | None:
    """Why Opacus cannot compute private per-example gradients for ``model`` as it trains, or
    None: its ``GradSampleModule`` refuses a trainable layer with buffers (e.g. BatchNorm, whose
    running statistics mix the examples of a batch); and a BatchNorm anywhere, frozen too, is
    refused here (Opacus does not check frozen layers): in training mode it normalises each
    example by its batch's statistics, so one example changes the others' gradients and the
    per-example clipping bound does not hold. The model is left as it was."""
    from opacus import GradSampleModule

    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameter"
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
        return (f"layer {norms[0] or '(root)'}{more} is a BatchNorm, which normalises each example by its batch's "
                "statistics (one example changes the others' gradients)")
    if not GradSampleModule.validate(model, strict=False):
        return None
    bad = [(n, type(m).__name__) for n, m in model.named_modules()
           if any(p.requires_grad for p in m.parameters(recurse=False)) and any(True for _ in m.buffers(recurse=False))]
    where = f"{bad[0][0] or '(root)'} ({bad[0][1]})" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") if bad else "a layer"
    return f"trainable layer {where} has buffers (statistics that mix a batch's examples), which Opacus cannot make private"


class DPSGD:
    """One client-round of DP-SGD (module doc): :meth:`attach` around the method's optimizer,
    :meth:`privatise` before each optimizer step, :meth:`zero_grad` after it, :meth:`detach` at
    the end (also after an error; idempotent). :meth:`stats` is what the client reports to the
    server's accountant: its noisy steps, σ, q and C."""

    def __init__(self, *, noise_multiplier: float, max_grad_norm: float, sample_rate: float, num_examples: int,
                 noise_seed: int | None, secure_mode: bool = False) -> None:
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.sample_rate = float(sample_rate)
        self.num_examples = int(num_examples)
        #: q·n: the expected examples of a step, the denominator of the privatised mean
        self.expected_batch = self.sample_rate * self.num_examples
        self.secure_mode = bool(secure_mode)
        self.noise_seed = entropy_seed() if secure_mode or noise_seed is None else int(noise_seed)
        self.steps = 0
        self._gsm: Any = None
        self._dp: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hook Opacus' per-sample gradients onto ``model`` and wrap ``optimizer`` in a
        ``DPOptimizer`` (the method's optimizer itself still takes the steps)."""
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.detach()
        # frozen layers before the first trained one: the full backward hook fires on output gradients only (expected)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
        # loss_reduction "mean": each micro-batch's mean loss; Opacus scales by its size to get per-example gradients
        self._gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        gen = torch.Generator(device=device)
        gen.manual_seed(self.noise_seed)
        # loss_reduction "sum": no division by Opacus; privatise() divides by q·n itself (micro-batches may be empty)
        self._dp = DPOptimizer(optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                               expected_batch_size=None, loss_reduction="sum", generator=gen, secure_mode=self.secure_mode)

    @property
    def optimizer(self) -> Any:
        """Opacus' ``DPOptimizer`` around the method's optimizer (None before :meth:`attach`)."""
        return self._dp

    @torch.no_grad()
    def privatise(self) -> None:
        """``p.grad ← (Σ_i clip_C(g_i) + N(0, σ²C²I)) / (q·n)`` for every parameter the optimizer
        steps, ``g_i`` the per-example gradients of this step's micro-batches (none for an empty
        Poisson draw: noise only); ``clip_C(g) = g · min(1, C/‖g‖)``, ``‖g‖`` over all those
        parameters together (Opacus' ``DPOptimizer.pre_step``)."""
        for p in self._dp.params:
            if getattr(p, "grad_sample", None) is None:  # an empty step: no example's gradient
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self._dp.pre_step()
        for p in self._dp.params:
            p.grad.div_(max(self.expected_batch, 1e-12))
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and per-example gradients (``DPOptimizer.zero_grad``)."""
        self._dp.zero_grad(set_to_none)

    def detach(self) -> None:
        """Remove Opacus' hooks and the attributes it added to the parameters."""
        if self._gsm is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._gsm._close()
            self._gsm = None
        self._dp = None

    def stats(self) -> dict[str, float]:
        """What the site reports for accounting: noisy steps taken, σ, q, C (all public)."""
        return {"dp_steps": self.steps, "dp_noise_multiplier": self.noise_multiplier, "dp_sample_rate": self.sample_rate,
                "dp_max_grad_norm": self.max_grad_norm}
