"""Ray backend: same seed → same results as the sequential backend; a dying worker is replaced."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import fedgalore  # noqa: E402
from fedgalore.job.config import FederatedConfig  # noqa: E402

CRASH_PLUGIN = '''
import os
import time
from dataclasses import dataclass
from fedgalore.methods.base import option, register
from fedgalore.methods.fedavg_full import FedAvgFull, FedAvgFullOptions


@dataclass(frozen=True)
class CrashingOptions(FedAvgFullOptions):
    crash_client: int = option(-1, "client whose worker process dies in round 0")
    hang_client: int = option(-1, "client that hangs in round 0")


@register
class CrashingFedAvg(FedAvgFull):
    """FedAvg-Full whose client ``crash_client`` kills its worker process in round 0 and whose
    client ``hang_client`` hangs in round 0."""

    name = "test_crash_fedavg"
    options_class = CrashingOptions

    def client_update(self, model, broadcast, ctx):
        if ctx.round == 0 and ctx.client == self.options.crash_client:
            os._exit(1)
        if ctx.round == 0 and ctx.client == self.options.hang_client:
            time.sleep(600)
        return super().client_update(model, broadcast, ctx)
'''


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def cfg(tmp: Path, method: str = "fedavg_full", backend: dict | None = None, method_options: dict | None = None,
        train: dict | None = None) -> FederatedConfig:
    return FederatedConfig.from_dict({
        "name": "t",
        "seed": 0,
        "task": {"name": "tiny_text", "options": {"n_train": 120, "n_test": 48}},
        "method": {"name": method, "rank": 4, "options": method_options or {}},
        "federation": {"num_clients": 6, "clients_per_round": 3, "rounds": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, **(train or {})},
        "backend": backend or {"name": "sequential", "options": {}},
        "output": {"dir": str(tmp), "progress": "quiet"},
    })


def close(a, b, rel=1e-4, abs_=1e-6):
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def test_ray_reproduces_sequential(tmp_path, ray_cluster):
    """FedGaLore (seeded projectors + AJIVE sync): 2 rounds, 3 of 6 clients, 2 workers."""
    method, opts = "fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    seq = fedgalore.run(cfg(tmp_path / "seq", method, method_options=opts))
    par = fedgalore.run(cfg(tmp_path / "ray", method, {"name": "ray", "options": {"num_workers": 2}}, opts))
    assert len(seq.history) == len(par.history) == 2
    for a, b in zip(seq.history, par.history):
        assert a["clients"] == b["clients"] and b["dropped"] == []
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for k in ("train_loss", "eval/accuracy", "eval/loss"):
            assert close(a[k], b[k]), (k, a[k], b[k])


def test_ray_workers_with_sharded_sites_reproduce_sequential(tmp_path, ray_cluster):
    """Two Ray workers, each training its clients on two sharded processes (issue 43: the actor owns
    its site's helpers and its own default group): the sequential one-process run's numbers."""
    method, opts = "fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    seq = fedgalore.run(cfg(tmp_path / "seq", method, method_options=opts))
    par = fedgalore.run(cfg(tmp_path / "ray", method, {"name": "ray", "options": {"num_workers": 2}}, opts,
                            train={"devices_per_client": 2, "shard_params": True}))
    for a, b in zip(seq.history, par.history):
        assert a["clients"] == b["clients"] and b["dropped"] == []
        for k in ("train_loss", "eval/accuracy", "eval/loss"):
            assert close(a[k], b[k]), (k, a[k], b[k])


def test_backend_counts_boundary_bytes_and_returns_job_order(tmp_path, ray_cluster):
    from fedgalore.engine.backends.ray import RayBackend
    from fedgalore.engine.runtime import ClientJob, Runtime
    from fedgalore.federated.seeding import round_seed
    from fedgalore.protocol.payload import encode
    from fedgalore.protocol.state import RoundContext

    c = cfg(tmp_path)
    rt = Runtime(c)
    backend = RayBackend(num_workers=2, num_cpus=0.5)
    try:
        backend.start(rt)
        state = rt.method.init_server_state(rt.model)
        clients = [4, 0, 2]
        blob = encode(rt.method.broadcast(state, RoundContext(0, 2, round_seed(0, 0), clients, [1 / 3] * 3)))
        jobs = [ClientJob(0, 2, cl, round_seed(0, 0)) for cl in clients]
        res = backend.run_clients(blob, jobs)
        assert [r.client for r in res] == clients and all(r.error is None for r in res)
        b = backend.last_round_bytes
        assert b["broadcast"] == len(blob) and b["broadcast_puts"] == 1
        assert b["uploads"] == sum(len(r.upload) for r in res)
        # the worker's upload is byte-identical to training the client in this process
        assert rt.execute(jobs[1], blob).upload == res[1].upload
        assert all(rss > 0 for rss in backend.worker_rss())
    finally:
        backend.close()
    assert ray.is_initialized()  # a Ray we did not start is left running


def test_killed_or_hung_worker_is_replaced_and_client_dropped(tmp_path, ray_cluster):
    plugin = tmp_path / "crash_plugin.py"
    plugin.write_text(CRASH_PLUGIN)
    c = cfg(tmp_path, "test_crash_fedavg",
            {"name": "ray", "options": {"num_workers": 2, "timeout_s": 30, "plugins": [str(plugin)]}})
    from fedgalore.federated.seeding import sample_clients

    victim, hung = sample_clients(0, 0, 6, 3)[1:3]
    c.method.options.update(crash_client=victim, hang_client=hung)
    import importlib.util

    spec = importlib.util.spec_from_file_location("crash_plugin_driver", plugin)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # register in the driver too
    res = fedgalore.run(c)
    h = res.history
    assert res.summary["status"] == "finished" and len(h) == 2
    assert h[0]["dropped"] == [victim, hung] and h[1]["dropped"] == []
    errors = [json.loads(x) for x in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    errors = {r["client"]: r["error"] for r in errors if r["round"] == 1 and "error" in r}
    assert "worker died" in errors[victim] and "timed out" in errors[hung]
    assert math.isfinite(h[1]["eval/loss"])
