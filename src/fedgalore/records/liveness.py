"""Whether a run is live: its lock, its heartbeat, and what ``fedgalore status`` shows (docs/cli.md).

A run directory is run by one process at a time. The process that runs it (``fedgalore run``,
``--resume``, ``fedgalore.run``, a Flower ServerApp) holds ``<run>/run.lock`` (:class:`RunLock`,
created exclusively; JSON: ``pid``, ``host``, ``started``, the process's start time where the OS
tells it, and a token) from the moment the directory is chosen until the run ends, however it
ends. A second process asking for the same directory is refused with one line
(:class:`RunBusy`); a lock whose process is gone (``kill -9``, a power cut) is *stale* and taken
over, said once. Meanwhile ``summary.json`` is kept current (:class:`Heartbeat`): rewritten
atomically after every round and every :data:`HEARTBEAT_S` seconds in between, with ``status``
(``running | finished | failed | interrupted``), ``rounds_completed``, ``pid``, ``host`` and
``heartbeat`` (UTC, ISO 8601; ``heartbeat_unix`` in seconds). ``finished``: all rounds done
(runs written before 2026-11-28 say ``complete``, read the same: :func:`is_finished`; ``fedgalore
compare`` skips such cells); Ctrl-C and SIGTERM leave ``interrupted``, an exception
``failed`` with its ``error`` line; ``kill -9`` leaves ``running`` with a heartbeat that stops
ageing and a process that no longer exists, which :func:`run_state` calls dead.

:func:`run_state` reads all of it for ``fedgalore status`` and for ``export`` / ``evaluate`` /
``predict``, which say when they read a live run and which checkpoint they take
(:func:`live_note`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fedgalore.typed import ConfigError  # (fedgalore.job.config's, without building the config's imports)
from fedgalore.federated.checkpoint import kept_rounds
from fedgalore.jsonl import read_json, read_jsonl

__all__ = ["LOCK_FILE", "FINISHED", "is_finished", "HEARTBEAT_S", "RunBusy", "Terminated", "RunLock", "Heartbeat", "RunState", "run_state",
           "live_note", "pid_alive", "sigterm_stops", "utc_now"]

LOCK_FILE = "run.lock"
#: the state of a run that did all its rounds (``summary.json`` ``status``)
FINISHED = "finished"
#: what runs written before 2026-11-28 call it
_FINISHED_BEFORE = "complete"


def is_finished(status: Any) -> bool:
    """Whether a ``summary.json`` status says the run did all its rounds: ``finished``, or
    ``complete`` (the word of runs written before 2026-11-28)."""
    return status in (FINISHED, _FINISHED_BEFORE)
#: seconds between heartbeats while a round runs (summary.json is also rewritten after every round)
HEARTBEAT_S = 30.0
#: a run on another machine (its process cannot be asked) counts as live while its heartbeat is younger than this
REMOTE_STALE_S = 4 * HEARTBEAT_S

#: locks this process holds, by resolved run directory (a second Federation on the same directory in one process)
_HELD: dict[str, "RunLock"] = {}


class RunBusy(ConfigError):
    """Another live process is running this run directory (one line: which, and what to do)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into a clean stop of the round loop (:func:`sigterm_stops`): the run is
    marked ``interrupted``, its checkpoint kept, its lock released."""


def utc_now() -> str:
    """The current time in UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat``), which
    tells a process from a later one that reuses its pid; None where there is no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int, proc_start: str | None = None) -> bool:
    """Whether process ``pid`` exists on this machine (and, given ``proc_start``, is the same
    process that recorded it, not a later one with its pid)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return False
    if proc_start is not None:
        now = _proc_start(int(pid))
        return now is None or now == proc_start
    return True


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path) or {}


def _seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


# ----------------------------------------------------------------------------- the lock
class RunLock:
    """``<run_dir>/run.lock``: held by the process running ``run_dir`` (module doc)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.token = uuid.uuid4().hex
        self.held = False
        #: set by the round loop while it runs (a second run of the directory in this process is then refused)
        self.running = False

    def holder(self) -> dict[str, Any]:
        """The lock file's record ({} when absent or unreadable)."""
        return _read_json(self.path)

    def acquire(self, say: Callable[[str], None]) -> None:
        """Take the lock; :class:`RunBusy` when a live process holds it. A lock left by a process
        that no longer runs is taken over (said through ``say``); so is one this process left
        behind (a ``Federation`` made and never run)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": utc_now(),
              "proc_start": _proc_start(os.getpid()), "token": self.token}
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over(say)  # refuses a live holder; removes a stale lock, then try again
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me))
            self.held = True
            _HELD[str(self.path.resolve())] = self
            return
        raise RunBusy(f"could not lock {self.path.parent} ({self.path} keeps changing hands); is another fedgalore "
                      "process starting this run? see `fedgalore status " + str(self.path.parent) + "`")

    def _take_over(self, say: Callable[[str], None]) -> None:
        """A lock file exists: refuse (:class:`RunBusy`) if its process is live, else remove it."""
        h = self.holder()
        run_dir = self.path.parent
        pid, host = h.get("pid"), h.get("host")
        mine = str(self.path.resolve())
        if pid == os.getpid() and host == socket.gethostname():
            other = _HELD.get(mine)
            if other is not None and other is not self and other.running:
                raise RunBusy(f"{run_dir} is being run by this process already (another Federation on it is running); "
                              "wait for it to finish")
            self._remove_if(h)  # left behind in this process by a Federation that never ran: ours now
            return
        if pid is not None and host == socket.gethostname():
            if pid_alive(pid, h.get("proc_start")):
                raise RunBusy(_busy_line(run_dir, h))
            say(f"{run_dir}: taking over the lock of process {pid}, which is no longer running (it was killed or crashed)")
        elif pid is not None and host is not None:  # another machine: judge by the heartbeat
            state = run_state(run_dir)
            if state.heartbeat_age_s is None or state.heartbeat_age_s < REMOTE_STALE_S:
                raise RunBusy(_busy_line(run_dir, h) + f" (on {host}: if that machine is down, delete {self.path})")
            say(f"{run_dir}: taking over the lock of process {pid} on {host}, whose heartbeat stopped "
                f"{_seconds(state.heartbeat_age_s)} ago")
        else:
            say(f"{run_dir}: removing an unreadable lock file {self.path}")
        self._remove_if(h)

    def _remove_if(self, seen: dict[str, Any]) -> None:
        """Remove the lock file if it still holds the record ``seen`` (not one taken meanwhile)."""
        if self.holder() == seen:
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Give the lock up (idempotent; a lock file another process took over is left alone)."""
        if not self.held:
            return
        self.held = self.running = False
        if self.holder().get("token") == self.token:
            self.path.unlink(missing_ok=True)
        mine = str(self.path.resolve())
        if _HELD.get(mine) is self:
            del _HELD[mine]


def _busy_line(run_dir: Path, holder: dict[str, Any]) -> str:
    s = _read_json(run_dir / "summary.json")
    done, total = s.get("rounds_completed"), s.get("rounds")
    where = f", {done}/{total} rounds done" if done is not None and total is not None else ""
    return (f"{run_dir} is being run now by process {holder.get('pid')} (started {holder.get('started', '?')}{where}); "
            f"a second run on it is refused — watch it with `fedgalore status {run_dir}`, stop it with "
            f"`kill {holder.get('pid')}` (it stops cleanly and can be resumed), or set output.run_name=<new name> to start another")


# ----------------------------------------------------------------------------- the heartbeat
class Heartbeat:
    """Keeps ``summary.json`` current: :meth:`beat` writes a summary now (stamped with ``pid``,
    ``host`` and the heartbeat time) and remembers it; a daemon thread rewrites it every
    ``interval`` seconds with a fresh heartbeat until :meth:`stop`. ``write``: the atomic writer."""

    def __init__(self, write: Callable[[dict[str, Any]], None], interval: float = HEARTBEAT_S,
                 extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self._write, self.interval = write, float(interval)
        #: what each periodic beat adds to the remembered summary (the position inside a round)
        self._extra = extra
        self._summary: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def stamp(summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` with this process and the current time."""
        return {**summary, "pid": os.getpid(), "host": socket.gethostname(), "heartbeat": utc_now(),
                "heartbeat_unix": round(time.time(), 3)}

    def beat(self, summary: dict[str, Any]) -> None:
        with self._lock:
            self._summary = summary
            self._write(self.stamp(summary))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fedgalore-heartbeat", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set() or self._summary is None:
                    return
                try:
                    self._write(self.stamp({**self._summary, **(self._extra() if self._extra is not None else {})}))
                except OSError:  # a full disk must not kill the run from a side thread; the next round retries
                    pass

    def stop(self) -> None:
        """No more beats (idempotent); a write in progress finishes first."""
        self._stop.set()
        with self._lock:
            self._summary = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class sigterm_stops:
    """Context manager: while it is active, SIGTERM raises :class:`Terminated` in the main thread
    (a clean stop: the run is marked ``interrupted``). Only where SIGTERM has its default action
    (it would kill the process without cleanup) and only in the main thread (where Python runs
    signal handlers); a handler someone else installed (a Flower app's) is left alone."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "sigterm_stops":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        return self

    @staticmethod
    def _handler(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


# ----------------------------------------------------------------------------- reading it
@dataclass
class RunState:
    """What ``fedgalore status`` shows of one run directory."""

    run_dir: str
    #: ``summary.json``'s status (``running``, ``complete``, ``failed``, ``interrupted``), ``starting``
    #: (locked, no summary yet), or ``unknown``
    status: str
    #: whether a process is running it now (its lock's process is alive; another machine's: a fresh heartbeat)
    live: bool
    rounds_completed: int | None = None
    rounds: int | None = None
    pid: int | None = None
    host: str | None = None
    #: whether ``pid`` runs on this machine now (None: another machine, or no pid recorded)
    pid_alive: bool | None = None
    heartbeat: str | None = None
    heartbeat_age_s: float | None = None
    #: the rounds whose checkpoints are kept (what export / evaluate / --resume can take)
    checkpoints: list[int] = field(default_factory=list)
    #: the newest evaluated round and its metrics (``eval/`` keys without the prefix)
    last_round: int | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    interrupted_by: str | None = None
    #: ``run.lock`` is there but its process is gone: the last process to run it was killed (or crashed)
    stale_lock: bool = False
    #: where inside a round the run was at its last heartbeat (round, client i of K, step s of S); {} between rounds
    progress: dict[str, Any] = field(default_factory=dict)

    def position(self) -> str:
        """``round 3/10: client 2/5, step 40/120`` from :attr:`progress` ('' when none)."""
        p = self.progress
        if not p.get("round"):
            return ""
        out = f"round {p['round']}/{p.get('rounds', '?')}"
        if p.get("client_index"):
            out += f": client {p['client_index']}/{p.get('clients', '?')}"
            if p.get("steps"):
                out += f", step {p.get('step', 0)}/{p['steps']}"
        elif p.get("clients"):
            out += f": {p['clients']} client(s) sampled"
        return out

    @property
    def looks_dead(self) -> bool:
        """No process runs it, yet ``summary.json`` says running or a lock is left (``kill -9``, a crash, a power cut)."""
        return not self.live and (self.status in ("running", "starting") or self.stale_lock)

    def verdict(self) -> str:
        """One line: what the run is doing and what to do next."""
        d = self.run_dir
        rounds = f"{self.rounds_completed if self.rounds_completed is not None else '?'}/{self.rounds or '?'} rounds"
        ckpt = f"checkpoint: round {self.checkpoints[-1]}" if self.checkpoints else "no checkpoint yet"
        beat = f"heartbeat {_seconds(self.heartbeat_age_s)} ago" if self.heartbeat_age_s is not None else "no heartbeat recorded"
        if self.live:
            where = f" on {self.host}" if self.pid_alive is None and self.host else ""
            doing = "running" if self.status == "running" else "starting (building the model and data, or resuming)"
            at = f"; now in {self.position()}" if self.position() else ""
            return f"{d}: {doing} — process {self.pid}{where} is alive; {rounds} done{at} ({ckpt}); {beat}"
        if self.stale_lock and self.status not in ("running", "starting"):  # e.g. a resume killed while it loaded
            says = f"summary.json still says {self.status}, {rounds} done" if self.status != "unknown" else "no summary.json yet"
            return (f"{d}: looks dead — process {self.pid}, which holds its run.lock, is not running (it was killed while "
                    f"starting or resuming); {says} ({ckpt}); continue it with: fedgalore run --resume {d}")
        if self.status == "running":
            why = (f"process {self.pid} is not running" if self.pid is not None and self.pid_alive is False
                   else f"process {self.pid} on {self.host}: {beat}" if self.pid is not None
                   else "no process recorded (written by an older version, or killed)")
            return (f"{d}: looks dead — summary.json says running but {why}; {rounds} done ({ckpt}); {beat}; "
                    f"continue it with: fedgalore run --resume {d}")
        if is_finished(self.status):
            return f"{d}: finished — {rounds}"
        if self.status == "failed":
            return f"{d}: failed after {rounds} ({self.error or 'no error recorded'}); {ckpt}; fix the cause, then: fedgalore run --resume {d}"
        if self.status == "interrupted":
            by = f" by {self.interrupted_by}" if self.interrupted_by else ""
            return f"{d}: interrupted{by} after {rounds} ({ckpt}); continue it with: fedgalore run --resume {d}"
        return f"{d}: {self.status}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "looks_dead": self.looks_dead, "verdict": self.verdict()}


def run_state(run_dir: str | Path) -> RunState:
    """The state of the run in ``run_dir`` (module doc): its summary, its lock and whether that
    lock's process is alive, its heartbeat's age, kept checkpoints and newest metrics."""
    run_dir = Path(run_dir)
    s = _read_json(run_dir / "summary.json")
    lock = _read_json(run_dir / LOCK_FILE)
    here = socket.gethostname()
    pid = lock.get("pid", s.get("pid"))
    host = lock.get("host", s.get("host"))
    alive: bool | None = None
    if pid is not None and (host is None or host == here):
        alive = pid_alive(int(pid), lock.get("proc_start") if lock else None)
    beat = s.get("heartbeat_unix")
    age = max(0.0, time.time() - float(beat)) if isinstance(beat, (int, float)) else None
    if lock:
        live = bool(alive) if alive is not None else (age is not None and age < REMOTE_STALE_S)
    else:
        live = False
    status = s.get("status") or ("starting" if live else "unknown")
    last_round, last = None, {}
    for rec in reversed(read_jsonl(run_dir / "metrics.jsonl")):
        evals = {k[5:]: v for k, v in rec.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        if evals:
            last_round, last = int(rec.get("round", 0)), evals
            break
    return RunState(str(run_dir), status, live, s.get("rounds_completed"), s.get("rounds"), pid, host, alive,
                    s.get("heartbeat"), age, kept_rounds(run_dir), last_round, last, s.get("error"), s.get("interrupted_by"),
                    stale_lock=bool(lock) and not live,
                    progress=s.get("progress") if live and isinstance(s.get("progress"), dict) else {})


def live_note(run_dir: str | Path, round_taken: int) -> str | None:
    """For ``export`` / ``evaluate`` / ``predict`` of a run that is live now: one line saying so
    and which checkpoint they take; None when no process runs it."""
    st = run_state(run_dir)
    if not st.live:
        return None
    done = f"{st.rounds_completed}/{st.rounds} rounds done" if st.rounds_completed is not None else "starting"
    newest = f"the newest kept one now" if st.checkpoints and st.checkpoints[-1] == round_taken else \
        f"newest kept: round {st.checkpoints[-1]}" if st.checkpoints else "no other kept"
    return (f"{run_dir} is live (process {st.pid}, {done}): this takes its checkpoint of round {round_taken} ({newest}); "
            "rounds the run completes later are not in it")
