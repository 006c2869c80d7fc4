"""Simulated hostile sites (``federation.attack``) as a round stage; fedgalore.federated.guards.AttackConfig): the
upload of each listed client is replaced, as the server receives it, by one whose update is
``m = ±factor`` times the client's own — what a registered site that scales or sign-flips its
update sends. It exists to measure ``federation.robust`` (docs/robust.md); a deployment refuses it.

* Methods whose update is linear in the upload (FedAvg-Full's dense deltas, FedGaLore's update
  records): :meth:`~fedgalore.methods.base.Method.scale_upload`, so ΔW_i' = m·ΔW_i exactly.
* The LoRA family (absolute factors): each uploaded tensor's change from what the client started
  from (the method's public reference, :meth:`~fedgalore.methods.base.Method.release_reference`)
  is multiplied by m: ``B' = B_0 + m(B_i − B_0)``, ``A' = A_0 + m(A_i − A_0)``. The product's
  change then grows like m² where both factors moved; it is a scaled *upload*, which is what a
  hostile site controls.
"""
from __future__ import annotations

from typing import Any

from fedgalore.engine.stages.base import Attempt, RoundStage, RunView
from fedgalore.federated.guards import AttackConfig
from fedgalore.methods.base import Method, MethodError
from fedgalore.privacy.client_dp import add_noise, clip_upload, is_moment
from fedgalore.protocol.payload import Payload

__all__ = ["hostile_upload", "Attack"]


def hostile_upload(cfg: AttackConfig, method: Method, upload: Payload, broadcast: Payload | None) -> Payload:
    """The upload a hostile client sends instead of ``upload`` (module docstring)."""
    m = cfg.multiplier
    try:
        return method.scale_upload(upload, m)
    except MethodError:
        pass
    refs, changes, _ = clip_upload(upload, lambda key: method.release_reference(broadcast, key, upload), None, None)
    scaled = {s: (c if is_moment(s[0]) else c * m) for s, c in changes.items()}
    return add_noise(upload, refs, scaled, lambda slot, shape: None)


class Attack(RoundStage):
    """``federation.attack``: the listed clients' uploads replaced, as the server receives them, by
    :func:`hostile_upload`'s (module doc)."""

    name = "attack"
    server_only = True

    def __init__(self, cfg: AttackConfig, method: Method) -> None:
        self.cfg, self.method = cfg, method

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "Attack | None":
        attack = cfg.federation.attack
        return None if attack is None else cls(attack, run.method)

    def receive(self, client: int, upload: Payload, att: Attempt, state: Any) -> tuple[Payload | None, str | None]:
        if client in self.cfg.clients:
            upload = hostile_upload(self.cfg, self.method, upload, att.reference)
        return upload, None
