"""SCAFFOLD's control variates (``train.scaffold``; Karimireddy et al. 2020, Algorithm 1 with
option II) as a round stage; the maths is :mod:`fedgalore.federated.scaffold`.

* the server sends each client c − c_i beside the method's message (``scaffold/corr/…``,
  Alg. 1 line 7; counted down, per client on every backend);
* the client takes those entries out of its broadcast, corrects every local step by them
  (``ClientContext.scaffold``, line 10) and uploads c_i⁺ (``scaffold/ci/…``, line 12);
* the server splits c_i⁺ off each upload (the server's, not A's: a missing or non-finite one
  rejects the upload) and, after A, moves c by (1/N) Σ_{i∈S} (c_i⁺ − c_i) over the kept
  clients (line 17; ``ServerState.extras``, checkpointed).
"""
from __future__ import annotations

from typing import Any

from fedgalore.engine.stages.base import Attempt, RoundStage, RunView
from fedgalore.federated.client import ClientError
from fedgalore.federated.scaffold import CORR, NEW_CI, ScaffoldClient, correction, split_entries, update_controls
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.sync.ajive import all_finite

__all__ = ["Scaffold"]


class Scaffold(RoundStage):
    """``train.scaffold`` (module doc)."""

    name = "scaffold"

    def __init__(self, runtime: Any, num_clients: int) -> None:
        self.runtime, self.num_clients = runtime, int(num_clients)
        #: each client's c_i⁺ of the round being collected (retried attempts included)
        self._controls: dict[int, dict[str, Any]] = {}

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "Scaffold | None":
        return cls(runtime, cfg.federation.num_clients) if cfg.train.scaffold else None

    # the client
    def client_receive(self, payload: Payload, ctx: Any) -> Payload:
        payload, corr = split_entries(payload, CORR)  # c − c_i rides along the broadcast
        ctx.scaffold = ScaffoldClient(corr, self.runtime.method.scaffold_params(self.runtime.model))
        return payload

    def client_release(self, upload: Payload, broadcast: Payload, ctx: Any) -> Payload:
        if ctx.scaffold.new_ci is None:
            raise ClientError(f"client {ctx.client}: SCAFFOLD needs at least one local step")
        return Payload({**upload.entries, **ctx.scaffold.upload_entries()}, dict(upload.meta))

    # the server
    def message(self, msg: Payload, client: int, state: Any) -> Payload:
        corr = correction(state.extras, client, state.params)
        return Payload({**msg.entries, **{CORR + k: Dense(v) for k, v in corr.items()}}, dict(msg.meta))

    def receive(self, client: int, upload: Payload, att: Attempt, state: Any) -> tuple[Payload | None, str | None]:
        upload, ci = split_entries(upload, NEW_CI)  # c_i⁺ (counted up with the upload) is the server's, not A's
        self._controls[client] = ci
        if set(ci) != set(state.params) or not all(all_finite(v) for v in ci.values()):
            return None, "rejected: SCAFFOLD control variate missing or non-finite"
        return upload, None

    def after_aggregate(self, state: Any, att: Attempt) -> None:
        controls = {c: self._controls.pop(c) for c in att.kept_clients if c in self._controls}
        self._controls = {}
        update_controls(state.extras, controls, state.params, self.num_clients)
