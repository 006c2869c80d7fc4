"""The round's stages (:mod:`fedgalore.engine.stages.base`): every feature that changes a round,
one module each, composed from the config here and nowhere else.

:data:`REGISTRY` is the order in which the stages act at every hook; a new stage is one module
and one line here. :func:`compose` builds the ones a config turns on; :class:`Stages` calls a
hook on each of them in that order.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from fedgalore.engine.stages.attack import Attack
from fedgalore.engine.stages.base import Attempt, Contribution, RoundStage, RunView, StopRun
from fedgalore.engine.stages.client_dp import ClientDP
from fedgalore.engine.stages.norm_guard import NormGuard
from fedgalore.engine.stages.privacy_ledger import PrivacyAccountant
from fedgalore.engine.stages.record_dp import RecordDP
from fedgalore.engine.stages.robust import Robust
from fedgalore.engine.stages.scaffold import Scaffold
from fedgalore.engine.stages.secure_aggregation import SecureAggregation
from fedgalore.engine.stages.server_optimizer import ServerOptimizer
from fedgalore.engine.stages.site_state import SiteState

__all__ = ["REGISTRY", "Stages", "compose", "backend_problems", "Attempt", "Contribution", "RoundStage", "RunView", "StopRun"]

#: every stage, in the order it acts at each hook (the order is behaviour: a hostile site's upload is
#: scaled before SCAFFOLD's entries are split off; SCAFFOLD's entries are added before DP-SGD's
#: redaction and client-level DP's clipping; robust aggregation screens before central noise)
REGISTRY: tuple[type[RoundStage], ...] = (
    PrivacyAccountant,  # privacy.* accounting: the budget at every release, privacy.json, the journal
    Attack,  # federation.attack: a simulated hostile site's scaled upload
    Scaffold,  # train.scaffold: control variates down and up, c updated after A
    RecordDP,  # privacy.record: DP-SGD on the client
    ClientDP,  # privacy.client: clipping and noise of each client's update
    NormGuard,  # federation.max_update_norm / clip_update_norm
    SecureAggregation,  # federation.secure_aggregation: the server sees only the sum
    Robust,  # federation.robust: drop or outvote hostile uploads before A
    ServerOptimizer,  # federation.server_optimizer: A's change as a pseudo-gradient
    SiteState,  # a method's own state at simulated sites (FedSA-LoRA's B), on disk with the run for a resume
)


class Stages(Sequence[RoundStage]):
    """The stages a run composed, in :data:`REGISTRY` order; each ``hook`` call below runs that
    hook of every stage in turn (threading the payload through where the hook returns one)."""

    def __init__(self, stages: Sequence[RoundStage]) -> None:
        self._stages = list(stages)

    def __getitem__(self, i):  # type: ignore[override]
        return self._stages[i]

    def __len__(self) -> int:
        return len(self._stages)

    def get(self, name: str) -> RoundStage | None:
        """The composed stage called ``name`` (None when the config has it off)."""
        return next((s for s in self._stages if s.name == name), None)

    @property
    def collector(self) -> Any:
        """The collector class of the first stage that brings one (None: the plain collector)."""
        return next((s.collector for s in self._stages if s.collector is not None), None)

    @property
    def hides_clients(self) -> bool:
        return any(s.hides_clients for s in self._stages)

    @property
    def needs_deltas(self) -> bool:
        return any(s.needs_deltas for s in self._stages)

    # the client
    def client_batches(self, runtime: Any, client: int, round_idx: int) -> tuple[Callable, int] | None:
        for s in self._stages:
            out = s.client_batches(runtime, client, round_idx)
            if out is not None:
                return out
        return None

    def client_start(self, ctx: Any) -> None:
        for s in self._stages:
            s.client_start(ctx)

    def client_receive(self, payload: Any, ctx: Any) -> Any:
        for s in self._stages:
            payload = s.client_receive(payload, ctx)
        return payload

    def client_release(self, upload: Any, broadcast: Any, ctx: Any) -> Any:
        for s in self._stages:
            upload = s.client_release(upload, broadcast, ctx)
        return upload

    def client_close(self, ctx: Any) -> None:
        for s in self._stages:
            s.client_close(ctx)

    # the server
    def start(self, state: Any, resumed: bool, start_round: int, rounds: int) -> None:
        for s in self._stages:
            s.start(state, resumed, start_round, rounds)

    def plan(self, att: Attempt, state: Any) -> None:
        for s in self._stages:
            s.plan(att, state)

    def broadcast(self, bcast: Any, state: Any) -> Any:
        for s in self._stages:
            bcast = s.broadcast(bcast, state)
        return bcast

    def message(self, msg: Any, client: int, state: Any) -> Any:
        for s in self._stages:
            msg = s.message(msg, client, state)
        return msg

    def observe(self, att: Attempt, results: list[Any], state: Any) -> None:
        for s in self._stages:
            s.observe(att, results, state)

    def receive(self, client: int, upload: Any, att: Attempt, state: Any) -> tuple[Any, str | None]:
        for s in self._stages:
            upload, error = s.receive(client, upload, att, state)
            if error is not None:
                return None, error
        return upload, None

    def check(self, item: Contribution, rec: dict[str, Any]) -> str | None:
        for s in self._stages:
            why = s.check(item, rec)
            if why is not None:
                return why
        return None

    def screen(self, att: Attempt, state: Any) -> None:
        for s in self._stages:
            s.screen(att, state)

    def release(self, att: Attempt, state: Any) -> None:
        for s in self._stages:
            s.release(att, state)

    def aggregate(self, state: Any, apply: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        for s in reversed(self._stages):  # the first stage's wrapper is the outermost
            apply = (lambda s=s, inner=apply: s.aggregate(state, inner))
        return apply()

    def after_aggregate(self, state: Any, att: Attempt) -> None:
        for s in self._stages:
            s.after_aggregate(state, att)

    def round_record(self, state: Any, round_idx: int, uploads: list[Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self._stages:
            out.update(s.round_record(state, round_idx, uploads))
        return out

    def next_round_stop(self, state: Any, round_idx: int) -> str | None:
        for s in self._stages:
            why = s.next_round_stop(state, round_idx)
            if why is not None:
                return why
        return None

    def stopped(self, state: Any) -> None:
        for s in self._stages:
            s.stopped(state)


def backend_problems(cfg: Any, backend: Any) -> None:
    """Raise the first stage's one-line refusal of ``backend`` (before the runtime is built)."""
    from fedgalore.job.config import ConfigError

    for cls in REGISTRY:
        why = cls.backend_problem(cfg, backend)
        if why is not None:
            raise ConfigError(why)


def compose(cfg: Any, runtime: Any, run: RunView | None = None, have: Sequence[RoundStage] = ()) -> Stages:
    """The stages ``cfg`` turns on, in :data:`REGISTRY` order. ``run``: the server's view (None in a
    process that only trains clients: server-only stages are left out); ``have``: stages already
    built for this runtime (its client side), reused instead of built twice."""
    built = {s.name: s for s in have}
    out = []
    for cls in REGISTRY:
        if cls.name in built:
            out.append(built[cls.name])
            continue
        if cls.server_only and run is None:
            continue
        stage = cls.build(cfg, runtime, run)
        if stage is not None:
            out.append(stage)
    return Stages(out)
