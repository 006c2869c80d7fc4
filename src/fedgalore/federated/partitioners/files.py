"""``files``: one client per site of per-site data (``task.options.data: {sites: {NAME: FILE}}``).

A federation whose members each hold their own files is rehearsed on one machine by naming every
site's files in the task (:mod:`fedgalore.tasks.generic.data`, "Sites") and setting
``federation.partition.kind: files``: client ``j`` holds exactly the training rows of the ``j``-th
site in sorted name order, in file order — the natural partition
(:mod:`fedgalore.federated.partitioners.natural`) over the ``site`` column the per-site data
carries. ``federation.num_clients`` is inferred. Each site's own test rows are its federated
evaluation set (:mod:`fedgalore.engine.client_eval`), so a Flower deployment in which every
SuperNode reads only its own files (examples/flower/README.md) gives the same metrics.
"""
from __future__ import annotations

import numpy as np

from fedgalore.federated.partitioners.base import PartitionError, as_values, categories, register
from fedgalore.federated.partitioners.natural import NaturalPartitioner, natural_partition

__all__ = ["FilesPartitioner", "SITE_COLUMN"]

#: the column per-site data adds (fedgalore.tasks.generic.data.SITE_COLUMN; not imported: partitioners know no tasks)
SITE_COLUMN = "site"


@register
class FilesPartitioner(NaturalPartitioner):
    """:class:`NaturalPartitioner` over the ``site`` column of per-site data; no options."""

    kind = "files"
    fields = ()
    seeded = False
    example = "files"

    def column(self) -> str | None:
        return SITE_COLUMN

    @classmethod
    def parse_setting(cls, param: str) -> dict:
        return super(NaturalPartitioner, cls).parse_setting(param)

    def setting(self) -> str:
        return ""

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        """One part per site (sorted by name); the count checks say "sites", not "column values"."""
        sites = categories(as_values(values))[0].tolist()
        if len(sites) < 2:
            raise PartitionError(f"task.options.data.sites names one site with training rows ({', '.join(map(repr, sites))}); "
                                 "a federation needs at least 2: add sites, or split one data set with kind iid / dirichlet")
        if num_partitions is not None and num_partitions != len(sites):
            shown = ", ".join(map(str, sites[:5])) + (", ..." if len(sites) > 5 else "")
            raise PartitionError(f"federation.num_clients={num_partitions}, but task.options.data.sites names {len(sites)} "
                                 f"sites ({shown}): kind files has one client per site; leave federation.num_clients out "
                                 f"(or null), or set it to {len(sites)}")
        return natural_partition(values, SITE_COLUMN)[0]
