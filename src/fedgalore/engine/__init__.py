"""The engine: a config becomes a run (the round loop above methods, tasks and backends).

* :mod:`~fedgalore.engine.config` — the typed run configuration and its YAML loader;
* :mod:`~fedgalore.engine.resolve` — what a config means on this machine (the method's own
  options, the device);
* :mod:`~fedgalore.engine.runtime` — what one process needs to run clients (task, model,
  method, partition);
* :mod:`~fedgalore.engine.clients` — the run's clients: partition, validation and per-client
  hold-outs, names; :mod:`~fedgalore.engine.partition_files` — ``partition.json`` /
  ``partition.png`` and ``fedgalore partition``; :mod:`~fedgalore.engine.client_eval` — per-client
  evaluation;
* :mod:`~fedgalore.engine.backends` — where clients train (sequential, Ray; Flower in
  :mod:`fedgalore.flower`);
* :mod:`~fedgalore.engine.validation` — server-side checks of client uploads;
* :mod:`~fedgalore.engine.loop` — :class:`~fedgalore.engine.loop.Federation`, the round loop;
* :mod:`~fedgalore.engine.rundir` — the run directory's files; :mod:`~fedgalore.engine.liveness` —
  its lock, heartbeat and state (``fedgalore status``);
* :mod:`~fedgalore.engine.identity` — a run's identity (resolved config, input fingerprints),
  compared before a run directory is reused;
* :mod:`~fedgalore.engine.api` — ``run`` and ``resume``;
* :mod:`~fedgalore.engine.events` — progress events the loop emits.
"""
