"""Progress events emitted by the round loop. Sinks (rich live display, plain log lines, quiet)
subclass :class:`ProgressSink`; the loop never depends on how they render."""
from __future__ import annotations

import logging
from typing import Any

__all__ = ["ProgressSink", "LogProgress"]

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
