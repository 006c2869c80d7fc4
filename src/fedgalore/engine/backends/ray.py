"""Ray backend: clients run in parallel on a small pool of long-lived Ray actors.

One actor per concurrent client slot (``num_workers``), each reserving ``num_cpus`` CPUs and
``num_gpus`` GPUs (both may be fractional, e.g. ``num_gpus=0.25`` packs four workers on a GPU).
Each actor builds its own :class:`~fedgalore.engine.runtime.Runtime` ONCE — task, frozen base
model, method, and the server's partition index arrays (sent, so partitions are identical) — from
the resolved config (``cfg.to_dict()`` as JSON). Per round only bytes cross process boundaries:

* the serialised broadcast, put in the object store once per round (``ray.put``) and read by
  every worker from there (shared memory on one node; one transfer per node in a cluster);
* each client's serialised upload, returned to the driver.

Nothing is pickled by us: the config travels as JSON, the partition and payloads as safetensors
bytes (Ray pickles only the actor class, i.e. code). ``last_round_bytes`` records what crossed
the boundaries in the last round so it can be compared with the ledger.

Scheduling is a tiny pool of our own: jobs go to free actors, results are collected with
``ray.wait``; a client whose actor dies (crash, OOM, ``os._exit``) or exceeds ``timeout_s`` gets
a :class:`ClientResult` with an error (the server drops it), and its actor is killed and
replaced. Results come back in job order. Streaming per-step progress is not available from
actors; ``client_start``/``client_end`` events are.

Actors rebuild methods and tasks by name from the config, so a method or task defined outside
the package must be registered in each worker: list its module (or a ``.py`` path) in
``plugins``. Objects passed to ``Federation(task=..., method=...)`` are not sent to workers.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

import ray
import torch

from fedgalore.engine.backends.base import Backend
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.events import ProgressSink
from fedgalore.engine.runtime import ClientJob, ClientResult, Runtime
from fedgalore.federated.partition import decode_partition, encode_partition

__all__ = ["RayBackend"]

log = logging.getLogger("fedgalore")


def _load_plugins(plugins: Sequence[str]) -> None:
    """Import modules (dotted names or ``.py`` paths) that register custom methods/tasks."""
    for i, spec in enumerate(plugins):
        if spec.endswith(".py"):
            path = Path(spec).resolve()
            name = f"fedgalore_plugin_{i}_{path.stem}"
            if name in sys.modules:
                continue
            mod_spec = importlib.util.spec_from_file_location(name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ImportError(f"cannot import plugin {spec}")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
        else:
            importlib.import_module(spec)


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class ClientWorker:
    """A Ray actor holding one Runtime (built once); runs T for one client per call."""

    def __init__(self, cfg_json: str, parts_blob: bytes, num_threads: int, plugins: Sequence[str] = ()) -> None:
        torch.set_num_threads(max(1, int(num_threads)))
        _load_plugins(plugins)
        cfg = FederatedConfig.from_dict(json.loads(cfg_json))
        self.runtime = Runtime(cfg, parts=decode_partition(parts_blob))

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rss": _rss_bytes(), "threads": torch.get_num_threads()}

    def rss(self) -> int:
        return _rss_bytes()

    def execute(self, job: dict[str, int], broadcast: bytes) -> tuple[int, bytes | None, str | None, float, str, str]:
        res = self.runtime.execute(ClientJob(**job), bytes(broadcast))
        return res.client, res.upload, res.error, res.time, json.dumps(res.stats, default=float), res.origin


class RayBackend(Backend):
    """Run the clients of a round in parallel on ``num_workers`` Ray actors.

    The actors start in :meth:`start`, with the server's runtime (its config and partition are
    sent to every worker).

    Args:
        num_workers: actors = clients trained concurrently.
        num_cpus / num_gpus: resources reserved per actor (fractional allowed). Each actor sets
            torch's intra-op threads to ``max(1, floor(num_cpus))``.
        timeout_s: a client still running after this many seconds is dropped and its actor
            replaced (None: no limit).
        address: Ray cluster address (``"auto"`` or ``"ray://host:10001"``); None starts a local
            Ray (or reuses one already initialised in this process).
        plugins: modules or ``.py`` files imported in each worker before its runtime is built
            (for methods/tasks registered outside the package).
    """

    name = "ray"

    def __init__(
        self,
        num_workers: int = 2,
        num_cpus: float = 1,
        num_gpus: float = 0,
        timeout_s: float | None = None,
        address: str | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        if int(num_workers) < 1:
            raise ConfigError("backend.options.num_workers must be >= 1")
        if float(num_cpus) < 0 or float(num_gpus) < 0:
            raise ConfigError("backend.options.num_cpus and num_gpus must be >= 0 (fractions allowed)")
        if timeout_s is not None and float(timeout_s) <= 0:
            raise ConfigError("backend.options.timeout_s must be > 0 or null")
        self.num_workers = int(num_workers)
        self.num_cpus, self.num_gpus = float(num_cpus), float(num_gpus)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.address = address
        self.plugins = [str(p) for p in plugins]
        self._started_ray = False
        self._actors: list[Any] = []
        self._starting: dict[Any, int] = {}  # readiness ref of a replaced actor -> slot
        self.restarts = 0
        self.last_round_bytes: dict[str, int] = {}
        self.round_bytes: list[dict[str, int]] = []

    def start(self, runtime: Runtime) -> None:
        """Start Ray (unless this process has one) and the actors, each building its runtime."""
        cfg = runtime.cfg.to_dict()
        if str(cfg["device"]).startswith("cuda"):
            if self.num_gpus <= 0:
                raise ConfigError(
                    f"device={cfg['device']} with backend ray needs backend.options.num_gpus > 0 "
                    "(a fraction such as 0.5 shares one GPU between workers)"
                )
            cfg["device"] = "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU
        self.runtime = runtime
        self._cfg_json = json.dumps(cfg)
        self._parts_blob = encode_partition(runtime.parts)
        if not ray.is_initialized():
            init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.WARNING}
            if self.address is not None:
                init["address"] = self.address
            else:  # a local Ray: enough logical CPUs for every worker (oversubscribing is the user's call)
                init["num_cpus"] = max(os.cpu_count() or 1, math.ceil(self.num_workers * self.num_cpus))
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(**init)
            self._started_ray = True
        self._actors = [self._spawn() for _ in range(self.num_workers)]
        try:  # surface config/model errors now, as one exception, instead of per client
            self.worker_info = ray.get([a.ready.remote() for a in self._actors])
        except Exception:
            self.close()
            raise

    # ------------------------------------------------------------------ actors
    def _spawn(self):
        actor_cls = ray.remote(ClientWorker).options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=1
        )
        threads = max(1, int(self.num_cpus))
        return actor_cls.remote(self._cfg_json, self._parts_blob, threads, self.plugins)

    def _replace(self, slot: int):
        """Kill the actor in ``slot`` and start a new one; returns its readiness ref (the slot
        takes jobs again once the new actor has built its runtime)."""
        try:
            ray.kill(self._actors[slot], no_restart=True)
        except Exception:  # already dead
            pass
        self._actors[slot] = self._spawn()
        self.restarts += 1
        return self._actors[slot].ready.remote()

    def worker_rss(self) -> list[int]:
        """Resident memory (bytes) of each worker process now."""
        return ray.get([a.rss.remote() for a in self._actors])

    # ------------------------------------------------------------------ rounds
    def run_clients(self, broadcast: bytes | dict[int, bytes], jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        results: list[ClientResult | None] = [None] * len(jobs)
        # once per round (every worker reads it from the object store), or once per client for a
        # per-client downlink (SCAFFOLD's c − c_i)
        per_client = isinstance(broadcast, dict)
        bref = {c: ray.put(b) for c, b in broadcast.items()} if per_client else ray.put(broadcast)
        queue = deque(range(len(jobs)))
        free = deque(range(len(self._actors)))
        pending: dict[Any, tuple[int, int, float]] = {}  # ref -> (slot, job index, start time)
        starting: dict[Any, int] = dict(self._starting)  # readiness ref of a replaced actor -> slot
        self._starting = {}
        free = deque(i for i in free if i not in starting.values())

        def finish(i: int, res: ClientResult) -> None:
            results[i] = res
            if progress is not None:
                progress.client_end(jobs[i].round, jobs[i].client, {"time": res.time, "error": res.error, **res.stats})

        while pending or (queue and (free or starting)):
            while queue and free:
                slot, i = free.popleft(), queue.popleft()
                job = jobs[i]
                if progress is not None:
                    progress.client_start(job.round, job.client, self.runtime.batches(job.client, job.round)[1])
                job_d = {"round": job.round, "total_rounds": job.total_rounds, "client": job.client, "round_seed": job.round_seed}
                ref_i = bref[job.client] if per_client else bref
                pending[self._actors[slot].execute.remote(job_d, ref_i)] = (slot, i, time.monotonic())
            wait_s = None
            if self.timeout_s is not None and pending:
                wait_s = max(0.0, min(t0 + self.timeout_s for _, _, t0 in pending.values()) - time.monotonic())
            ready, _ = ray.wait(list(pending) + list(starting), num_returns=1, timeout=wait_s)
            for ref in ready:
                if ref in starting:  # a replacement actor finished building its runtime
                    slot = starting.pop(ref)
                    try:
                        ray.get(ref)
                        free.append(slot)
                    except Exception as exc:  # it cannot even start: leave the slot empty
                        log.warning("ray backend: replacement worker %d failed to start: %s", slot, exc)
                    continue
                slot, i, t0 = pending.pop(ref)
                try:
                    client, upload, error, took, stats, origin = ray.get(ref)
                    # the site's time where the server view lets it leave, else the server's own clock (for the timeout)
                    res = ClientResult(client, upload, error, took or time.monotonic() - t0, json.loads(stats), origin=origin)
                    free.append(slot)
                except Exception as exc:  # the actor died (crash, OOM, os._exit): replace it
                    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    res = ClientResult(jobs[i].client, None, f"worker died: {type(exc).__name__}: {msg}", time.monotonic() - t0)
                    starting[self._replace(slot)] = slot
                finish(i, res)
            if self.timeout_s is not None:
                now = time.monotonic()
                for ref, (slot, i, t0) in list(pending.items()):
                    if now - t0 >= self.timeout_s:
                        pending.pop(ref)
                        starting[self._replace(slot)] = slot
                        finish(i, ClientResult(jobs[i].client, None, f"timed out after {self.timeout_s:g}s (worker restarted)", now - t0))
        for i in queue:  # left only when no worker could be started at all
            finish(i, ClientResult(jobs[i].client, None, "no Ray worker available"))
        self._starting.update(starting)  # replacements still starting: ready for the next round
        uploads = sum(len(r.upload) for r in results if r is not None and r.upload is not None)
        sent = sum(len(b) for b in broadcast.values()) if per_client else len(broadcast)
        self.last_round_bytes = {
            "broadcast": sent,
            "broadcast_puts": len(broadcast) if per_client else 1,
            "uploads": int(uploads),
            "total": sent + int(uploads),
        }
        self.round_bytes.append(dict(self.last_round_bytes))
        return [r for r in results if r is not None]

    def close(self) -> None:
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self._actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False
