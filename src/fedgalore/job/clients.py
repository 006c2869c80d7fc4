"""The run's clients: which training examples each one trains on, holds out, and what it is called.

:func:`split_clients` is the one place a config's data split is made — the round loop's
:class:`~fedgalore.engine.runtime.Runtime` and ``fedgalore partition`` (which draws the split
without training) both call it, so the preview is the run's split. In order:

1. the *category* of every training example: the column ``federation.partition.by`` names
   (:meth:`~fedgalore.tasks.base.Task.partition_values`), or the task's label / category;
2. ``federation.validation_fraction``: a validation pool held out from every client, stratified
   by category (:func:`~fedgalore.tasks.base.stratified_split`, seed
   :func:`~fedgalore.federated.seeding.validation_seed`);
3. the partition of the rest (:func:`~fedgalore.federated.partition.make_partition`) over the
   categories — or, for ``natural``, over the client column; with
   ``federation.partition.min_client_size`` (``natural``, ``files``) a site holding fewer training
   examples is dropped — one logged line each, naming it — and its examples are trained by nobody
   (:func:`drop_small_clients`);
4. ``federation.client_eval``: each client's share split into its training part and a held-out
   part of ``federation.client_test_fraction``, stratified by category within the client (seed
   :func:`~fedgalore.federated.seeding.client_test_seed` and the client id). With per-site data
   (``partition.kind: files``) nothing is held out: each site's own test rows are its evaluation
   set (``test_split`` True), always — what a deployment's sites evaluate on.

:func:`resolve_clients` fills ``federation.num_clients`` in when the partition infers it
(``natural``) and checks the participation settings against the real count.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.federated.partition import make_partition
from fedgalore.federated.partitioners import infers_clients
from fedgalore.federated.partitioners.nodes import NODES_ONLY
from fedgalore.federated.seeding import client_test_seed, validation_seed
from fedgalore.federated.sites import is_site_name, site_index
from fedgalore.tasks.base import Task, TaskError, stratified_split

__all__ = ["Clients", "split_clients", "resolve_clients", "site_ids", "drop_small_clients"]

log = logging.getLogger(__name__)
_SAID: set[str] = set()


@dataclass
class Clients:
    """The split of a task's training set (indices into ``task.train_set()``)."""

    #: each client's training examples
    parts: list[np.ndarray]
    #: the examples held out from every client (``federation.validation_fraction``)
    validation_idx: np.ndarray
    #: one category per training example (``federation.partition.by``, else the label)
    categories: np.ndarray
    #: the clients' names when the data names them (``natural``: the column's values), else None
    names: list[str] | None = None
    #: each client's held-out examples (``federation.client_eval``), else None
    test_parts: list[np.ndarray] | None = None
    #: whether ``test_parts`` index the task's test set (per-site data) rather than its training set
    test_split: bool = False
    #: the sites ``federation.partition.min_client_size`` dropped: ``(name, training examples)``
    dropped: list[tuple[str, int]] = field(default_factory=list)

    def name(self, client: int) -> str:
        """Client ``client``'s name (its id as a string when the data names none)."""
        return self.names[client] if self.names is not None else str(client)


def _column(task: Task, column: str | None, n: int) -> np.ndarray:
    values = np.asarray(task.partition_values(column))
    if values.shape != (n,):
        what = f"column {column!r}" if column is not None else "partition_labels()"
        raise TaskError(f"task {task.name!r}: {what} has shape {values.shape}, expected one value per training "
                        f"example ({n})")
    return values


def split_clients(cfg: FederatedConfig, task: Task, parts: Sequence[np.ndarray] | None = None) -> Clients:
    """The clients of ``cfg`` on ``task`` (module doc). ``parts``: the server's training parts,
    given to a worker process (Ray actor, Flower node), which then only recomputes the validation
    pool (no partition, no held-out parts, no names)."""
    fed, pcfg = cfg.federation, cfg.federation.partition
    n = len(task.train_set())
    if parts is None and pcfg.partitioner().deployment_only:
        raise ConfigError(NODES_ONLY)
    if parts is None and n == 0:
        raise ConfigError(f"task {task.name!r} has no training rows: set task.options.data (a file, or {{train: FILE, test: FILE}}); "
                          "only the server of a Flower deployment with federation.partition.kind=nodes runs without them")
    cats = _column(task, pcfg.by, n)
    pool, validation = np.arange(n), np.zeros(0, dtype=np.int64)
    if fed.validation_fraction > 0:
        if task.validation_set() is not None:
            raise ConfigError("the task has its own validation split (task.options.data.validation); "
                              "leave federation.validation_fraction at 0")
        rng = np.random.default_rng(validation_seed(cfg.seed))
        pool, validation = stratified_split(cats, fed.validation_fraction, rng)
    if parts is not None:
        return Clients([np.asarray(p) for p in parts], validation, cats)
    partitioner = pcfg.partitioner()
    if pcfg.kind == "files" and not getattr(task, "sites", None):
        raise ConfigError(f"federation.partition.kind=files needs per-site data, task.options.data: {{sites: {{NAME: FILE, ...}}}} "
                          f"(task {task.name!r} has none); or partition by a column with kind natural")
    col = partitioner.column()
    values = cats if col == pcfg.by else _column(task, col, n)
    # with min_client_size the count is checked after the small sites are dropped (a saved config.yaml records that count)
    count = None if pcfg.min_client_size else fed.num_clients
    parts = [pool[p] for p in make_partition(values[pool], count, pcfg, cfg.seed)]
    clients = Clients(parts, validation, cats, partitioner.names(values[pool]))
    if pcfg.min_client_size:
        drop_small_clients(cfg, clients)
    if pcfg.kind == "files":
        _site_tests(task, clients)
    elif fed.client_eval:
        _hold_out(cfg, clients)
    if infers_clients(pcfg.kind):
        _check_batches(cfg, clients)
    return clients


def drop_small_clients(cfg: FederatedConfig, clients: Clients) -> None:
    """Drop the clients (sites) with fewer training examples than ``federation.partition.
    min_client_size`` from ``clients`` (in place; ``clients.dropped`` lists them), logging one line
    per site, once per process. Fewer than two sites left, or a ``federation.num_clients`` other
    than the number kept, is a :class:`ConfigError`."""
    pcfg, fed = cfg.federation.partition, cfg.federation
    n_min = pcfg.min_client_size
    keep = [j for j, p in enumerate(clients.parts) if len(p) >= n_min]
    dropped = [(clients.name(j), int(len(p))) for j, p in enumerate(clients.parts) if len(p) < n_min]
    units = "sites" if pcfg.kind == "files" else f"{pcfg.column} values"
    if len(keep) < 2:
        raise ConfigError(f"federation.partition.min_client_size={n_min} leaves {len(keep)} of {len(clients.parts)} {units} "
                          f"(the largest holds {max(len(p) for p in clients.parts)} training examples); a federation needs 2: "
                          "lower min_client_size")
    if fed.num_clients is not None and fed.num_clients != len(keep):
        raise ConfigError(f"federation.num_clients={fed.num_clients}, but the partition has {len(keep)} {units} with at least "
                          f"federation.partition.min_client_size={n_min} training examples ({len(dropped)} dropped); leave "
                          f"num_clients out (null): the partition infers it")
    for name, k in dropped:
        line = (f"federation.partition.min_client_size={n_min}: dropped {'site' if pcfg.kind == 'files' else pcfg.column} "
                f"{name!r} ({k} training examples); its examples are not trained on")
        if line not in _SAID:
            _SAID.add(line)
            log.warning(line)
    clients.parts = [clients.parts[j] for j in keep]
    if clients.names is not None:
        clients.names = [clients.names[j] for j in keep]
    clients.dropped = dropped


def _hold_out(cfg: FederatedConfig, clients: Clients) -> None:
    """Split each client's share into training and held-out parts (stratified by category)."""
    f = cfg.federation.client_test_fraction
    train, test = [], []
    for j, part in enumerate(clients.parts):
        rng = np.random.default_rng(client_test_seed(cfg.seed, j))
        kept, held = stratified_split(clients.categories[part], f, rng)
        if len(held) == 0 or len(kept) == 0:
            which = "no example" if len(held) == 0 else "every example"
            raise ConfigError(
                f"federation.client_test_fraction={f:g} holds out {which} of client {clients.name(j)!r} "
                f"({len(part)} examples); use a client_test_fraction that leaves both parts non-empty, or fewer, "
                "larger clients"
            )
        train.append(part[kept])
        test.append(part[held])
    clients.parts, clients.test_parts = train, test


def _site_tests(task: Task, clients: Clients) -> None:
    """Each site's evaluation set: its own rows of the task's test set (per-site data)."""
    sites = np.asarray(task.partition_values("site", split="test"))
    clients.test_parts = [np.flatnonzero(sites == name).astype(np.int64) for name in clients.names or []]
    clients.test_split = True
    empty = [n for n, p in zip(clients.names or [], clients.test_parts) if len(p) == 0]
    if empty:
        raise ConfigError(f"site(s) {', '.join(map(repr, empty))} have no test rows; give each site a test file or "
                          "enough training rows for task.options.test_fraction")


def _partition_words(pcfg) -> tuple[str, str]:
    """How messages name a partition that infers its clients, and its clients' units."""
    if pcfg.kind == "files":
        return "the files partition (one client per site)", "sites"
    if pcfg.kind == "nodes":
        return "the SuperNodes that joined", "nodes"
    return f"the natural partition over {pcfg.column!r}", f"{pcfg.column} values"


def _check_batches(cfg: FederatedConfig, clients: Clients) -> None:
    """A natural (or per-site) client must hold at least one batch: name the small ones and what to do."""
    b = cfg.train.batch_size
    small = [(clients.name(j), len(p)) for j, p in enumerate(clients.parts) if len(p) < b]
    if small:
        what, units = _partition_words(cfg.federation.partition)
        shown = ", ".join(f"{name!r} ({k})" for name, k in small[:3]) + (f" and {len(small) - 3} more" if len(small) > 3 else "")
        smallest = min(k for _, k in small)
        held = " after the client_test_fraction hold-out" if cfg.federation.client_eval and not clients.test_split else ""
        need = math.ceil(b / (1 - cfg.federation.client_test_fraction)) if held else b
        raise ConfigError(
            f"{what[0].upper()}{what[1:]}: client(s) {shown} hold fewer training examples{held} than one batch "
            f"(train.batch_size={b}); set train.batch_size<={smallest}, or merge or drop those {units} in the data "
            f"(federation.partition.min_client_size: {need} drops the ones smaller than that)"
        )


def resolve_clients(cfg: FederatedConfig, clients: Clients) -> FederatedConfig:
    """``cfg`` with ``federation.num_clients`` set to the partition's client count when it was
    left to the partition (``natural``), after checking ``clients_per_round`` against that count,
    and the sites the per-site settings name by name checked to exist (a name the data does not
    hold is one line listing the sites with their ids). A copy where anything changes — ``cfg`` is
    not changed. The names stay names (what the run records and is identified by);
    :func:`site_ids` gives the config the round runs with."""
    site_ids(cfg, clients)
    fed = cfg.federation
    m = len(clients.parts)
    if fed.num_clients is not None:
        return cfg
    if fed.clients_per_round is not None and fed.clients_per_round > m:
        raise ConfigError(
            f"federation.clients_per_round={fed.clients_per_round} exceeds the {m} clients of "
            f"{_partition_words(fed.partition)[0]}; set federation.clients_per_round<={m}, or null for all of them"
        )
    out = copy.deepcopy(cfg)
    out.federation.num_clients = m
    return out.validate()


def site_ids(cfg: FederatedConfig, clients: Clients) -> FederatedConfig:
    """``cfg`` with the sites that per-site settings (``federation.site_ranks.ranks``,
    ``federation.attack.clients``) name by name replaced by their client ids
    (:mod:`fedgalore.federated.sites`; a copy when any is named): the config a run's round loop,
    Ray actors and Flower nodes run with, none of which knows the names. A name ``clients`` does
    not hold is a :class:`ConfigError` listing the sites with their ids."""
    fed, m = cfg.federation, len(clients.parts)
    ranks = fed.site_ranks is not None and fed.site_ranks.named
    attack = fed.attack is not None and any(is_site_name(c) for c in fed.attack.clients)
    if not (ranks or attack):
        return cfg
    out = copy.deepcopy(cfg)
    if ranks:
        out.federation.site_ranks = fed.site_ranks.with_ids(clients.names, m)
    if attack:
        out.federation.attack.clients = [site_index(c, clients.names, m, "federation.attack.clients")
                                         for c in fed.attack.clients]
    return out.validate()
