"""Client data partitioning: which training examples each client holds.

The split itself is done by a registered partitioner, one per module
(:mod:`fedgalore.federated.partitioners`: ``iid``, ``dirichlet`` — the paper's label skew,
Appendix I — ``natural``, ``pathological``, ``shards``, ``quantity``). This module holds what is
common to every kind:

* :class:`PartitionConfig` — ``federation.partition`` of a config: the kind and every kind's
  options (each kind reads its own; the rest keep their defaults), and ``by``, the categorical
  column a split runs over instead of the task's label (the paper's MetaMathQA ``type``);
* :func:`make_partition` — the kind's split of one value per example;
* :func:`parse_setting` / :meth:`PartitionConfig.label` — setting strings (``iid``,
  ``dirichlet:0.5``, ``natural:site``, ``pathological:2``, ``shards:2``, ``quantity:0.5``,
  ``quantity:power1``, any of them ``@COL`` for ``by: COL``) used in run names and by
  ``fedgalore compare --settings``;
* :func:`label_histograms` — the realised per-client category counts;
* :func:`encode_partition` / :func:`decode_partition` — a partition to other processes (Ray
  actors, Flower SuperNodes) as one safetensors blob, so every process trains on the server's
  exact index arrays.

Every partition is a list of 1-D ``int64`` index arrays, one per client, that are disjoint and
together cover ``range(N)``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedgalore.federated.partitioners import (
    PartitionError,
    Partitioner,
    available_partitioners,
    dirichlet_partition,
    iid_partition,
    partitioner_class,
)
from fedgalore.federated.partitioners.base import as_values, categories, check_int, check_positive, infers_clients

__all__ = [
    "PartitionError",
    "PartitionConfig",
    "iid_partition",
    "dirichlet_partition",
    "label_histograms",
    "make_partition",
    "parse_setting",
    "available_partitioners",
    "encode_partition",
    "decode_partition",
]


def label_histograms(
    labels: np.ndarray, parts: Sequence[np.ndarray]
) -> tuple[np.ndarray, list[Any]]:
    """Per-client label counts ``H[j, k] = |{i in parts[j] : y_i = class_k}|``.

    Classes are the sorted unique values of ``labels`` (all of them, also those absent from the
    parts). Returns ``(H, classes)`` with ``H`` of shape ``[clients, classes]`` (``int64``) and
    ``classes`` a list of the class values (Python scalars).
    """
    arr = as_values(labels)
    classes, codes = categories(arr)
    hist = np.zeros((len(parts), classes.size), dtype=np.int64)
    for j, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        hist[j] = np.bincount(codes[part], minlength=classes.size)
    return hist, classes.tolist()


@dataclass(frozen=True)
class PartitionConfig:
    """How the clients' data are split (``federation.partition`` of a config).

    ``kind`` names a registered partitioner (:func:`available_partitioners`); each kind reads the
    fields it lists (:attr:`~fedgalore.federated.partitioners.Partitioner.fields`) and ignores the
    others, which keep their defaults.
    """

    #: iid | dirichlet | natural | files | pathological | shards | quantity | nodes (docs/data.md, "Partitions")
    kind: str = "iid"
    #: dirichlet: label concentration (smaller = more skewed); quantity: size concentration
    alpha: float = 0.5
    #: dirichlet: redraw until every client holds at least this many examples; quantity: every client's floor
    min_size: int = 10
    #: dirichlet: redraws before giving up with an error
    max_retries: int = 100
    #: dirichlet: NIID-Bench balancing cap (a client at its fair share N/M takes no more of a class)
    balance: bool = True
    #: natural: the column whose distinct values are the clients (a site, a user)
    column: str | None = None
    #: the categorical column the split runs over (and partition.json counts) instead of the label
    by: str | None = None
    #: pathological: classes each client holds
    classes_per_client: int = 2
    #: pathological: how classes are given to clients
    class_assignment: Literal["first-deterministic", "deterministic", "random"] = "first-deterministic"
    #: shards: shards (blocks of the class-sorted data) each client gets
    shards_per_client: int = 2
    #: quantity: client sizes from a Dirichlet draw (alpha) or a power law (power)
    size_skew: Literal["dirichlet", "power"] = "dirichlet"
    #: quantity with size_skew=power: client j holds a share proportional to (j+1)^power
    power: float = 1.0
    #: natural / files: a site (client) with fewer training examples than this is dropped, one line each
    #: naming it (0: keep every site); its examples are not trained on
    min_client_size: int = 0

    def __post_init__(self) -> None:
        partitioner_class(self.kind)  # a registered kind (the error lists them)
        check_positive("alpha", self.alpha)
        check_int("min_size", self.min_size, 0)
        check_int("max_retries", self.max_retries, 1)
        check_int("classes_per_client", self.classes_per_client, 1)
        check_int("shards_per_client", self.shards_per_client, 1)
        check_int("min_client_size", self.min_client_size, 0)
        if self.min_client_size and (not infers_clients(self.kind) or partitioner_class(self.kind).deployment_only):
            raise PartitionError(f"min_client_size drops small sites of kinds natural and files (clients the data names); "
                                 f"kind {self.kind} draws its clients: use its own size options (dirichlet, quantity: min_size)")
        if not (isinstance(self.power, (int, float)) and math.isfinite(self.power) and self.power >= 0):
            raise PartitionError(f"power must be a finite number >= 0, got {self.power!r}")
        for key in ("column", "by"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v.strip() or "@" in v):
                raise PartitionError(f"{key} must be a column name, got {v!r}")
        if self.kind == "natural" and self.column is None:
            raise PartitionError("kind natural needs the column whose values are the clients, "
                                 "e.g. federation.partition.column=site")

    def partitioner(self) -> Partitioner:
        """The registered partitioner of :attr:`kind`, reading these options."""
        return partitioner_class(self.kind)(self)

    def options(self) -> dict[str, Any]:
        """The fields this kind reads (and ``by`` and ``min_client_size``, when set): what
        ``partition.json`` records."""
        return (self.partitioner().options() | ({"by": self.by} if self.by is not None else {})
                | ({"min_client_size": self.min_client_size} if self.min_client_size else {}))

    def setting_fields(self) -> dict[str, Any]:
        """The fields the setting string :meth:`label` names (kind, its parameter, ``by``): what a
        ``fedgalore compare`` cell sets on the base config's partition (its other fields stay)."""
        part = self.partitioner()
        named = part.parse_setting(part.setting())  # the fields the string names; their exact values
        return {"kind": self.kind, **{k: getattr(self, k) for k in named}} | ({"by": self.by} if self.by is not None else {})

    def label(self) -> str:
        """Canonical setting string, the inverse of :func:`parse_setting` (module doc)."""
        param = self.partitioner().setting()
        return self.kind + (f":{param}" if param else "") + (f"@{self.by}" if self.by is not None else "")


def make_partition(
    labels: np.ndarray, num_clients: int | None, cfg: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """Partition ``range(len(labels))`` over ``num_clients`` clients as ``cfg`` says.

    ``labels``: one value per example of the column the kind splits by (the category, or for
    ``natural`` the client column). IID: :func:`iid_partition`; Dirichlet:
    :func:`dirichlet_partition` (Appendix I, ``p ~ Dir(alpha · 1)`` per class); the other kinds:
    their partitioner (:mod:`fedgalore.federated.partitioners`). ``num_clients`` None: inferred
    by kinds that can (``natural``).
    """
    arr = as_values(labels)
    if num_clients is None and not infers_clients(cfg.kind):
        raise PartitionError(f"kind {cfg.kind} needs federation.num_clients (only kinds natural and files infer it)")
    return cfg.partitioner().split(arr, num_clients, seed)


_DIRICHLET = re.compile(r"^(?:dirichlet|dir)\s*[:=]?\s*(.+)$")


def parse_setting(s: str) -> PartitionConfig:
    """Parse a setting string (case-insensitive kind): ``iid``, ``dirichlet:0.5`` (or ``dir0.5``,
    ``dirichlet=0.5``), ``natural:COL``, ``pathological:C``, ``shards:S``, ``quantity:ALPHA``,
    ``quantity:powerP``, ``files``, ``nodes``, each optionally ``@COL`` (``by: COL``). Other fields keep their
    :class:`PartitionConfig` defaults; :meth:`PartitionConfig.setting_fields` is what it set."""
    if not isinstance(s, str):
        raise PartitionError(f"partition setting must be a string, got {s!r}")
    text, _, by = s.strip().partition("@")
    kind, sep, param = text.strip().partition(":")
    kind = kind.strip().lower()
    fields_: dict[str, Any] | None = None
    if kind in available_partitioners() and (sep or not partitioner_class(kind).fields):
        fields_ = partitioner_class(kind).parse_setting(param.strip())
    else:
        match = _DIRICHLET.match(text.strip().lower())
        if match:
            try:
                fields_, kind = {"alpha": float(match.group(1))}, "dirichlet"
            except ValueError:
                pass
    if fields_ is None:
        raise PartitionError(
            f"unknown partition setting {s!r}; expected 'iid', 'dirichlet:<alpha>' or 'dir<alpha>' (e.g. "
            "'dirichlet:0.5', 'dir0.1'), 'natural:<column>', 'pathological:<classes>', 'shards:<per client>', "
            "'quantity:<alpha>' or 'quantity:power<p>', 'files', 'nodes', optionally followed by '@<column>' (split by that column)"
        )
    if by.strip():
        fields_["by"] = by.strip()
    floats = {k: float(v) for k, v in fields_.items() if isinstance(getattr(PartitionConfig, k, None), float)}
    try:
        return PartitionConfig(kind=kind, **(fields_ | floats))
    except PartitionError as exc:  # a value out of range: the setting string says which
        raise PartitionError(f"partition setting {s!r}: {exc}") from None


def encode_partition(parts: Sequence[np.ndarray]) -> bytes:
    """Client index arrays as one safetensors blob (int64, key = client id)."""
    tensors = {str(i): torch.from_numpy(np.ascontiguousarray(p, dtype=np.int64)) for i, p in enumerate(parts)}
    return st_save(tensors, metadata={"num_clients": str(len(parts))})


def decode_partition(blob: bytes) -> list[np.ndarray]:
    """Inverse of :func:`encode_partition`."""
    tensors = st_load(blob)
    return [tensors[str(i)].numpy() for i in range(len(tensors))]
