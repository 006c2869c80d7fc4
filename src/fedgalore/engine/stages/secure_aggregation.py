"""Secure aggregation (``federation.secure_aggregation``) as a round stage: the server receives
only the weighted sum of the uploads, never one of them (Flower's SecAgg+, Bell et al. 2020;
run between SuperNodes by :mod:`fedgalore.flower`).

The stage brings its own collector (:class:`SummedCollector`): the backend runs the clients
through SecAgg+ (``run_clients_summed``, integer weights: each site's size, or 1 under
client-level DP whose weights are uniform), the clients get their records (no individual upload
exists on the server) and the one summed upload — validated as any upload (finite, shapes, keys,
the method's checks; a rejected sum drops the whole attempt) — is the one contribution A applies,
with weight 1, every contributing client counted in it. The ledger counts, per client, what the
server received from its node in every SecAgg+ stage.
"""
from __future__ import annotations

from typing import Any, Sequence

from fedgalore.engine.collect import Collector
from fedgalore.engine.jobs import ClientJob, ClientResult
from fedgalore.engine.stages.base import Attempt, Contribution, RoundStage, RunView
from fedgalore.engine.validation import expected_keys, validate_upload
from fedgalore.protocol.payload import Payload
from fedgalore.protocol.state import RoundContext

__all__ = ["SecureAggregation", "SummedCollector"]


class SummedCollector(Collector):
    """Secure aggregation's collect (module doc)."""

    def run(self, blob: Any, jobs: Sequence[ClientJob], att: Attempt, progress: Any) -> tuple[list[ClientResult], Payload | None]:
        ints = [1 if self.stages.hides_clients else s for c, s in zip(att.clients, att.sizes) if c not in att.held_back]
        return self.backend.run_clients_summed(blob, jobs, ints, progress) if jobs else ([], None)

    def collect(self, att: Attempt, results: list[ClientResult], summed: Payload | None, state: Any, rctx: RoundContext,
                upload_keys: list[str] | None) -> None:
        received = getattr(self.backend, "secure_received", {})
        node_of = getattr(self.backend, "node_of", {})
        kept = [r.client for r in results if r.error is None and (r.stats or {}).get("secagg_summed")]
        reason = None
        if summed is not None and kept:
            reason = validate_upload(self.method, state, summed, rctx, expected_keys(upload_keys, [summed]))
        for res in results:
            rec = self.record(att, res)
            rec["secure_aggregation"] = True
            got = received.get(node_of.get(res.client))
            if got:
                self.ledger.record(att.round + 1, res.client, "up", Payload(), int(got))
            if res.error is None and reason is not None:
                res.error = f"rejected: the secure sum: {reason}"
            if res.error is None:
                rec.update({kk: v for kk, v in (res.stats or {}).items() if isinstance(v, (int, float)) and kk not in rec})
            else:
                self.dropped(att, rec, res)
            att.records.append(rec)
        if summed is not None and reason is None and kept:
            att.kept.append(Contribution(summed, kept, 1.0))


class SecureAggregation(RoundStage):
    """``federation.secure_aggregation`` (module doc); runs only on a backend that has SecAgg+."""

    name = "secure_aggregation"
    server_only = True
    collector = SummedCollector

    @classmethod
    def backend_problem(cls, cfg: Any, backend: Any) -> str | None:
        if cfg.federation.secure_aggregation is not None and not backend.secure_aggregation:
            return (f"federation.secure_aggregation runs Flower's SecAgg+ between SuperNodes, and the "
                    f"{backend.name} backend has none; run the job as a Flower app (examples/flower/README.md, "
                    "\"Secure aggregation (SecAgg+)\") or set federation.secure_aggregation=null")
        return None

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "SecureAggregation | None":
        return cls() if cfg.federation.secure_aggregation is not None else None
