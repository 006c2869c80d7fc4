"""The job a config describes, before anything runs: the typed run configuration, what it means on
this machine, and the clients it splits the data into.

* :mod:`~fedgalore.job.config` — the typed run configuration and its YAML loader;
* :mod:`~fedgalore.job.resolve` — what a config means on this machine (the method's own options,
  the device);
* :mod:`~fedgalore.job.clients` — the run's clients: partition, validation and per-client
  hold-outs, names;
* :mod:`~fedgalore.job.partition_files` — ``partition.json`` / ``partition.png`` and
  ``fedgalore partition``.
"""
