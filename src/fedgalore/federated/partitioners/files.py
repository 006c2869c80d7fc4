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

from fedgalore.federated.partitioners.base import register
from fedgalore.federated.partitioners.natural import NaturalPartitioner

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
        return super().split(values, num_partitions, seed)
