"""The default backend: clients run one after another in this process on one shared model.

Memory is one model plus one client's optimizer state: each client's ``client_update`` loads the
broadcast into the shared model, trains, and returns its upload. Each client also has a store
that lasts the run (``Runtime.client_state``), in memory: empty unless the method keeps something
there (FedGaLore's ``downlink: factored`` keeps the client's copy of the adapted matrices, the
size of those matrices per client seen).
"""
from __future__ import annotations

from fedgalore.engine.backends.base import Backend
from fedgalore.engine.events import ProgressSink
from fedgalore.engine.runtime import ClientJob, ClientResult


class SequentialBackend(Backend):
    name = "sequential"

    keeps_client_state = True

    def start(self, runtime) -> None:
        super().start(runtime)
        runtime.client_state = {}  # each simulated client's own store, kept between rounds (in memory)

    def client_versions(self, method, clients):
        held = getattr(method, "held_version", None)
        return {c: None if held is None else held(self.runtime.client_state.get(c, {})) for c in clients}

    def run_clients(self, broadcast, jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        results = []
        for job in jobs:
            blob = broadcast[job.client] if isinstance(broadcast, dict) else broadcast
            gen, steps = self.runtime.batches(job.client, job.round)
            if progress is not None:
                progress.client_start(job.round, job.client, steps)
                on_step = lambda t, loss, j=job, s=steps: progress.client_step(j.round, j.client, t, s, loss)  # noqa: E731
            else:
                on_step = None
            res = self.runtime.execute(job, blob, on_step=on_step)
            if progress is not None:
                progress.client_end(job.round, job.client, {"time": res.time, "error": res.error, **res.stats})
            results.append(res)
        return results
