"""Sites with different budgets: ``federation.site_ranks``, a rank per site.

A federation is rarely uniform: a site with an 80 GB GPU and a site with a laptop GPU should not
train at one rank. ``federation.site_ranks`` gives each site (client id ``0 … M−1``, or the site's
name where the partition names its clients: :mod:`fedgalore.federated.sites`) its own rank;
the method decides what the rank means and how uploads of different ranks combine
(:meth:`fedgalore.methods.base.Method.site_ranks_problem` refuses a method that cannot):

* FedGaLore (and its presets): the rank of the client's GaLore projector; the update records of
  every rank add up *exactly* (docs/design.md, "A rank per site");
* FLoRA, FlexLoRA, HetLoRA: the rank of the site's LoRA adapters (their papers' heterogeneous
  settings; each module says how A combines them).

Two ways to say it (YAML)::

    federation:
      site_ranks:
        tiers:                        # sites split into contiguous groups by id, in this order
          - {rank: 2, device_gb: 8}     # device_gb (optional): the tier's device memory, for `fedgalore plan`
          - {rank: 8, share: 0.5}       # share (optional): this tier's share of the sites (default: equal)
          - {rank: 32}
        ranks: {0: 16, 7: 4}          # single sites (override their tier); a site in neither: method.rank
        # ranks: {clinic_noisy: 2, clinic_clean: 32}   # natural / files / nodes partitions: sites by name

Tier ``t`` of ``T`` holds sites ``⌊M·S_{t−1}⌋ … ⌊M·S_t⌋ − 1`` with ``S_t`` the cumulative shares
(equal shares: a third each for three tiers). Sites are numbered by the partition, whose order does
not follow the data (a Dirichlet partition draws each site's label mix at random), so contiguous
tiers are not correlated with the labels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from fedgalore.federated.sites import is_site_id, is_site_name, site_index
from fedgalore.typed import ConfigError, from_plain

__all__ = ["SiteTier", "SiteRanksConfig", "site_ranks", "site_devices"]


@dataclass
class SiteTier:
    """One tier of sites: its rank, its share of the sites and (optionally) its device memory."""

    rank: int = 8
    #: this tier's share of the sites (null: the shares left, split equally among the tiers without one)
    share: float | None = None
    #: the memory of the tier's device in GiB (``fedgalore plan`` says which tiers do not fit; null: not stated)
    device_gb: float | None = None


@dataclass
class SiteRanksConfig:
    """``federation.site_ranks`` (module doc)."""

    tiers: list[SiteTier] = field(default_factory=list)
    #: single sites' ranks (site id or name → rank), over their tier's
    ranks: dict[int | str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, (list, tuple)):
            raise ConfigError(f"federation.site_ranks.tiers must be a list of {{rank, share, device_gb}}, got {self.tiers!r}")
        self.tiers = [t if isinstance(t, SiteTier) else from_plain(SiteTier, t, f"federation.site_ranks.tiers[{i}]")
                      for i, t in enumerate(self.tiers)]
        # a map's keys from YAML are integers; from a command-line override they may be strings of digits
        self.ranks = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in dict(self.ranks).items()}
        if not self.tiers and not self.ranks:
            raise ConfigError("federation.site_ranks needs tiers (a list of {rank, share, device_gb}) or ranks "
                              "(a map site id -> rank); remove it for one rank at every site")
        for i, t in enumerate(self.tiers):
            if not isinstance(t.rank, int) or isinstance(t.rank, bool) or t.rank < 1:
                raise ConfigError(f"federation.site_ranks.tiers[{i}].rank={t.rank!r} must be a positive integer")
            if t.share is not None and not 0.0 < float(t.share) <= 1.0:
                raise ConfigError(f"federation.site_ranks.tiers[{i}].share={t.share!r} must be in (0, 1]")
            if t.device_gb is not None and not float(t.device_gb) > 0:
                raise ConfigError(f"federation.site_ranks.tiers[{i}].device_gb={t.device_gb!r} must be > 0")
        given = sum(float(t.share) for t in self.tiers if t.share is not None)
        if given > 1.0 + 1e-9:
            raise ConfigError(f"federation.site_ranks: the tiers' shares add up to {given:g} > 1; make them sum to at most 1")
        if self.tiers and all(t.share is not None for t in self.tiers) and abs(given - 1.0) > 1e-6:
            raise ConfigError(f"federation.site_ranks: the tiers' shares add up to {given:g}; make them sum to 1 "
                              "(or leave one tier's share out: it takes the rest)")
        for site, rank in self.ranks.items():
            if not (is_site_id(site) or is_site_name(site)):
                raise ConfigError(f"federation.site_ranks.ranks: site {site!r} must be a client id (an integer >= 0) "
                                  "or a site's name (natural, files and nodes partitions: fedgalore partition lists them)")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
                raise ConfigError(f"federation.site_ranks.ranks[{site}]={rank!r} must be a positive integer")

    @property
    def named(self) -> bool:
        """Whether :attr:`ranks` names a site by name (resolved by :meth:`with_ids` once the data is split)."""
        return any(is_site_name(k) for k in self.ranks)

    def with_ids(self, names: Sequence[str] | None, num_clients: int) -> "SiteRanksConfig":
        """This setting with every site in :attr:`ranks` as its client id (``names``: the
        partition's client names, None where it names none); a site that does not exist is a
        :class:`ConfigError` listing the sites with their ids."""
        ids = {site_index(k, names, num_clients, "federation.site_ranks.ranks"): v for k, v in self.ranks.items()}
        return SiteRanksConfig(list(self.tiers), ids)

    def tier_bounds(self, num_clients: int) -> list[tuple[int, int]]:
        """``[(first, end), …]``: the sites of each tier (module doc)."""
        known = sum(float(t.share) for t in self.tiers if t.share is not None)
        free = [t for t in self.tiers if t.share is None]
        rest = (1.0 - known) / len(free) if free else 0.0
        out, cum = [], 0.0
        for i, t in enumerate(self.tiers):
            start = int(num_clients * cum + 1e-9)
            cum += float(t.share) if t.share is not None else rest
            end = num_clients if i == len(self.tiers) - 1 else int(num_clients * cum + 1e-9)
            out.append((start, end))
        return out


def site_ranks(cfg: SiteRanksConfig | None, num_clients: int, default: int,
               names: Sequence[str] | None = None) -> list[int] | None:
    """Each site's rank (``None`` when ``cfg`` is None: every site at ``default``, the method's rank).
    A tier with no site (more tiers than sites) is an error, and so is a site id ≥ ``num_clients``
    or a name not among ``names`` (the partition's client names: :mod:`fedgalore.federated.sites`)."""
    if cfg is None:
        return None
    cfg = cfg.with_ids(names, num_clients)
    ranks = [int(default)] * int(num_clients)
    for i, (t, (start, end)) in enumerate(zip(cfg.tiers, cfg.tier_bounds(num_clients))):
        if end <= start:
            raise ConfigError(f"federation.site_ranks.tiers[{i}] holds no site of the {num_clients} (its share is too "
                              "small); give it a larger share or remove it")
        for c in range(start, end):
            ranks[c] = int(t.rank)
    for site, rank in cfg.ranks.items():
        ranks[site] = int(rank)
    return ranks


def site_devices(cfg: SiteRanksConfig | None, num_clients: int) -> list[float | None]:
    """Each site's stated device memory in GiB (its tier's ``device_gb``; None where not stated)."""
    if cfg is None or not cfg.tiers:
        return [None] * int(num_clients)
    out: list[float | None] = [None] * int(num_clients)
    for t, (start, end) in zip(cfg.tiers, cfg.tier_bounds(num_clients)):
        for c in range(start, end):
            out[c] = None if t.device_gb is None else float(t.device_gb)
    return out


def distinct(ranks: Sequence[int] | None) -> list[int]:
    """The ranks present, ascending (empty for ``None``)."""
    return sorted(set(ranks or []))
