"""The engine: one federated run, round by round (the round loop above methods, tasks and backends).

The run's configuration is :mod:`fedgalore.job`; its directory, identity and liveness
:mod:`fedgalore.records`; what a user does with a finished run :mod:`fedgalore.trained`.

* :mod:`~fedgalore.engine.runtime` — what one process needs to run clients (task, model,
  method, partition);
* :mod:`~fedgalore.engine.backends` — where clients train (sequential, Ray; Flower in
  :mod:`fedgalore.flower`);
* :mod:`~fedgalore.engine.validation` — server-side checks of client uploads;
* :mod:`~fedgalore.engine.loop` — :class:`~fedgalore.engine.loop.Federation`, the round loop;
* :mod:`~fedgalore.engine.client_eval` — per-client evaluation;
* :mod:`~fedgalore.engine.round_adapters` — a PEFT adapter after every round;
* :mod:`~fedgalore.engine.api` — ``run`` and ``resume``;
* :mod:`~fedgalore.engine.events` — progress events the loop emits.
"""
