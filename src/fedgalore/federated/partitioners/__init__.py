"""Partitioners, one per module behind one small interface (:mod:`.base`), in a registry:

* ``iid`` (:mod:`.iid`) — shuffle and cut into near-equal shards;
* ``dirichlet`` (:mod:`.dirichlet`) — the paper's label skew (Appendix I, NIID-Bench, ``min_size``);
* ``natural`` (:mod:`.natural`) — one client per distinct value of a column (a site, a user);
* ``files`` (:mod:`.files`) — one client per site of per-site data files (``data: {sites: ...}``);
* ``pathological`` (:mod:`.pathological`) — ``classes_per_client`` classes per client;
* ``shards`` (:mod:`.shards`) — sorted by class, ``shards_per_client`` random shards per client;
* ``quantity`` (:mod:`.quantity`) — skewed client sizes (Dirichlet or power law), labels IID;
* ``nodes`` (:mod:`.nodes`) — a Flower deployment's SuperNodes, each with its own data (nothing to split).

flwr-datasets' partitioners are the reference for ``natural``, ``pathological``, ``shards`` and
``quantity`` (``size_skew: power``): the same seed gives their assignment (tested where the package
is installed). They are re-implemented on index arrays rather than called, because flwr-datasets
0.6 requires ``datasets < 5`` (this project runs ``datasets`` 5) and works on ``datasets.Dataset``
objects, and because some of them drop examples (a class no client draws, an incomplete shard),
which a federation must not do silently.
"""
# registered in this order (the order `fedgalore partition` and errors list the kinds in)
from fedgalore.federated.partitioners import iid, dirichlet, natural, files, pathological, shards, quantity, nodes  # noqa: F401,I001
from fedgalore.federated.partitioners.base import (
    PartitionError,
    Partitioner,
    available_partitioners,
    infers_clients,
    partitioner_class,
    register,
)
from fedgalore.federated.partitioners.dirichlet import dirichlet_partition
from fedgalore.federated.partitioners.iid import iid_partition
from fedgalore.federated.partitioners.natural import natural_partition
from fedgalore.federated.partitioners.pathological import pathological_partition
from fedgalore.federated.partitioners.quantity import quantity_partition
from fedgalore.federated.partitioners.shards import shard_partition

__all__ = ["PartitionError", "Partitioner", "register", "partitioner_class", "available_partitioners", "infers_clients",
           "iid_partition", "dirichlet_partition", "natural_partition", "pathological_partition", "shard_partition",
           "quantity_partition"]
