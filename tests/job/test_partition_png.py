"""partition.png drawn beside a run's first round (fedgalore.job.partition_files: background=True):
the caller does not wait for matplotlib, the file appears whole, a failed background drawing is
redrawn on the caller's thread, and a run ends with the figure written."""
from __future__ import annotations

import threading

import pytest

import fedgalore.job.partition_files as pf

REC = {"setting": "dirichlet:0.5", "kind": "dirichlet", "options": {}, "by": None, "seed": 0,
       "label_names": ["a", "b"], "client_names": ["0", "1"], "histograms": [[3, 1], [0, 4]], "sizes": [4, 4],
       "clients": [{"id": 0, "name": "0", "size": 4}, {"id": 1, "name": "1", "size": 4}]}
PNG = b"\x89PNG\r\n\x1a\n"


def test_background_drawing_returns_before_the_figure_is_drawn(tmp_path, monkeypatch):
    gate, calls = threading.Event(), []

    def slow(text: str) -> bytes:
        calls.append(threading.current_thread().name)
        assert gate.wait(30)
        return PNG + b"drawn"

    monkeypatch.setattr(pf, "_png", slow)
    paths = pf.write_partition_files(REC, tmp_path, background=True)
    assert [p.name for p in paths] == ["partition.json", "partition.png"]
    assert (tmp_path / "partition.json").is_file() and not (tmp_path / "partition.png").exists()  # still drawing
    gate.set()
    pf.wait_for_partition_png(tmp_path)
    assert (tmp_path / "partition.png").read_bytes() == PNG + b"drawn"
    assert calls and calls[0] != threading.main_thread().name
    assert not list(tmp_path.glob(".*.tmp"))  # written whole (a temporary file, renamed)


def test_a_failed_background_drawing_is_drawn_again_on_the_callers_thread(tmp_path, monkeypatch):
    threads = []

    def flaky(text: str) -> bytes:
        threads.append(threading.current_thread() is threading.main_thread())
        if len(threads) == 1:
            raise RuntimeError("no fonts on this thread")
        return PNG + b"second"

    monkeypatch.setattr(pf, "_png", flaky)
    pf.write_partition_files(REC, tmp_path, background=True)
    pf.wait_for_partition_png(tmp_path)
    assert threads == [False, True] and (tmp_path / "partition.png").read_bytes() == PNG + b"second"
    pf.wait_for_partition_png(tmp_path)  # nothing left to wait for: no third drawing
    assert threads == [False, True]


def test_a_drawing_that_fails_twice_raises_on_the_callers_thread(tmp_path, monkeypatch):
    def broken(text: str) -> bytes:
        raise RuntimeError("matplotlib is broken")

    monkeypatch.setattr(pf, "_png", broken)
    pf.write_partition_files(REC, tmp_path, background=True)
    with pytest.raises(RuntimeError, match="matplotlib is broken"):
        pf.wait_for_partition_png(tmp_path)


def test_a_run_ends_with_its_partition_png_drawn(tmp_path):
    """The round loop joins the drawing when the run ends: the real figure is there, whole."""
    import fedgalore
    from fedgalore_testing.runs import tiny_cfg

    res = fedgalore.run(tiny_cfg(tmp_path, rounds=1))
    png = (res.run_dir / "partition.png").read_bytes()
    assert png[:8] == PNG and len(png) > 1000
    assert res.run_dir / "partition.png" not in pf._DRAWING  # nothing of this run left to wait for


def test_a_finished_drawing_leaves_no_entry_behind(tmp_path):
    """A drawing that succeeds removes itself: a Federation that is built but never run (tests,
    a refused start) leaves nothing in the module's table."""
    pf.write_partition_files(REC, tmp_path, background=True)
    with pf._DRAWING_LOCK:
        job = pf._DRAWING.get(tmp_path / "partition.png")
    if job is not None:
        job.thread.join()
    assert tmp_path / "partition.png" not in pf._DRAWING
    assert (tmp_path / "partition.png").read_bytes()[:8] == PNG
