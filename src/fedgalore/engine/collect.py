"""Collect: from the clients' results to the valid uploads A applies (paper Algorithm 1, between
T and A).

:class:`Collector` runs one attempt's client jobs on the backend and turns what came back into
:class:`~fedgalore.engine.stages.base.Contribution` objects on the attempt: each upload is decoded
and counted in the ledger, handed to the stages (:meth:`~fedgalore.engine.stages.base.RoundStage.
receive`: a simulated attack, SCAFFOLD's entries), dropped when late (``federation.
client_timeout_s``: the sequential backend cannot preempt a client), validated (finite, shapes,
keys, the method's own checks: :mod:`fedgalore.engine.validation`), given its dense ΔW_i when a
stage or the drift diagnostics need it (built once, against the state the round started from) and
checked by the stages (:meth:`~fedgalore.engine.stages.base.RoundStage.check`: the norm guard).
Every client gets one ``clients.jsonl`` record; under client-level DP
(:attr:`~fedgalore.engine.stages.base.RoundStage.hides_clients`) it holds no time or size and a
client's own error without its text (:meth:`fedgalore.privacy.view.ServerView.error`).

A stage that changes how uploads arrive brings its own collector (secure aggregation's sum:
:class:`fedgalore.engine.stages.secure_aggregation.SummedCollector`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from fedgalore.engine.jobs import ClientJob, ClientResult
from fedgalore.engine.stages.base import Attempt, Contribution
from fedgalore.engine.validation import expected_keys, validate_upload
from fedgalore.protocol.payload import Ledger, Payload, PayloadError, decode
from fedgalore.protocol.state import RoundContext

__all__ = ["Collector"]


class Collector:
    """One attempt's client jobs run on the backend, and their valid uploads (module doc)."""

    def __init__(self, cfg: Any, method: Any, runtime: Any, backend: Any, ledger: Ledger, stages: Any,
                 say: Callable[[str], None]) -> None:
        self.cfg, self.method, self.runtime, self.backend = cfg, method, runtime, backend
        self.ledger, self.stages, self.say = ledger, stages, say

    # ------------------------------------------------------------------ running the jobs
    def run(self, blob: Any, jobs: Sequence[ClientJob], att: Attempt, progress: Any) -> tuple[list[ClientResult], Payload | None]:
        """The attempt's jobs on the backend: every client's result (and no sum)."""
        return (self.backend.run_clients(blob, jobs, progress) if jobs else []), None

    # ------------------------------------------------------------------ the records
    def record(self, att: Attempt, res: ClientResult) -> dict[str, Any]:
        """A client's ``clients.jsonl`` record of this attempt (no time or size when the stages hide clients)."""
        rec = {"round": att.round + 1, "attempt": att.number, "client": res.client}
        view = self.runtime.view  # what the server may record about a site (fedgalore.privacy.view)
        if view.client_time:
            rec["time"] = res.time
        if view.site_size:
            rec["num_examples"] = len(self.runtime.parts[res.client])
        if self.runtime.clients.names is not None:  # a natural partition's clients are named by the data
            rec["client_name"] = self.runtime.clients.name(res.client)
        return rec

    def dropped(self, att: Attempt, rec: dict[str, Any], res: ClientResult) -> None:
        """Record (and say) why a client's upload does not count."""
        rec["error"] = self.runtime.view.error(res.error, res.origin)  # fedgalore.privacy.view: origin, not text
        self.say(f"round {att.round + 1}: client {self.runtime.clients.name(res.client)} dropped ({rec['error']})")

    # ------------------------------------------------------------------ the uploads
    def collect(self, att: Attempt, results: list[ClientResult], summed: Payload | None, state: Any, rctx: RoundContext,
                upload_keys: list[str] | None) -> None:
        """Decode, hand to the stages, validate and check the uploads of one attempt; the valid ones
        become ``att.kept`` (with their ΔW_i when needed), every client a record in ``att.records``."""
        k, fed = att.round, self.cfg.federation
        need_deltas = self.stages.needs_deltas or (bool(self.cfg.diagnostics) and not self.stages.hides_clients)
        # only the drift diagnostics read them: in factors where the method has them (diagnostics_exact: false)
        factored = not self.stages.needs_deltas and not self.cfg.diagnostics_exact
        weight = dict(zip(att.clients, att.weights))
        decoded = []
        for res in results:
            up = None
            if isinstance(res.upload, Payload):  # handed over in process (a private copy); counted as encoded
                up = res.upload
                self.ledger.record(k + 1, res.client, "up", up)
            elif res.upload is not None:
                try:
                    up = decode(res.upload)
                except PayloadError as exc:
                    res.error, res.origin = f"undecodable upload: {exc}", "server"
                self.ledger.record(k + 1, res.client, "up", up if up is not None else Payload(), res.upload)
            if up is not None:
                up, error = self.stages.receive(res.client, up, att, state)
                if error is not None:
                    res.error, res.origin = error, "server"
            decoded.append(up)
        keys = expected_keys(upload_keys, [u for u in decoded if u is not None])
        for res, up in zip(results, decoded):
            rec = self.record(att, res)
            if up is not None and fed.client_timeout_s is not None and res.time > fed.client_timeout_s:
                # the sequential backend cannot preempt a client; a late upload is discarded
                took = f"{res.time:.1f}s > " if self.runtime.view.client_time else "past "
                res.error, res.origin = f"timed out: {took}federation.client_timeout_s={fed.client_timeout_s:g}", "server"
                up = None
            if up is not None:
                reason = validate_upload(self.method, state, up, rctx, keys)
                item = Contribution(up, [res.client], weight[res.client])
                if reason is None and need_deltas:
                    item.delta = self.method.client_delta_factors(state, up) if factored else None
                    if item.delta is None:
                        item.delta = self.method.client_deltas(state, up)  # once per client, before A
                if reason is None:
                    reason = self.stages.check(item, rec)
                if reason is None:
                    att.kept.append(item)
                    # the upload's numeric stats; its own "round"/"client" (0-based job fields) never replace the record's
                    rec.update({kk: v for kk, v in item.upload.meta.items() if isinstance(v, (int, float)) and kk not in rec
                                and self.runtime.view.allows_meta(kk)})
                else:
                    res.error, res.origin = f"rejected: {reason}", "server"
                    for r in reversed(self.ledger.records):
                        if r["round"] == k + 1 and r["client"] == res.client and r["direction"] == "up":
                            r["rejected"] = reason
                            break
            if res.error is not None:
                self.dropped(att, rec, res)
            att.records.append(rec)
