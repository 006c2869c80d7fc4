"""Progress displays for the round loop: ``make_progress("auto" | "rich" | "plain" | "quiet")``.

* ``rich``  — a live display: round r/R with elapsed time and ETA, the sampled clients, the
  current client's local step s/S and loss, the last train loss / eval metrics and the bytes
  sent so far;
* ``plain`` — one line per round (for CI logs and other non-terminals);
* ``quiet`` — nothing (warnings such as dropped clients still go to the ``fedgalore`` logger);
* ``auto``  — ``rich`` when stdout is a terminal, else ``plain``.

All sinks subclass :class:`fedgalore.engine.events.ProgressSink` (``round`` arguments are
0-based; the display shows 1-based rounds). One sink can serve several consecutive runs (a
comparison grid): ``start`` / ``close`` bracket each run.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, TextIO

from fedgalore.engine.events import ProgressSink

__all__ = ["make_progress", "PlainProgress", "RichProgress", "QuietProgress", "PROGRESS_MODES"]

PROGRESS_MODES = ("auto", "rich", "plain", "quiet")
log = logging.getLogger("fedgalore")


def _evals(record: dict[str, Any], limit: int = 3) -> str:
    items = [(k[5:], v) for k, v in record.items() if k.startswith("eval/") and isinstance(v, (int, float))]
    items.sort(key=lambda kv: kv[0] == "loss")  # task metrics first, eval loss last
    return " ".join(f"{k}={v:.4f}" for k, v in items[:limit])


def _train_loss(record: dict[str, Any]) -> str:
    """``train loss X``; under privacy.record / privacy.client (losses withheld by the sites) the ε
    spent so far instead (per site, record-level; the federation's, client-level)."""
    loss = record.get("train_loss", float("nan"))
    parts = []
    if isinstance(record.get("dp_epsilon"), (int, float)):
        parts.append(f"DP ε ≤ {record['dp_epsilon']:.3g}")
    if isinstance(record.get("dp_client_epsilon"), (int, float)):
        parts.append(f"client-level DP ε = {record['dp_client_epsilon']:.3g}")
    eps = " | ".join(parts)
    if eps and not (isinstance(loss, (int, float)) and math.isfinite(loss)):
        return f"{eps} (train losses withheld)"
    return f"train loss {loss:.4f}" + (f" | {eps}" if eps else "")


def _hms(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _clients(clients: list[int], limit: int = 8, names: list[str] | None = None) -> str:
    """The sampled clients: their names when the data names them (a natural partition's sites), else
    their numbers; at most ``limit``, then the count."""
    def label(c: int) -> str:
        return str(names[c]) if names is not None and 0 <= int(c) < len(names) else str(c)

    sep = ", " if names is not None else ","
    text = sep.join(label(c) for c in clients[:limit])
    return text + (f"{sep}… ({len(clients)})" if len(clients) > limit else "")


class QuietProgress(ProgressSink):
    """Shows nothing; engine messages (e.g. a dropped client) go to the ``fedgalore`` logger."""

    def message(self, text: str) -> None:
        log.warning(text)


#: PlainProgress: seconds between in-round lines (a round shorter than this prints none)
PLAIN_INTERVAL_S = 30.0


class PlainProgress(ProgressSink):
    """One line per round on ``stream`` (default: stdout), flushed immediately; inside a long
    round, at most one line every :data:`PLAIN_INTERVAL_S` saying which client (i/K) and step
    (s/S) it is at."""

    def __init__(self, stream: TextIO | None = None, interval: float = PLAIN_INTERVAL_S) -> None:
        self.stream = stream
        self.interval = float(interval)
        self._round_clients: list[int] = []
        self._round = 0
        self._client = (0, 0)  # (client, its steps)
        self._last_line = 0.0
        self.total = 0
        self.names: list[str] | None = None
        self.started_at = 0.0
        self.first_round = 0
        self.run_name = ""

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stdout
        print(text, file=stream, flush=True)

    def start(self, total_rounds: int, info: dict[str, Any]) -> None:
        self.total, self.started_at = total_rounds, time.perf_counter()
        self.first_round = int(info.get("start_round", 0) or 0)
        self.run_name = str(info.get("run_name") or "")
        self.names = info.get("client_names")  # a natural partition's site names (None: numbered clients)
        what = " ".join(f"{k}={info[k]}" for k in ("method", "task") if info.get(k))
        resumed = f" (resuming after round {self.first_round})" if self.first_round else ""
        where = f" -> {info['run_dir']}" if info.get("run_dir") else ""
        self._print(f"run {info.get('run_name', '')}: {what} rounds={total_rounds}{resumed}{where}")

    def round_start(self, round: int, clients: list[int]) -> None:
        self._round, self._round_clients, self._last_line = round, list(clients), time.perf_counter()

    def client_start(self, round: int, client: int, steps: int) -> None:
        self._client = (client, int(steps))
        self._maybe_line(0)

    def client_step(self, round: int, client: int, step: int, steps: int, loss: float) -> None:
        self._client = (client, int(steps))
        self._maybe_line(step + 1)

    def _maybe_line(self, step: int) -> None:
        now = time.perf_counter()
        if now - self._last_line < self.interval:
            return
        self._last_line = now
        client, steps = self._client
        i = self._round_clients.index(client) + 1 if client in self._round_clients else 0
        who = f"{'site' if self.names else 'client'} {_clients([client], names=self.names)} ({i}/{len(self._round_clients)})"
        self._print(f"  round {self._round + 1}/{self.total}: {who}" + (f", step {step}/{steps}" if steps else ""))

    def round_end(self, round: int, record: dict[str, Any]) -> None:
        done = round + 1 - self.first_round
        elapsed = time.perf_counter() - self.started_at
        eta = elapsed / max(done, 1) * (self.total - round - 1)
        parts = [
            f"round {round + 1}/{self.total}",
            f"{'sites' if self.names else 'clients'} {_clients(list(record.get('clients', [])), names=self.names)}",
            _train_loss(record),
        ]
        ev = _evals(record)
        if ev:
            parts.append(f"eval {ev}")
        from fedgalore.report.tables import format_bytes  # here: `fedgalore --help` reads PROGRESS_MODES without torch

        k = len(record.get("clients", []))  # the round's bytes, summed over its clients (the report's are per client)
        parts.append(f"up {format_bytes(record.get('bytes_up'))} down {format_bytes(record.get('bytes_down'))} "
                     f"(round, {k} client{'s' if k != 1 else ''})")
        parts.append(f"{record.get('time_round', 0.0):.2f}s eta {_hms(eta)}")
        self._print(" | ".join(parts))

    def message(self, text: str) -> None:
        self._print(text)

    def finish(self, summary: dict[str, Any]) -> None:
        final = " ".join(f"{k}={v:.4f}" for k, v in (summary.get("final") or {}).items() if isinstance(v, (int, float)))
        name = self.run_name or summary.get("name", "")  # the run, not the pipeline's name
        self._print(f"done {name}: {final} ({_hms(summary.get('wall_time') or 0.0)})")


class _StatusLine:
    """The line under the bars: sampled clients, last losses/metrics, bytes sent (re-rendered live)."""

    def __init__(self) -> None:
        self.text = ""

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(self.text, overflow="fold", style="dim")


class RichProgress(ProgressSink):
    """A live ``rich`` display: a rounds bar (elapsed, ETA), the current client's local-step bar
    (with its loss) and a status line (clients, train loss, eval metrics, bytes sent)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console()
        self._live: Any = None
        self._progress: Any = None
        self._rounds: Any = None
        self._steps: Any = None
        self._status = _StatusLine()
        self.total = 0
        self.names: list[str] | None = None
        self.clients: list[int] = []
        self.last = ""
        self.cum_up = 0
        self.cum_down = 0

    def start(self, total_rounds: int, info: dict[str, Any]) -> None:
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.close()
        self.total, self.last, self.cum_up, self.cum_down = total_rounds, "", 0, 0
        self.names = info.get("client_names")  # a natural partition's site names (None: numbered clients)
        first = int(info.get("start_round", 0) or 0)
        self.console.print(f"[bold]{info.get('run_name', '')}[/bold]  method={info.get('method', '?')} task={info.get('task', '?')}"
                           + (f"  (resuming after round {first})" if first else ""))
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
        )
        self._rounds = self._progress.add_task(f"round {first + 1}/{total_rounds}", total=total_rounds, completed=first, info="")
        self._steps = self._progress.add_task("  client", total=1, completed=0, info="", visible=False)
        self._status.text = ""
        self._live = Live(Group(self._progress, self._status), console=self.console, refresh_per_second=8, transient=False)
        self._live.start()

    def _set_status(self) -> None:
        self._status.text = (f"{'sites' if self.names else 'clients'} [{_clients(self.clients, names=self.names)}]"
                             + (f" | {self.last}" if self.last else ""))

    def round_start(self, round: int, clients: list[int]) -> None:
        self.clients = list(clients)
        self._set_status()
        if self._progress is not None:
            self._progress.update(self._rounds, description=f"round {round + 1}/{self.total}")

    def client_start(self, round: int, client: int, steps: int) -> None:
        if self._progress is None:
            return
        i = self.clients.index(client) + 1 if client in self.clients else 0
        self._progress.reset(self._steps, total=max(steps, 1), completed=0, visible=True,
                             description=f"  {'site' if self.names else 'client'} {_clients([client], names=self.names)} "
                                         f"({i}/{len(self.clients)})", info="")

    def client_step(self, round: int, client: int, step: int, steps: int, loss: float) -> None:
        if self._progress is not None:
            self._progress.update(self._steps, completed=step + 1, total=max(steps, 1), info=f"loss {loss:.4f}")

    def round_end(self, round: int, record: dict[str, Any]) -> None:
        self.cum_up = int(record.get("cum_bytes_up", self.cum_up + int(record.get("bytes_up", 0))))
        self.cum_down = int(record.get("cum_bytes_down", self.cum_down + int(record.get("bytes_down", 0))))
        from fedgalore.report.tables import format_bytes  # here: `fedgalore --help` reads PROGRESS_MODES without torch

        ev = _evals(record, limit=2)
        self.last = (f"round {round + 1}: {_train_loss(record)}" + (f" | eval {ev}" if ev else "")
                     + f" | sent so far (all clients) ↑{format_bytes(self.cum_up)} ↓{format_bytes(self.cum_down)}")
        self._set_status()
        if self._progress is not None:
            self._progress.update(self._rounds, completed=round + 1)
            self._progress.update(self._steps, visible=False)

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def finish(self, summary: dict[str, Any]) -> None:
        self.close()
        final = " ".join(f"{k}={v:.4f}" for k, v in (summary.get("final") or {}).items() if isinstance(v, (int, float)))
        self.console.print(f"[green]done[/green] {summary.get('name', '')}: {final}", highlight=False)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
            self._progress = None


def make_progress(mode: str = "auto", stream: TextIO | None = None) -> ProgressSink:
    """The progress sink for ``mode`` (auto | rich | plain | quiet)."""
    if mode not in PROGRESS_MODES:
        from fedgalore.job.config import ConfigError

        raise ConfigError(f"progress mode {mode!r} is not one of {', '.join(PROGRESS_MODES)}")
    if mode == "auto":
        mode = "rich" if (stream or sys.stdout).isatty() else "plain"
    if mode == "rich":
        return RichProgress()
    if mode == "plain":
        return PlainProgress(stream)
    return QuietProgress()
