"""The partitioner interface and registry (one partitioner per module, as flwr-datasets does).

A partitioner turns one value per training example (a category: the label, a task type, a
site) into clients: ``split(values, num_partitions, seed)`` returns one 1-D ``int64`` index array
per client, disjoint and together covering ``range(len(values))`` — every example in exactly one
client — and is a pure function of its arguments (a local ``numpy.random.Generator`` built from
``seed``; nothing global is touched). ``tests/federated/test_partition_kinds.py`` checks that contract for
every registered kind. A kind is registered with :func:`register` under its ``kind`` name, which
is ``federation.partition.kind`` in a config (:class:`fedgalore.federated.partition.PartitionConfig`
holds every kind's options; each kind reads the fields it lists in :attr:`Partitioner.fields`).
"""
from __future__ import annotations

import abc
import math
from typing import Any, ClassVar

import numpy as np

__all__ = ["PartitionError", "Partitioner", "register", "partitioner_class", "available_partitioners", "infers_clients"]


class PartitionError(ValueError):
    """A partition was requested with invalid arguments or could not be drawn."""


class Partitioner(abc.ABC):
    """Splits examples into clients by one value per example (module doc)."""

    #: the registry name: ``federation.partition.kind``
    kind: ClassVar[str] = ""
    #: the :class:`PartitionConfig` fields this kind reads (the first one names the setting, e.g.
    #: ``dirichlet:0.5``); they are recorded as the options in ``partition.json``
    fields: ClassVar[tuple[str, ...]] = ()
    #: whether the split depends on the seed (False: the data alone decides, e.g. ``natural``)
    seeded: ClassVar[bool] = True
    #: a setting string of this kind (shown when one lacks its parameter)
    example: ClassVar[str] = ""
    #: whether the data decides the number of clients (``natural``, ``files``: one per value)
    infers_clients: ClassVar[bool] = False
    #: whether the kind only describes a deployment whose nodes hold the data (``nodes``: no split here)
    deployment_only: ClassVar[bool] = False

    def __init__(self, cfg: Any) -> None:
        #: the :class:`~fedgalore.federated.partition.PartitionConfig` (it imports this package,
        #: so it is not imported here); the partitioner reads its :attr:`fields`
        self.cfg = cfg

    def column(self) -> str | None:
        """The column whose values :meth:`split` takes (None: the task's category, its label)."""
        return self.cfg.by

    @abc.abstractmethod
    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        """Disjoint ``int64`` index arrays covering ``range(len(values))``, one per client.
        ``num_partitions`` is ``federation.num_clients`` (None: the kind infers it)."""

    def options(self) -> dict[str, Any]:
        """The options this split used (``partition.json``): the :attr:`fields`."""
        return {k: getattr(self.cfg, k) for k in self.fields}

    def names(self, values: np.ndarray) -> list[str] | None:
        """The clients' names when the data names them (``natural``), else None (ids)."""
        return None

    def setting(self) -> str:
        """The setting string's parameter (``0.5`` in ``dirichlet:0.5``); '' when none."""
        return _fmt(getattr(self.cfg, self.fields[0])) if self.fields else ""

    @classmethod
    def parse_setting(cls, param: str) -> dict[str, Any]:
        """The config fields a setting string's parameter sets (inverse of :meth:`setting`)."""
        if not cls.fields:
            if param:
                raise PartitionError(f"partition setting {cls.kind!r} takes no parameter, got {param!r}")
            return {}
        if not param:
            raise PartitionError(f"partition setting {cls.kind!r} needs its {cls.fields[0]}, e.g. {cls.example}")
        return {cls.fields[0]: _parse_value(param)}


_REGISTRY: dict[str, type[Partitioner]] = {}


def register(cls: type[Partitioner]) -> type[Partitioner]:
    """Class decorator: make ``cls`` available as ``federation.partition.kind: <cls.kind>``."""
    if not cls.kind:
        raise TypeError(f"{cls.__name__} needs a kind name")
    _REGISTRY[cls.kind] = cls
    return cls


def available_partitioners() -> list[str]:
    """The registered kinds, in registration order (iid, dirichlet, natural, ...)."""
    return list(_REGISTRY)


def infers_clients(kind: str) -> bool:
    """Whether partition kind ``kind`` takes its number of clients from the data (``federation.
    num_clients`` left out); False for an unknown kind (its own check reports it)."""
    cls = _REGISTRY.get(kind)
    return bool(cls is not None and cls.infers_clients)


def partitioner_class(kind: str) -> type[Partitioner]:
    """The partitioner registered as ``kind``; :class:`PartitionError` listing the kinds otherwise."""
    try:
        return _REGISTRY[kind]
    except (KeyError, TypeError):
        raise PartitionError(f"kind must be one of {', '.join(available_partitioners())}, got {kind!r}") from None


# ----------------------------------------------------------------------------- shared checks
def check_int(name: str, value: Any, lo: int) -> int:
    """``value`` as an int ``>= lo``; :class:`PartitionError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise PartitionError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def check_clients(num_clients: Any, n: int) -> int:
    """``num_clients`` checked against the ``n`` examples (every client needs one)."""
    m = check_int("num_clients", num_clients, 1)
    if m > n:
        raise PartitionError(
            f"num_clients={m} exceeds the number of examples N={n}; every client needs at "
            "least one example"
        )
    return m


def check_positive(name: str, value: Any) -> float:
    """``value`` as a finite float ``> 0``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not math.isfinite(v) or v <= 0:
        raise PartitionError(f"{name} must be finite and > 0, got {value!r}")
    return v


def as_values(values: Any) -> np.ndarray:
    """``values`` as a non-empty 1-D array."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise PartitionError("labels is empty; nothing to partition")
    return arr


def categories(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique values and the category code (index into them) of every example."""
    try:
        classes, codes = np.unique(values, return_inverse=True)
    except TypeError as exc:  # e.g. an object array mixing str and int
        raise PartitionError(
            f"labels must be mutually comparable (one type, e.g. all int or all str): {exc}"
        ) from exc
    return classes, codes.reshape(-1)


def shuffle_each(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle every client's index array in place (client order, then within each), returning them."""
    for part in parts:
        rng.shuffle(part)
    return parts


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _parse_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

