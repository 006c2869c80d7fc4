"""The default backend: clients run one after another in this process on one shared model.

Memory is one model plus one client's optimizer state: each client's ``client_update`` loads the
broadcast into the shared model, trains, and returns its upload; nothing else is kept.
"""
from __future__ import annotations

from fedgalore.engine.backends.base import Backend
from fedgalore.engine.events import ProgressSink
from fedgalore.engine.runtime import ClientJob, ClientResult


class SequentialBackend(Backend):
    name = "sequential"

    def run_clients(self, broadcast: bytes, jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        results = []
        for job in jobs:
            gen, steps = self.runtime.batches(job.client, job.round)
            if progress is not None:
                progress.client_start(job.round, job.client, steps)
                on_step = lambda t, loss, j=job, s=steps: progress.client_step(j.round, j.client, t, s, loss)  # noqa: E731
            else:
                on_step = None
            res = self.runtime.execute(job, broadcast, on_step=on_step)
            if progress is not None:
                progress.client_end(job.round, job.client, {"time": res.time, "error": res.error, **res.stats})
            results.append(res)
        return results
