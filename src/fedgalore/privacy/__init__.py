"""Differential privacy of what a site releases (docs/privacy.md; docs/design.md §9).

* :mod:`~fedgalore.privacy.config` — ``privacy.record`` (record-level DP-SGD at each site) and
  ``privacy.client``, typed and checked (numbers are numbers, σ and σ·C at most 10⁶);
* :mod:`~fedgalore.privacy.dpsgd` — DP-SGD through Opacus around each method's own optimizer
  (``GradSampleModule`` per-example gradients, ``DPOptimizer`` clipping and noise, Poisson
  sampling), used by :func:`fedgalore.federated.client.local_train`;
* :mod:`~fedgalore.privacy.accounting` — ε(δ) per site with Opacus' RDP / PRV accountants,
  cross-checked against Google's ``dp-accounting``; σ calibrated to a target ε;
* :mod:`~fedgalore.privacy.client_dp` — client-level DP across sites (DP-FedAvg): clipping and
  noising an upload's change, central or distributed noise, the federation's accountant
  (dp-accounting RDP, sampling without replacement) and its calibration;
* :mod:`~fedgalore.privacy.signal` — client-level DP's noise in the released mean against the
  signal it hides (σ·C·√d/K against C), said by ``fedgalore plan`` and at a run's start;
* :mod:`~fedgalore.privacy.statement` — what a run protected, in words (``privacy.json``, the
  report and the model card).

Opacus and dp-accounting are the optional extra ``privacy`` (``pip install 'fedgalore[privacy]'``);
only a run with ``privacy.record`` or ``privacy.client`` imports them.
"""
from fedgalore.privacy.config import ClientPrivacy, PrivacyConfig, RecordPrivacy

__all__ = ["ClientPrivacy", "PrivacyConfig", "RecordPrivacy"]
