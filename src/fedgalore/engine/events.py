"""Progress events emitted by the round loop. Sinks (rich live display, plain log lines, quiet)
subclass :class:`ProgressSink`; the loop never depends on how they render."""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["ProgressSink", "LogProgress", "TrackingProgress", "phase_note", "PHASE_SHARE"]

log = logging.getLogger("fedgalore")


class ProgressSink:
    """No-op base. ``round`` arguments are 0-based round indices."""

    def start(self, total_rounds: int, info: dict[str, Any]) -> None: ...
    def round_start(self, round: int, clients: list[int]) -> None: ...
    def client_start(self, round: int, client: int, steps: int) -> None: ...
    def client_step(self, round: int, client: int, step: int, steps: int, loss: float) -> None: ...
    def client_end(self, round: int, client: int, record: dict[str, Any]) -> None: ...
    def round_end(self, round: int, record: dict[str, Any]) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class LogProgress(ProgressSink):
    """One log line per round through the ``fedgalore`` logger (non-TTY / CI)."""

    def start(self, total_rounds: int, info: dict[str, Any]) -> None:
        log.info("run %s: %d rounds", info.get("run_name", ""), total_rounds)

    def round_end(self, round: int, record: dict[str, Any]) -> None:
        evals = " ".join(f"{k[5:]}={v:.4f}" for k, v in record.items() if k.startswith("eval/"))
        log.info("round %d loss=%.4f %s up=%dB", round + 1, record.get("train_loss", float("nan")), evals, record.get("bytes_up", 0))

    def message(self, text: str) -> None:
        log.warning(text)


class TrackingProgress(ProgressSink):
    """Forwards every event to ``inner`` and remembers where the run is inside a round — round
    k/R, client i/K, step s/S — for the heartbeat that keeps ``summary.json`` current, so
    ``fedgalore status`` can say it (:meth:`position`)."""

    def __init__(self, inner: ProgressSink) -> None:
        self.inner = inner
        self._total = 0
        self._pos: dict[str, Any] = {}

    def position(self) -> dict[str, Any]:
        """``{"progress": {...}}`` while a round runs (empty between rounds)."""
        return {"progress": dict(self._pos)} if self._pos else {}

    def start(self, total_rounds: int, info: dict[str, Any]) -> None:
        self._total = int(total_rounds)
        self.inner.start(total_rounds, info)

    def round_start(self, round: int, clients: list[int]) -> None:
        self._pos = {"round": round + 1, "rounds": self._total, "clients": len(clients), "client_index": 0}
        self.inner.round_start(round, clients)

    def client_start(self, round: int, client: int, steps: int) -> None:
        if self._pos:
            self._pos.update({"client_index": self._pos.get("client_index", 0) + 1, "client": client, "step": 0,
                              "steps": int(steps)})
        self.inner.client_start(round, client, steps)

    def client_step(self, round: int, client: int, step: int, steps: int, loss: float) -> None:
        if self._pos:
            self._pos.update({"step": int(step), "steps": int(steps)})
        self.inner.client_step(round, client, step, steps, loss)

    def client_end(self, round: int, client: int, record: dict[str, Any]) -> None:
        self.inner.client_end(round, client, record)

    def round_end(self, round: int, record: dict[str, Any]) -> None:
        self._pos = {}
        self.inner.round_end(round, record)

    def message(self, text: str) -> None:
        self.inner.message(text)

    def finish(self, summary: dict[str, Any]) -> None:
        self.inner.finish(summary)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # a sink's own extras (e.g. a test's recorder)
        return getattr(self.inner, name)


#: the share of a round's time above which the phases are named after the first round
PHASE_SHARE = 0.3


def phase_note(record: dict[str, Any]) -> str | None:
    """After a process's first round: one line naming the per-phase times when diagnostics or
    evaluation took more than :data:`PHASE_SHARE` of the round, with the option that trims each."""
    total = float(record.get("time_round") or 0.0)
    if total <= 0:
        return None
    diag, ev = float(record.get("time_diagnostics") or 0.0), float(record.get("time_eval") or 0.0)
    if diag + ev <= PHASE_SHARE * total:
        return None
    parts = [f"{name} {record.get(key, 0.0):.1f} s" for name, key in
             (("clients", "time_clients"), ("server", "time_server"), ("diagnostics", "time_diagnostics"),
              ("evaluation", "time_eval"))]
    advice = []
    if diag > 0.1 * total:
        advice.append("diagnostics=false skips the diagnostics")
    if ev > 0.1 * total:
        advice.append("federation.eval_every=N evaluates every N rounds")
    return (f"round {record.get('round')}: {total:.1f} s, of which " + ", ".join(parts)
            + f" — diagnostics and evaluation took {100 * (diag + ev) / total:.0f} %; " + "; ".join(advice))
