"""The site's own policy where a client trains (:meth:`fedgalore.engine.runtime.Runtime.execute`,
the one place every backend — sequential, Ray, Flower — runs a client; the policy and ledger
themselves: :mod:`fedgalore.privacy.site`).

:func:`admit` turns the job into the releases this client-round will make (:func:`releases`:
its level, the noise multiplier the site counts, its clip; DP-SGD's σ, q and steps) and asks the
site's guard before anything trains; a refusal is the site's one line (``SiteRefusal``: it quotes
no data, so the server records it as it is, at every level), also printed in the site's own log
(stderr), and the round goes on without it. :meth:`SiteTurn.record` writes the
releases as run to the site's ledger, fsynced, before the upload is encoded and leaves.

Whose guard: a Flower SuperNode brings its own (node config ``privacy-policy`` /
``privacy-ledger``, fedgalore.flower.client_app) with each job. A simulation models its sites
(:class:`SimulatedSites`): ``privacy.sites_dir: DIR`` gives every site the folder ``DIR/<site>``
— its policy ``fedgalore-policy.yaml`` when there is one, and its ledger
``fedgalore-ledger.jsonl`` always (folders created with the first line) —; without it, a site of per-site data (``partition.kind:
files``) that has a ``fedgalore-policy.yaml`` beside its training data keeps its ledger there.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.privacy.site import LEDGER_FILE, POLICY_FILE, Release, SiteGuard, SiteLedger, SiteRefusal, load_policy

__all__ = ["SimulatedSites", "SiteTurn", "admit", "releases", "node_guard", "run_key"]


def run_key(cfg: FederatedConfig) -> str:
    """The key a simulated run's releases carry in a site's ledger: a hash of its config (a Flower
    node uses the job's own key)."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def releases(runtime: Any, client: int, broadcast: Any) -> list[Release]:
    """What client ``client`` will release this round, per level (fedgalore.privacy.site module doc)."""
    cfg = runtime.cfg
    out: list[Release] = []
    record = runtime.stages.get("record_dp")
    if record is not None:
        sch = record.sites.schedule(int(client))
        out.append(Release("record", float(sch.noise_multiplier), f"privacy.record, σ over {sch.steps_per_round} steps at q = "
                           f"{sch.sample_rate:.3g}", float(cfg.privacy.record.max_grad_norm), float(sch.sample_rate),
                           int(sch.steps_per_round)))
    cdp = runtime.stages.get("client_dp")
    if cdp is not None:
        from fedgalore.engine.stages.client_dp import ROUND_CLIP

        rel = cdp.mechanism
        meta = getattr(broadcast, "meta", {}) or {}
        clip = float(meta.get(ROUND_CLIP, rel.client.clip))
        if rel.client.noise == "central":
            out.append(Release("client_central", rel.round_multiplier(rel.sample),
                               f"privacy.client.noise_multiplier={rel.sigma:.4g} on the sum, added by the server", clip))
        else:
            level = "client_distributed_secagg" if cfg.federation.secure_aggregation is not None else "client_distributed"
            share = f"{rel.sigma:.4g}/√{rel.sample}" if rel.mean and rel.sample > 1 else f"{rel.sigma:.4g}"
            out.append(Release(level, rel.upload_multiplier(), f"this site's own share of the noise, σ = {share}", clip))
    return out or [Release("none", 0.0, "no privacy in the job")]


def _as_run(planned: Sequence[Release], meta: Mapping[str, Any]) -> list[Release]:
    """The releases as run: DP-SGD's own record of the round (its σ, q and steps) when the upload has it."""
    out = []
    for r in planned:
        if r.level == "record" and isinstance(meta.get("dp_steps"), (int, float)):
            r = Release("record", float(meta.get("dp_noise_multiplier", r.noise_multiplier)), r.how, r.clip,
                        float(meta.get("dp_sample_rate", r.sample_rate)), int(meta["dp_steps"]))
        out.append(r)
    return out


class SiteTurn:
    """One admitted client-round: :meth:`record` writes its releases before the upload leaves."""

    def __init__(self, guard: SiteGuard, planned: list[Release], run: str, job: str | None, round_idx: int) -> None:
        self.guard, self.planned, self.run, self.job, self.round = guard, planned, run, job, round_idx

    def record(self, upload: Any) -> None:
        """The releases as run in the site's ledger (fsynced); a budget passed meanwhile (another
        run of this site) is the site's one-line refusal, and nothing leaves."""
        try:
            self.guard.record(_as_run(self.planned, getattr(upload, "meta", {}) or {}), self.run, self.job, self.round)
        except SiteRefusal as exc:
            _say(str(exc))
            raise


def _say(line: str) -> None:
    print(f"fedgalore: {line}", file=sys.stderr, flush=True)  # the site's own log


def admit(runtime: Any, job: Any, broadcast: Any, guard: SiteGuard | None) -> SiteTurn | None:
    """Ask the site before it trains (module doc): None without a guard; a refusal is a
    :class:`~fedgalore.privacy.view.SiteRefusal` (one line; the runtime returns it as the site's own
    decision, which the server records as it is)."""
    if guard is None:
        return None
    planned = releases(runtime, job.client, broadcast)
    try:
        guard.admit(planned)
    except SiteRefusal as exc:
        _say(str(exc))
        raise
    key = getattr(runtime, "run_key", None) or run_key(runtime.cfg)
    return SiteTurn(guard, planned, key, runtime.cfg.name, job.round)


def _guard(name: str, folder: Path, policy: Path | None, ledger: Path | None = None) -> SiteGuard:
    pol = load_policy(policy) if policy is not None else None
    return SiteGuard(name, pol, SiteLedger(ledger or folder / LEDGER_FILE), policy)


def node_guard(node_config: Mapping[str, Any], name: str) -> SiteGuard | None:
    """A Flower node's guard from its node config (``privacy-policy``, ``privacy-ledger``; by
    default a ``fedgalore-policy.yaml`` beside its ``data``), or None when it has neither."""
    policy = str(node_config.get("privacy-policy", "") or "").strip()
    ledger = str(node_config.get("privacy-ledger", "") or "").strip()
    data = str(node_config.get("data", "") or "").strip()
    pol = Path(policy).expanduser() if policy else None
    if pol is None and data and (Path(data).expanduser().parent / POLICY_FILE).is_file():
        pol = Path(data).expanduser().parent / POLICY_FILE
    if pol is not None and not pol.is_file():
        raise ConfigError(f"node config privacy-policy={policy!r}: no such file")
    if pol is None and not ledger:
        return None
    folder = pol.parent if pol is not None else Path(ledger).expanduser().parent
    return _guard(name, folder, pol, Path(ledger).expanduser() if ledger else None)


class SimulatedSites:
    """The guards of a simulation's sites (module doc), read once when the runtime is built."""

    def __init__(self, guards: dict[int, SiteGuard]) -> None:
        self.guards = guards

    @classmethod
    def build(cls, cfg: FederatedConfig, names: Sequence[str]) -> "SimulatedSites | None":
        """From ``privacy.sites_dir``, else policies beside per-site data; None when no site has one."""
        out: dict[int, SiteGuard] = {}
        root = cfg.privacy.sites_dir
        if root:
            base = Path(root).expanduser()  # created with the first ledger line
            for i, name in enumerate(names):
                if not name or "/" in name or name in (".", ".."):
                    raise ConfigError(f"privacy.sites_dir: site {name!r} cannot name a folder; rename the site")
                folder = base / name
                pol = folder / POLICY_FILE
                out[i] = _guard(name, folder, pol if pol.is_file() else None)
        elif cfg.federation.partition.kind == "files":
            from fedgalore.tasks.generic.data import site_sources

            sites = site_sources(cfg.task.options.get("data")) or {}
            for i, name in enumerate(names):
                one = sites.get(name)
                train = one.get("train") if isinstance(one, Mapping) else one
                if not isinstance(train, str):
                    continue
                folder = Path(train).expanduser().parent
                if (folder / POLICY_FILE).is_file():
                    out[i] = _guard(name, folder, folder / POLICY_FILE)
        return cls(out) if out else None

    def guard(self, client: int) -> SiteGuard | None:
        """Client ``client``'s guard (None: the site keeps no policy here)."""
        return self.guards.get(int(client))
