"""A run you can watch (issue 44): summary.json kept current every round, the run directory's lock
(a second run or --resume of a live run refused, a dead holder's lock taken over), the end states
(complete, failed with its error, interrupted by Ctrl-C or SIGTERM; kill -9 leaves a run that
``fedgalore status`` calls dead), and export / evaluate of a live run saying so."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedgalore
from fedgalore.cli import main
from fedgalore.engine.events import ProgressSink
from fedgalore.records.liveness import LOCK_FILE, Heartbeat, RunBusy, RunLock, run_state
from fedgalore_testing.cmdline import tiny_config  # noqa: E402
from fedgalore_testing.runs import tiny_cfg  # noqa: E402


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ----------------------------------------------------------------------------- the lock
def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    run_dir = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir.mkdir()
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename, "started": "x"}))
        with pytest.raises(RunBusy, match=rf"is being run now by process {holder.pid} .*fedgalore status {run_dir}"):
            RunLock(run_dir).acquire(print)
    finally:
        holder.kill()
        holder.wait()
    said: list[str] = []
    lock = RunLock(run_dir)
    lock.acquire(said.append)  # its holder is gone: stale, taken over, said once
    assert said == [f"{run_dir}: taking over the lock of process {holder.pid}, which is no longer running (it was killed or crashed)"]
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    # a lock another process took over meanwhile is not removed by the old holder's release
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename, "token": "other"}))
    lock.release()
    assert (run_dir / LOCK_FILE).is_file()


def test_heartbeat_rewrites_the_summary_between_rounds(tmp_path):
    written: list[dict] = []
    hb = Heartbeat(written.append, interval=0.05)
    hb.beat({"status": "running", "rounds_completed": 1})
    hb.start()
    time.sleep(0.3)
    hb.stop()
    n = len(written)
    time.sleep(0.15)
    assert n >= 3 and len(written) == n  # beats while started, none after stop
    assert all(w["status"] == "running" and w["pid"] == os.getpid() and "heartbeat" in w for w in written)
    assert written[-1]["heartbeat_unix"] > written[0]["heartbeat_unix"]


# ----------------------------------------------------------------------------- a run's summary, in process
class _Watch(ProgressSink):
    """Reads summary.json and the lock at every round's end (the loop writes both before the next round)."""

    def __init__(self, run_dir_of, fail_at: int | None = None) -> None:
        self.run_dir_of, self.fail_at, self.seen = run_dir_of, fail_at, []

    def round_end(self, round, record):  # noqa: A002
        if self.fail_at == round:
            raise RuntimeError("boom\nsecond line")
        d = self.run_dir_of()
        self.seen.append((json.loads((d / "summary.json").read_text()), (d / LOCK_FILE).is_file()))


def test_summary_is_current_every_round_and_a_failure_is_recorded(tmp_path):
    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=3)
    watch = _Watch(lambda: next(tmp_path.iterdir()))
    res = fedgalore.run(cfg, progress=watch)
    # at the end of round k the summary on disk is round k-1's (the round's own is written after its checkpoint)
    assert [(s["status"], s["rounds_completed"], locked) for s, locked in watch.seen] == [("running", 0, True), ("running", 1, True),
                                                                                         ("running", 2, True)]
    assert all(s["pid"] == os.getpid() and s["heartbeat"].endswith("Z") for s, _ in watch.seen)
    done = json.loads((res.run_dir / "summary.json").read_text())
    assert done["status"] == "finished" and done["rounds_completed"] == 3 and not (res.run_dir / LOCK_FILE).exists()
    assert run_state(res.run_dir).verdict() == f"{res.run_dir}: finished — 3/3 rounds"

    cfg2 = tiny_cfg(tmp_path / "b", "fedavg_full", rounds=3)
    with pytest.raises(RuntimeError, match="boom"):
        fedgalore.run(cfg2, progress=_Watch(lambda: next((tmp_path / "b").iterdir()), fail_at=1))
    d = next((tmp_path / "b").iterdir())
    s = json.loads((d / "summary.json").read_text())
    assert (s["status"], s["error"], s["rounds_completed"], s["checkpointed_round"]) == ("failed", "RuntimeError: boom", 2, 1)
    assert not (d / LOCK_FILE).exists()
    st = run_state(d)
    assert not st.live and st.verdict().startswith(f"{d}: failed after 2/3 rounds (RuntimeError: boom); checkpoint: round 1")
    assert fedgalore.resume(d).summary["status"] == "finished"


def test_a_live_run_without_checkpoint_is_not_called_stopped(tmp_path, capsys):
    """export / evaluate before the first checkpoint of a live run: "live, no checkpoint yet", not
    "continue it with --resume" (which would start a second process on it)."""
    res = fedgalore.run(tiny_cfg(tmp_path, "fedavg_full", rounds=1))
    d = res.run_dir
    import shutil

    shutil.rmtree(d / "checkpoints")
    s = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**s, "status": "running", "rounds_completed": 0}))
    (d / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))  # a live process
    for argv in (["export", str(d), "--out", str(tmp_path / "x")], ["evaluate", str(d)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{d} is live (process {os.getppid()} is running it, 0/1 rounds done) and has no checkpoint yet" in err
        assert "--resume" not in err
    assert main(["status", str(d)]) == 0
    assert "running — process" in capsys.readouterr().out
    (d / LOCK_FILE).unlink()
    assert main(["export", str(d), "--out", str(tmp_path / "x")]) == 2
    assert "continue the run with `fedgalore run --resume" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real processes
def _start(cfg: Path, env_extra: dict | None = None, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "fedgalore.cli", "run", "--config", str(cfg), "--progress", "plain", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def _wait_for(proc: subprocess.Popen, text: str) -> None:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"the run ended before {text!r}:\n{''.join(seen)[-2000:]}\n{proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_live_run_is_watched_refused_exported_and_found_dead_after_kill_9(tmp_path, capsys):
    cfg = tiny_config(tmp_path, rounds=500)
    run_dir = tmp_path / "runs" / "tiny-fedgalore-dirichlet0.5-s0"
    proc = _start(cfg)
    try:
        _wait_for(proc, "round 2/500")
        assert main(["status", str(run_dir)]) == 0
        out = capsys.readouterr().out
        assert f"{run_dir}: running — process {proc.pid} is alive;" in out and "last metrics (round" in out
        # a second process on it: refused with one line each
        assert main(["run", "--resume", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"fedgalore: error: {run_dir} is being run now by process {proc.pid}") and "\n" not in err
        assert main(["run", "--config", str(cfg), "federation.rounds=500"]) == 2
        assert f"and process {proc.pid} is running it now" in capsys.readouterr().err
        # export and evaluate of the live run say so and which checkpoint they take
        assert main(["export", str(run_dir), "--out", str(tmp_path / "exp")]) == 0
        out = capsys.readouterr().out
        assert f"note: {run_dir} is live (process {proc.pid}" in out and "this takes its checkpoint of round" in out
        card = (tmp_path / "exp" / "README.md").read_text()
        assert "still running when exported" in card and "completed when exported (the run was still running)" in card
        assert " 0 completed of 500" not in card
        assert main(["evaluate", str(run_dir), "--json"]) == 0
        assert "is live" in json.loads(capsys.readouterr().out)["live"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    state = run_state(run_dir)
    assert state.status == "running" and not state.live and state.pid == proc.pid and state.pid_alive is False
    assert main(["status", str(run_dir), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["looks_dead"] is True and js["verdict"].startswith(f"{run_dir}: looks dead — summary.json says running but "
                                                                 f"process {proc.pid} is not running")
    # resuming takes the stale lock over, saying so once
    from fedgalore.job.config import load_config
    from fedgalore.engine.loop import Federation

    said: list[str] = []

    class Sink(ProgressSink):
        def message(self, text):
            said.append(text)

    fed = Federation(load_config(run_dir / "config.yaml"), run_dir=run_dir, resume=True, progress=Sink())
    assert said[0] == f"{run_dir}: taking over the lock of process {proc.pid}, which is no longer running (it was killed or crashed)"
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    del fed


@pytest.mark.slow
def test_sigterm_stops_the_run_cleanly_as_interrupted(tmp_path):
    cfg = tiny_config(tmp_path, rounds=500)
    run_dir = tmp_path / "runs" / "tiny-fedgalore-dirichlet0.5-s0"
    proc = _start(cfg)
    try:
        _wait_for(proc, "round 1/500")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert f"fedgalore: stopped by SIGTERM; continue with: fedgalore run --resume {run_dir}" in err
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["interrupted_by"]) == ("interrupted", "SIGTERM") and s["rounds_completed"] >= 1
    assert not (run_dir / LOCK_FILE).exists()
    assert run_state(run_dir).verdict().startswith(f"{run_dir}: interrupted by SIGTERM after ")


def test_a_lock_left_by_a_killed_resume_reads_as_dead(tmp_path, capsys):
    """A resume killed while it loaded leaves its lock and the summary of the stop before it: status
    says the holder is gone, not just "interrupted"."""
    res = fedgalore.run(tiny_cfg(tmp_path, "fedavg_full", rounds=1))
    dead = _dead_pid()
    (res.run_dir / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": os.uname().nodename}))
    st = run_state(res.run_dir)
    assert st.stale_lock and st.looks_dead and not st.live
    assert main(["status", str(res.run_dir)]) == 0
    assert (f"{res.run_dir}: looks dead — process {dead}, which holds its run.lock, is not running (it was killed while "
            "starting or resuming); summary.json still says finished, 1/1 rounds done") in capsys.readouterr().out
