"""A run's records: the run directory and what it says about the run.

* :mod:`~fedgalore.records.rundir` — the run directory's files (config, metrics, ledger,
  diagnostics, summary) and the choice of a directory;
* :mod:`~fedgalore.records.identity` — a run's identity (resolved config, input fingerprints),
  compared before a run directory is reused, and the base model it names;
* :mod:`~fedgalore.records.liveness` — its lock, heartbeat and state (``fedgalore status``).

Checkpoints themselves are written by :mod:`fedgalore.federated.checkpoint`.
"""
