"""``nodes``: each Flower SuperNode is one client with the data it holds (a real federation).

In a deployment the server never sees a row: every SuperNode is started with its own files in its
node config (``--node-config "data='site3/train.csv' test-data='site3/test.csv' site='site3'"``,
examples/flower/README.md) and ``federation.partition.kind: nodes`` says that the clients are the
nodes that joined — client ``j`` is the ``j``-th site in sorted name order, ``federation.
num_clients`` is their number and the aggregation weights are the example counts they report. So
there is nothing to split here: :meth:`NodesPartitioner.split` refuses, and a run outside the
Flower app is refused with what to use instead (``kind: files`` rehearses the same federation on
one machine from the same per-site files, with the same metrics).
"""
from __future__ import annotations

import numpy as np

from fedgalore.federated.partitioners.base import PartitionError, Partitioner, register

__all__ = ["NodesPartitioner", "NODES_ONLY"]

NODES_ONLY = ("federation.partition.kind=nodes means each Flower SuperNode brings its own data, so it runs with the "
              "Flower app only (examples/flower/README.md); to rehearse the same federation on one machine, name the "
              "sites' files in task.options.data: {sites: {NAME: FILE, ...}} and use federation.partition.kind=files")


@register
class NodesPartitioner(Partitioner):
    """The clients are the Flower SuperNodes that joined, with their own data (module doc)."""

    kind = "nodes"
    fields = ()
    seeded = False
    example = "nodes"
    infers_clients = True
    #: the split happens where the data is: on the nodes, never on the server
    deployment_only = True

    def column(self) -> str | None:
        return None

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        raise PartitionError(NODES_ONLY)
