"""``python -m fedgalore.flower APP SUPERLINK [flwr run options]``: ``flwr run`` with an exit status.

``flwr run APP SUPERLINK --stream`` shows the run's log but exits 0 even when the run failed.
This wrapper runs exactly that command (adding ``--stream``), passes its output through, then asks
the SuperLink for the run's final status (``flwr ls SUPERLINK --run-id N --format json``) and
exits with

* 0 — the run finished as ``finished:completed``;
* 1 — it failed or was stopped (the last ``fedgalore: error: ...`` line of the log, if any, is
  repeated at the end), or its status could not be read;
* the exit status of ``flwr run`` itself when that failed (e.g. no SuperLink).

Example (examples/flower/README.md)::

    cd examples/flower
    python -m fedgalore.flower . local --federation-config "num-supernodes=6"
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["main", "run_status"]

_STARTED = re.compile(r"Successfully started run (\d+)")


def _flwr() -> list[str]:
    exe = shutil.which("flwr")
    if exe is None:
        raise SystemExit("fedgalore.flower: `flwr` is not on PATH; install the extra: pip install 'fedgalore[flower]'")
    return [exe]


def run_status(superlink: str, run_id: int, wait_s: float = 30.0) -> tuple[str, str]:
    """(status, details) of run ``run_id`` on ``superlink``, e.g. ("finished:failed", "..."),
    waiting up to ``wait_s`` seconds for it to leave ``running``; ("unknown", reason) if unreadable."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = subprocess.run([*_flwr(), "ls", superlink, "--run-id", str(run_id), "--format", "json"],
                              capture_output=True, text=True)
        text = proc.stdout
        start = text.find("{")
        try:
            runs = json.loads(text[start:])["runs"] if start >= 0 else []
        except (json.JSONDecodeError, KeyError):
            runs = []
        if not runs:
            said = (proc.stderr or proc.stdout).strip().splitlines()
            return "unknown", said[-1] if said else "no answer from flwr ls"
        status, details = str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", "") or "")
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flwr run`` with ``argv`` (APP SUPERLINK [options]); return the run's exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[0], file=sys.stderr)
        print("usage: python -m fedgalore.flower APP SUPERLINK [flwr run options]", file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    superlink = args[1]
    if "--stream" not in args:
        args.append("--stream")
    proc = subprocess.Popen([*_flwr(), "run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    run_id, last_error = None, None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if run_id is None and (m := _STARTED.search(line)):
            run_id = int(m.group(1))
        if "fedgalore: error:" in line:
            last_error = line[line.index("fedgalore: error:"):].strip()
    rc = proc.wait()
    if rc != 0:
        return rc
    if run_id is None:
        print("fedgalore.flower: flwr run did not report a run id; cannot tell whether the run succeeded", file=sys.stderr)
        return 1
    status, details = run_status(superlink, run_id)
    if status == "finished:completed":
        print(f"fedgalore.flower: run {run_id} {status}", flush=True)
        return 0
    why = last_error or details or "see the log above"
    print(f"fedgalore.flower: run {run_id} {status}: {why}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
