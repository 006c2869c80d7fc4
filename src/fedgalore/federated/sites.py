"""A site named in the config: by its client id, or by the name the data gives it.

The per-site settings (``federation.site_ranks.ranks``, ``federation.attack.clients``) name sites.
A site is its client id ``0 … M−1`` (an integer), or — where the partition names its clients
(``natural``: the column's values; ``files`` / ``nodes``: the sites' names) — its name, as
``fedgalore partition`` lists them: ``ranks: {clinic_noisy: 2, clinic_clean: 32}``. The names
are resolved to ids once the data is split (:func:`fedgalore.job.clients.resolve_clients`), so
every process after that (Ray actors, Flower nodes, a resumed run's ``config.yaml``) sees ids.

An integer (or a string of digits, as a command-line override gives it) is always an id, also
where a natural partition's column holds numbers (client ``j`` holds the ``j``-th smallest value).
"""
from __future__ import annotations

from typing import Any, Sequence

from fedgalore.typed import ConfigError

__all__ = ["is_site_id", "is_site_name", "site_index", "site_list"]


def is_site_id(key: Any) -> bool:
    """Whether ``key`` is a client id: an integer ``>= 0`` (not a bool)."""
    return isinstance(key, int) and not isinstance(key, bool) and key >= 0


def is_site_name(key: Any) -> bool:
    """Whether ``key`` names a site by name: a non-empty string that is not all digits."""
    return isinstance(key, str) and bool(key.strip()) and not key.isdigit()


def site_list(names: Sequence[str] | None, num_clients: int, limit: int = 12) -> str:
    """``clinic_blur=0, clinic_clean=1, …``: the sites' names with their ids (``0..M-1`` when the
    partition names none), for a message."""
    if names is None:
        return f"ids 0..{int(num_clients) - 1}"
    shown = ", ".join(f"{n}={j}" for j, n in enumerate(names[:limit]))
    return shown + (f", ... ({len(names)} sites)" if len(names) > limit else "")


def site_index(key: Any, names: Sequence[str] | None, num_clients: int, option: str) -> int:
    """The client id of the site ``key`` names in the setting ``option`` (module doc): an id below
    ``num_clients``, or one of ``names`` (the partition's client names; None: it names none). A
    site that does not exist is a :class:`ConfigError` listing the sites with their ids."""
    if isinstance(key, str) and key.isdigit():
        key = int(key)
    if is_site_id(key):
        if key >= num_clients:
            raise ConfigError(f"{option}: site {key} does not exist (the partition has {num_clients} clients); "
                              f"use {site_list(names, num_clients)}")
        return int(key)
    if not is_site_name(key):
        raise ConfigError(f"{option}: site {key!r} must be a client id (an integer >= 0) or a site's name")
    if names is None:
        raise ConfigError(f"{option}: site {key!r} is a name, but this partition names no sites (only natural, files "
                          f"and nodes partitions do); use client ids 0..{int(num_clients) - 1}")
    if key not in names:
        raise ConfigError(f"{option}: no site named {key!r}; the sites and their ids: {site_list(names, num_clients)}")
    return list(names).index(key)
