"""The round stage: one feature of a round behind one small interface (paper §3, Algorithm 1).

The round loop (:mod:`fedgalore.engine.loop`) runs the paper's round — sample, broadcast, T on
the clients, collect, A, S — and nothing else. Every feature that changes a round (client- and
record-level DP, secure aggregation, robust aggregation, the simulated attack, SCAFFOLD's
controls, the server optimizer, the update-norm guard, the privacy accountant) is a
:class:`RoundStage`: a subclass overrides only the hooks where it acts, and the stages are
composed from the config in one place (:func:`fedgalore.engine.stages.compose`), in the order
of :data:`fedgalore.engine.stages.REGISTRY` — the way Flower wraps a strategy and adds a client
mod. A new stage is one module and one registry line.

The hooks, in the order a round calls them:

* on the client (:meth:`fedgalore.engine.runtime.Runtime.execute`, before the upload leaves):
  :meth:`client_batches` (the round's mini-batches), :meth:`client_start`,
  :meth:`client_receive` (the broadcast as the method sees it), :meth:`client_release` (the
  upload as it leaves the site), :meth:`client_close` (always, also after an error);
* on the server, per attempt: :meth:`plan` (weights, who is held back; may stop the run),
  :meth:`broadcast` and :meth:`message` (what is sent), :meth:`observe` (every result that came
  back), :meth:`receive` (each decoded upload), :meth:`check` (each valid upload with its ΔW_i),
  :meth:`screen` (the attempt's valid uploads, before the minimum is counted) and
  :meth:`release` (the kept uploads, once enough of them arrived);
* between collect and S: :meth:`aggregate` (wraps the method's A) and :meth:`after_aggregate`;
* what it records: :meth:`round_record` (joins the round's metrics), :meth:`next_round_stop`,
  :meth:`stopped` (the run ends early).

A round's valid uploads travel between the hooks as one typed :class:`Attempt` holding
:class:`Contribution` objects — never parallel lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from fedgalore.protocol.payload import Payload

if TYPE_CHECKING:  # annotations only (no import at run time)
    from fedgalore.protocol.state import ClientContext, ServerState

__all__ = ["RoundStage", "Attempt", "Contribution", "RunView", "StopRun"]


class StopRun(Exception):
    """A stage ends the run cleanly inside a round (e.g. the privacy budget): the loop
    checkpoints the last complete round and records the message as ``summary.stopped``."""


@dataclass
class Contribution:
    """One upload the method's A will apply: a client's own (``clients == [i]``), or one that
    stands for several (a secure sum, a coordinate-wise statistic: all of them counted in it).
    ``weight``: its aggregation weight before renormalisation over the kept uploads; ``delta``:
    its dense ΔW_i against the round's start ({} when no stage and no diagnostic needs it)."""

    upload: Payload
    clients: list[int]
    weight: float
    delta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Attempt:
    """One attempt of a round (a retry is a new attempt with a new sample).

    ``round``: 0-based k; ``number``: the attempt; ``clients`` / ``sizes`` / ``weights``: the
    sample, its sizes and weights (stages may replace the weights); ``held_back``: sampled clients
    that do not train, with the reason (a stage's :meth:`RoundStage.plan`); ``reference``: the
    broadcast the clients started from (client-level DP's public reference); ``kept``: the valid
    uploads; ``records``: the round's ``clients.jsonl`` records so far (earlier attempts too);
    ``diag``: numbers a stage adds to the round's diagnostics."""

    round: int
    number: int
    clients: list[int]
    sizes: list[int]
    weights: list[float]
    held_back: dict[int, str] = field(default_factory=dict)
    reference: Payload | None = None
    kept: list[Contribution] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    diag: dict[str, float] = field(default_factory=dict)

    @property
    def kept_clients(self) -> list[int]:
        """The clients counted in the kept uploads, in order."""
        return [c for k in self.kept for c in k.clients]

    def record_of(self, client: int) -> dict[str, Any] | None:
        """This attempt's ``clients.jsonl`` record of ``client``."""
        for rec in reversed(self.records):
            if rec["round"] == self.round + 1 and rec["attempt"] == self.number and rec["client"] == client:
                return rec
        return None


@dataclass
class RunView:
    """What a server-side stage may read of the run: its directory, the method, the runtime (which
    names the clients) and how to say a line."""

    run_dir: Any
    method: Any
    runtime: Any
    say: Callable[[str], None]


class RoundStage:
    """One feature of a round (module doc). Every hook's default does nothing; a stage overrides
    the ones where it acts. ``build`` returns None when the config does not turn the stage on."""

    #: the stage's name in :data:`~fedgalore.engine.stages.REGISTRY`
    name: ClassVar[str] = ""
    #: built only where a server runs the round (the run directory known), never in a client process
    server_only: ClassVar[bool] = False
    #: the server records nothing raw about a client (client-level DP): no per-client time or size,
    #: a client's own error without its text, no client-to-client drift of raw uploads
    hides_clients: ClassVar[bool] = False
    #: :meth:`check` needs each upload's dense ΔW_i
    needs_deltas: ClassVar[bool] = False
    #: how this stage's uploads arrive, when not one per client (a
    #: :class:`~fedgalore.engine.collect.Collector` subclass; None: the plain collector)
    collector: ClassVar[Any] = None

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "RoundStage | None":
        """The stage of this run, or None when its config is off (raise ConfigError for a setting
        under which it cannot run). ``run``: the server's view (None in a client process)."""
        raise NotImplementedError

    @classmethod
    def backend_problem(cls, cfg: Any, backend: Any) -> str | None:
        """Why this stage cannot run on ``backend`` (one line), before anything is built."""
        return None

    # ------------------------------------------------------------------ the client
    def client_batches(self, runtime: Any, client: int, round_idx: int) -> tuple[Callable, int] | None:
        """The client-round's mini-batches, when this stage draws them (else None)."""
        return None

    def client_start(self, ctx: "ClientContext") -> None:
        """Before the client's training starts (outside its seeded RNG)."""

    def client_receive(self, payload: Payload, ctx: "ClientContext") -> Payload:
        """The broadcast as the method's T gets it (a stage takes its own entries out)."""
        return payload

    def client_release(self, upload: Payload, broadcast: Payload, ctx: "ClientContext") -> Payload:
        """The upload as it leaves the site."""
        return upload

    def client_close(self, ctx: "ClientContext") -> None:
        """After the client's job, also after an error."""

    # ------------------------------------------------------------------ the server, per attempt
    def start(self, state: "ServerState", resumed: bool, start_round: int, rounds: int) -> None:
        """Once, before the first round this process runs (``resumed``: from a checkpoint)."""

    def plan(self, att: Attempt, state: "ServerState") -> None:
        """Before the attempt's broadcast: may change ``att.weights``, add ``att.held_back`` or
        raise :class:`StopRun`."""

    def broadcast(self, bcast: Payload, state: "ServerState") -> Payload:
        """The round's common broadcast."""
        return bcast

    def message(self, msg: Payload, client: int, state: "ServerState") -> Payload:
        """What ``client`` is sent (its own entries added to the common message)."""
        return msg

    def observe(self, att: Attempt, results: list[Any], state: "ServerState") -> None:
        """Every client result of the attempt, before validation (the server saw them)."""

    def receive(self, client: int, upload: Payload, att: Attempt, state: "ServerState") -> tuple[Payload | None, str | None]:
        """One decoded upload as the server receives it: ``(upload, None)`` or ``(None, error)``."""
        return upload, None

    def check(self, item: Contribution, rec: dict[str, Any]) -> str | None:
        """One valid upload (with its ΔW_i when :attr:`needs_deltas`): None to keep it — possibly
        changed in place — or why it is rejected."""
        return None

    def screen(self, att: Attempt, state: "ServerState") -> None:
        """The attempt's valid uploads (``att.kept``), before the round counts them."""

    def release(self, att: Attempt, state: "ServerState") -> None:
        """The kept uploads once enough arrived, as A will apply them."""

    # ------------------------------------------------------------------ between collect and S
    def aggregate(self, state: "ServerState", apply: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run the method's A (``apply``) — a stage may wrap it; returns what was applied."""
        return apply()

    def after_aggregate(self, state: "ServerState", att: Attempt) -> None:
        """After A (and before S)."""

    # ------------------------------------------------------------------ what it records
    def round_record(self, state: "ServerState", round_idx: int, uploads: list[Payload]) -> dict[str, float]:
        """Numbers that join the round's record (metrics.csv)."""
        return {}

    def next_round_stop(self, state: "ServerState", round_idx: int) -> str | None:
        """Why round ``round_idx`` must not run (the run stops cleanly), or None."""
        return None

    def stopped(self, state: "ServerState") -> None:
        """The run stops inside a round (:class:`StopRun`)."""
