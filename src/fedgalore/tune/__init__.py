"""``fedgalore tune``: choose each method's learning rate (and any other config key) on the
federation's own validation data, confirm the choice on seeds the search did not see, and say
which method to run at what cost (docs/cli.md, "tune").

* :mod:`fedgalore.tune.space` — what is searched (``--space KEY=SPEC``; default: the rate);
* :mod:`fedgalore.tune.search` — one Optuna study per row, trials pruned along the round axis,
  stored in SQLite in the output folder (resumes after a kill; ``--storage`` and ``--workers``);
* :mod:`fedgalore.tune.confirm` — the held-out seeds at the full budget, paired by seed;
* :mod:`fedgalore.tune.report` — the recommendation with its costs, tables and plots;
* :func:`tune` — all of it, in order (the Python API behind the command).
"""
from fedgalore.tune.run import privacy_ledgers, tune
from fedgalore.tune.search import TuneSpec

__all__ = ["tune", "TuneSpec", "privacy_ledgers"]
