"""Streamed, half-background checkpoints (issue 18, round overhead): same file as before, taken at
the moment ``save`` returns, complete or absent, errors surfaced."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save as st_save

from fedgalore.federated import checkpoint as ck
from fedgalore.federated.checkpoint import CheckpointError, CheckpointWriter, load_latest_checkpoint, save_checkpoint
from fedgalore.protocol.payload import MomentView, flatten_entries
from fedgalore.protocol.state import ServerState


def _state(seed: int = 0) -> ServerState:
    g = torch.Generator().manual_seed(seed)
    return ServerState(
        params={"a.weight": torch.randn(12, 7, generator=g), "head": torch.randn(3, generator=g).to(torch.bfloat16)},
        extras={"step": torch.tensor(4, dtype=torch.int64)},
        meta={"seed_chain": [1, 2], "downlink_held": {"3": 2}},
        moments={"a.weight": MomentView(torch.rand(12, 2, generator=g), "right", (12, 7), basis=torch.randn(2, 7, generator=g))},
    )


def _same(a: ServerState, b: ServerState) -> bool:
    return (a.meta == b.meta and all(torch.equal(a.params[k], b.params[k]) for k in a.params)
            and all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)
            and torch.equal(a.moments["a.weight"].moment, b.moments["a.weight"].moment))


def test_streamed_file_is_the_blob_safetensors_would_write(tmp_path):
    st = _state()
    path = save_checkpoint(tmp_path, 1, st, {"wall_time": 1.5})
    tensors = {f"p/{k}": v for k, v in st.params.items()} | {f"x/{k}": v for k, v in st.extras.items()}
    tensors |= {f"m/{k}": v for k, v in flatten_entries(st.moments)[1].items()}
    blob = st_save(tensors)
    assert (path / "state.safetensors").read_bytes() == blob
    info = json.loads((path / "state.json").read_text())
    assert info["sha256"] == hashlib.sha256(blob).hexdigest() and info["round"] == 1 and info["wall_time"] == 1.5
    loaded, _ = load_latest_checkpoint(tmp_path)
    assert _same(loaded, st)


def test_background_checkpoint_holds_the_state_as_of_save(tmp_path):
    """The next round may change the state in place as soon as ``save`` returns."""
    st, before = _state(), _state()
    w = CheckpointWriter(tmp_path, keep=2)
    w.save(1, st, {"wall_time": 0.0})
    st.params["a.weight"].mul_(-3.0)  # the next round, while fsync and hash run in the background
    st.meta["seed_chain"].append(99)
    st.moments["a.weight"].moment.zero_()
    w.wait()
    loaded, info = load_latest_checkpoint(tmp_path)
    assert info["round"] == 1 and _same(loaded, before)
    w.save(2, st, {})
    w.save(3, st, {})  # waits for round 2 first; keep=2 prunes round 1
    w.wait()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("round_*")) == ["round_0002", "round_0003"]
    assert (tmp_path / "checkpoints" / "LATEST").read_text().strip() == "round_0003"


def test_a_failing_background_step_is_raised_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    st = _state()
    w = CheckpointWriter(tmp_path, keep=3)
    w.save(1, st, {})
    w.wait()

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "rename", broken)
    w.save(2, st, {})
    with pytest.raises(CheckpointError, match="disk full"):
        w.wait()
    w.wait()  # reported once
    monkeypatch.undo()
    _, info = load_latest_checkpoint(tmp_path)
    assert info["round"] == 1  # round 2 never became visible


def test_deferred_tensors_are_written_in_the_background_and_are_the_same_file(tmp_path, monkeypatch):
    """``defer_tensors``: the caller's thread only snapshots the metadata; the file is the one the
    streamed mode writes; metadata changed right after ``save`` is not in it; a failing write is
    raised by ``wait`` and leaves the previous checkpoint newest."""
    st = _state()
    streamed = save_checkpoint(tmp_path / "a", 1, st, {"wall_time": 1.0})
    w = CheckpointWriter(tmp_path / "b", keep=3)
    calls = []
    real = ck.write_safetensors
    monkeypatch.setattr(ck, "write_safetensors", lambda fh, t: (calls.append(__import__("threading").current_thread().name), real(fh, t))[1])
    w.save(1, st, {"wall_time": 1.0}, defer_tensors=True)
    st.meta["seed_chain"].append(7)  # metadata may change at once (snapshotted); tensors only after wait()
    w.wait()
    assert calls == ["fedgalore-checkpoint"]
    deferred = tmp_path / "b" / "checkpoints" / "round_0001"
    assert (deferred / "state.safetensors").read_bytes() == (streamed / "state.safetensors").read_bytes()
    assert json.loads((deferred / "state.json").read_text())["server_meta"]["seed_chain"] == [1, 2]

    def broken(fh, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "write_safetensors", broken)
    w.save(2, st, {}, defer_tensors=True)
    with pytest.raises(CheckpointError, match="disk full"):
        w.wait()
    assert load_latest_checkpoint(tmp_path / "b")[1]["round"] == 1


def test_the_round_loop_waits_for_its_checkpoint_before_the_aggregation_changes_the_state(tmp_path, monkeypatch):
    """The loop's checkpoints stream the state's own tensors in the background; every aggregation
    (the first in-place change of the state) starts with no checkpoint pending, and the
    checkpoints hold the state of their round (a resumed run equals an uninterrupted one: the
    kill-and-resume tests; here: the last checkpoint equals the final state)."""
    import fedgalore
    from fedgalore.engine.loop import Federation
    from fedgalore_testing.runs import tiny_cfg

    pending = []
    real_round = Federation._round

    def watched(self, k):
        real_agg = self.method.aggregate

        def agg(*a, **kw):
            pending.append(self._writer._thread is not None)
            return real_agg(*a, **kw)

        self.method.aggregate = agg
        try:
            return real_round(self, k)
        finally:
            self.method.aggregate = real_agg

    monkeypatch.setattr(Federation, "_round", watched)
    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=3)
    fed = Federation(cfg, run_dir=tmp_path / "r")
    fed.run()
    assert pending == [False, False, False]
    state, info = load_latest_checkpoint(fed.run_dir)
    assert info["round"] == 3 and all(torch.equal(state.params[k], fed.state.params[k]) for k in fed.state.params)


def test_a_run_reports_its_checkpoint_time_and_ends_with_a_durable_checkpoint(tmp_path):
    import csv

    import fedgalore
    from fedgalore_testing.runs import tiny_cfg

    cfg = tiny_cfg(tmp_path, "fedgalore", rounds=3)
    cfg.output.checkpoint_every = 2  # rounds 2 and 3 (the last)
    res = fedgalore.run(cfg, run_dir=tmp_path / "r")
    rows = list(csv.DictReader(open(res.run_dir / "metrics.csv")))
    took = [r["time_checkpoint"] for r in rows]
    assert took[0] == "" and float(took[1]) > 0 and float(took[2]) > 0
    assert res.summary["time_checkpoint"] == pytest.approx(float(took[1]) + float(took[2]))
    state, info = load_latest_checkpoint(res.run_dir)  # complete when run() returned
    assert info["round"] == 3 and not list((res.run_dir / "checkpoints").glob(".tmp_*"))


@pytest.mark.parametrize("budget,expect", [(1e-9, [1, 5]), (1.0, [1, 2, 3, 4, 5])])
def test_checkpoint_every_auto_spends_at_most_its_budget(tmp_path, budget, expect):
    """``auto``: the first round (its cost measured), then only while the time in checkpoints stays
    within the budget share of the wall time; always the last round."""
    import csv

    import fedgalore
    from fedgalore_testing.runs import tiny_cfg

    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=5)
    cfg.output.checkpoint_every = "auto"
    cfg.output.checkpoint_budget = budget
    res = fedgalore.run(cfg.validate(), run_dir=tmp_path / "r")
    rows = list(csv.DictReader(open(res.run_dir / "metrics.csv")))
    assert [int(r["round"]) for r in rows if r.get("time_checkpoint")] == expect
    assert load_latest_checkpoint(res.run_dir)[1]["round"] == 5


def test_checkpoint_settings_are_checked():
    from fedgalore.job.config import ConfigError, FederatedConfig

    for bad, msg in (({"checkpoint_every": "sometimes"}, "checkpoint_every"), ({"checkpoint_every": 0}, "checkpoint_every"),
                     ({"checkpoint_budget": 0}, "checkpoint_budget")):
        with pytest.raises(ConfigError, match=msg):
            FederatedConfig.from_dict({"output": bad})


def test_wait_survives_a_start_interrupted_before_the_thread_started(tmp_path, monkeypatch):
    """A KeyboardInterrupt inside ``Thread.start()`` (seen under load: the run's Ctrl-C arrived
    while the checkpoint thread was starting) left a thread object ``join`` refuses; ``wait``
    must not turn that into a RuntimeError — a thread that starts late is joined, one that never
    starts wrote nothing."""
    import threading

    from fedgalore.federated.checkpoint import CheckpointWriter

    w = CheckpointWriter(tmp_path, keep=1)
    monkeypatch.setattr(CheckpointWriter, "START_GRACE_S", 0.05)
    w._thread = threading.Thread(target=lambda: None)  # created, never started
    w.wait()
    assert w._thread is None
    ran = []
    late = threading.Thread(target=lambda: ran.append(1))
    w._thread = late
    threading.Timer(0.01, late.start).start()  # starts while wait() is retrying
    monkeypatch.setattr(CheckpointWriter, "START_GRACE_S", 5.0)
    w.wait()
    assert ran == [1]
