"""Rounds that spend their time training, and say where they are:

* the update-space diagnostic of a large matrix comes from its top r singular values (a randomized
  range finder), equal to the full SVD's to 1e-3 (1e-2 on a flat spectrum) and never below it; small matrices stay exact
  (the golden recordings' numbers are unchanged);
* after a process's first round, one line names the phases when diagnostics or evaluation took
  more than 30 % of the round;
* inside a round the position (round k/R, client i/K, step s/S) reaches the plain display, the
  heartbeat's summary.json and ``fedgalore status``.
"""
from __future__ import annotations

import io
import json

import pytest
import torch

from fedgalore.engine.events import ProgressSink, TrackingProgress, phase_note
from fedgalore.records.liveness import Heartbeat, RunState
from fedgalore.federated.diagnostics import (EXACT_MAX_FLOPS, tail_energy, tail_energy_sketch,
                                             update_space_diagnostics)
from fedgalore.progress import PlainProgress


def _low_rank_plus_noise(m: int, n: int, k: int, noise: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g) + noise * torch.randn(m, n, generator=g)


@pytest.mark.parametrize("shape, k, noise, tol", [((600, 700), 12, 0.05, 1e-3), ((900, 300), 4, 0.5, 1e-3),
                                                  ((400, 1200), 30, 0.01, 1e-2)])  # 30 near-equal values: a flat top
def test_the_sketched_tail_energy_equals_the_full_svds(shape, k, noise, tol):
    a = _low_rank_plus_noise(*shape, k, noise)
    exact, sketch = tail_energy(a, 8), tail_energy_sketch(a, 8)
    assert sketch == pytest.approx(exact, abs=tol)
    assert sketch >= exact - 1e-6  # σ̂_j ≤ σ_j: the estimate never hides a tail


def test_an_exactly_low_rank_update_has_no_tail_either_way():
    a = _low_rank_plus_noise(800, 600, 6, 0.0)
    assert tail_energy(a, 8) < 1e-3 and tail_energy_sketch(a, 8) < 1e-2


def test_small_matrices_stay_exact_and_exact_mode_is_the_full_svd():
    small = {"w": _low_rank_plus_noise(32, 64, 3, 0.1)}
    assert 32 * 64 * 32 <= EXACT_MAX_FLOPS
    assert update_space_diagnostics(small, 2)["tail_energy_mean"] == tail_energy(small["w"], 2)
    big = {"w": _low_rank_plus_noise(700, 900, 10, 0.2)}
    assert update_space_diagnostics(big, 8, exact=True)["tail_energy_mean"] == tail_energy(big["w"], 8)
    assert update_space_diagnostics(big, 8)["tail_energy_mean"] == pytest.approx(tail_energy(big["w"], 8), abs=1e-3)


def test_the_phases_are_named_when_diagnostics_or_evaluation_dominate():
    rec = {"round": 1, "time_round": 10.0, "time_clients": 4.0, "time_server": 0.5, "time_diagnostics": 4.5, "time_eval": 1.0}
    note = phase_note(rec)
    assert note and "diagnostics 4.5 s" in note and "55 %" in note and "diagnostics=false" in note
    assert "eval_every" not in note.split("—")[1] or rec["time_eval"] > 1.0
    assert phase_note({**rec, "time_diagnostics": 0.2, "time_eval": 0.3}) is None


class _Sink(ProgressSink):
    def __init__(self):
        self.events = []

    def client_step(self, round, client, step, steps, loss):
        self.events.append(("step", client, step))


def test_the_position_inside_a_round_reaches_summary_json_and_status(tmp_path):
    inner = _Sink()
    t = TrackingProgress(inner)
    t.start(4, {})
    assert t.position() == {}
    t.round_start(1, [5, 7, 9])
    t.client_start(1, 5, 10)
    t.client_start(1, 7, 12)
    t.client_step(1, 7, 3, 12, 0.5)
    assert inner.events == [("step", 7, 3)]  # forwarded
    pos = t.position()["progress"]
    assert pos == {"round": 2, "rounds": 4, "clients": 3, "client_index": 2, "client": 7, "step": 3, "steps": 12}
    written = []
    hb = Heartbeat(written.append, interval=0.01, extra=t.position)
    hb.beat({"status": "running"})
    hb.start()
    import time

    time.sleep(0.2)
    hb.stop()
    assert any(w.get("progress", {}).get("client_index") == 2 for w in written)
    state = RunState(str(tmp_path), "running", True, 1, 4, pid=1, progress=pos)
    assert "now in round 2/4: client 2/3, step 3/12" in state.verdict()
    t.round_end(1, {})
    assert t.position() == {}


def test_plain_progress_prints_the_position_inside_a_long_round():
    out = io.StringIO()
    p = PlainProgress(out, interval=0.0)
    p.start(2, {"run_name": "r"})
    p.round_start(0, [3, 8])
    p.client_start(0, 8, 20)
    p.client_step(0, 8, 4, 20, 0.7)
    lines = out.getvalue().splitlines()
    assert "  round 1/2: client 8 (2/2), step 5/20" in lines
    quiet = io.StringIO()
    q = PlainProgress(quiet)  # the default interval: a short round prints no in-round line
    q.start(2, {"run_name": "r"})
    q.round_start(0, [3])
    q.client_start(0, 3, 5)
    assert len(quiet.getvalue().splitlines()) == 1


def test_a_run_records_no_progress_once_it_is_finished(tmp_path):
    from fedgalore_testing.runs import tiny_cfg

    import fedgalore

    res = fedgalore.run(tiny_cfg(tmp_path, rounds=1))
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert "progress" not in summary and summary["status"] in ("complete", "finished")
