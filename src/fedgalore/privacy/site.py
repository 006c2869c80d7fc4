"""The site's own privacy: its policy, its ledger across runs and servers, and the guard that
applies them before it trains and before an upload leaves (docs/privacy.md, "The site's own
policy and ledger").

Every other privacy number of a run is the server's: σ, the clip and the target come in the job's
config, and the accountant (fedgalore.engine.stages.privacy_ledger) starts from zero in every run.
Here the site decides:

* :class:`SitePolicy` — what the site accepts, read from its own file (``fedgalore-policy.yaml``,
  :func:`load_policy`): a floor on the noise multiplier of every release it makes
  (``min_noise_multiplier``), a ceiling on the clip (``max_clip``: ``privacy.client``'s round clip
  and ``privacy.record.max_grad_norm``), a budget (ε, δ) and the levels it accepts (:data:`LEVELS`).
* :class:`SiteLedger` — an append-only JSON-lines file on the site's disk, one line per release,
  written, flushed and fsynced **before** the upload leaves (:meth:`SiteGuard.record`), kept
  across runs and servers; a line cut by a crash is skipped (its upload never left). Every line
  of the file counts against the budget, whatever site name it bears (a renamed site does not
  start afresh; sites that share a file share its budget).
* :class:`SiteGuard` — :meth:`~SiteGuard.admit` refuses in one line (:class:`~fedgalore.privacy.view.
  SiteRefusal`, which reaches the server as it is: it quotes no data) a job
  that asks for less than the policy or whose release would pass the budget; :meth:`~SiteGuard.
  record` checks the budget again under a file lock (another run of the same site may have
  released meanwhile) and appends.

What a release costs (:class:`Release`: its level, and the noise multiplier the site counts):

* ``record`` — the site's own DP-SGD as run: (σ, q, steps), Poisson-sampled Gaussian steps;
* ``client_distributed`` — the noise the site adds itself, as the server sees the upload
  (σ/√K on a mean method combined with the moments' σ_m: ``ClientRelease.upload_multiplier``);
* ``client_distributed_secagg`` — counted the same way, the site's own share only: the site
  cannot check that the other sites added theirs nor how many reached the sum, so it takes no
  credit for them (conservative; the server's mirror counts the sum's σ);
* ``client_central`` — the site adds nothing, the server does: the site counts the σ on the sum
  that the job *claims* (a mirror of the server's claim — accepting this level means trusting the
  server);
* ``none`` — no DP: ε = ∞ (refused under any budget).

No client-level release gets amplification credit: the site knows it was sampled.

The site's ε (:func:`spent`, at the policy's δ, by Google's dp-accounting) is kept for two
guarantees: **each row** — every release counts: DP-SGD's steps, and each client-level release as
a Gaussian of multiplier m/2 (the clipped change of the whole site bounds a row's: sensitivity 2C,
as for replacing the site), composed under add/remove-one-row adjacency; and **the site as a
whole** — the client-level releases, each a Gaussian of multiplier m under replace-one
(:func:`fedgalore.privacy.client_dp.client_epsilon` with a population of one: no subsampling).
Record-level releases bound no more than rows, so they do not count there. A release is admitted
when every guarantee it gives stays within the budget: rows always, the site as a whole for a
client-level release.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from fedgalore.privacy.view import LEVELS, SiteRefusal
from fedgalore.typed import ConfigError, from_plain

__all__ = ["LEVELS", "DP_LEVELS", "POLICY_FILE", "LEDGER_FILE", "Budget", "SitePolicy", "SiteRefusal", "Release",
           "SiteLedger", "SiteGuard", "load_policy", "epsilons", "spent"]

#: the levels with differential privacy (a policy's default ``accept``)
DP_LEVELS = LEVELS[1:]
#: the policy's file name, looked for beside the site's data
POLICY_FILE = "fedgalore-policy.yaml"
#: the ledger's file name (beside the policy unless given)
LEDGER_FILE = "fedgalore-ledger.jsonl"
#: what each level means, in the refusals
LEVEL_WORDS = {"none": "no differential privacy", "record": "record-level DP-SGD",
               "client_central": "client-level DP with the server adding the noise",
               "client_distributed": "client-level DP with distributed noise, no secure aggregation",
               "client_distributed_secagg": "client-level DP with distributed noise under secure aggregation"}


@dataclass(frozen=True)
class Budget:
    """The most the site spends over all its runs: ε at δ."""

    epsilon: float
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"budget.epsilon={self.epsilon:g} must be a positive number (e.g. 8)")
        if not (0 < self.delta < 1):
            raise ValueError(f"budget.delta={self.delta:g} must be in (0, 1) (e.g. 1e-5)")


@dataclass(frozen=True)
class SitePolicy:
    """What a site accepts (module doc). Every field is optional: an empty policy accepts any
    job with differential privacy and keeps the ledger."""

    #: the site's name in its refusals and ledger lines (default: the node's site name or client id)
    site: str | None = None
    #: the least noise multiplier of any release the site makes, as counted (module doc)
    min_noise_multiplier: float | None = None
    #: the largest clip norm the site accepts (privacy.client's round clip, privacy.record.max_grad_norm)
    max_clip: float | None = None
    #: the most ε (at δ) the site spends over all runs; None: no budget (the ledger is still kept)
    budget: Budget | None = None
    #: the levels the site accepts (:data:`LEVELS`); default every level with DP
    accept: tuple[str, ...] = DP_LEVELS

    def __post_init__(self) -> None:
        bad = [a for a in self.accept if a not in LEVELS]
        if bad or not self.accept:
            raise ValueError(f"accept={list(self.accept)!r} must list some of {', '.join(LEVELS)}")
        f = self.min_noise_multiplier
        if f is not None and not (math.isfinite(f) and f >= 0):
            raise ValueError(f"min_noise_multiplier={f:g} must be a number >= 0 (e.g. 0.8)")
        c = self.max_clip
        if c is not None and not (math.isfinite(c) and c > 0):
            raise ValueError(f"max_clip={c:g} must be a positive number (e.g. 1.0)")

    @property
    def delta(self) -> float:
        """The δ the site's ε is read at (its budget's, else 1e-5)."""
        return self.budget.delta if self.budget is not None else 1e-5


def load_policy(path: str | Path) -> SitePolicy:
    """The policy in ``path`` (YAML or JSON); any problem is one :class:`ConfigError` line naming the file."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"site policy {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"site policy {path}: not valid YAML{at}") from None
    if isinstance(data, dict) and isinstance(data.get("accept"), str):
        data = {**data, "accept": [data["accept"]]}
    try:
        return from_plain(SitePolicy, data or {}, "")
    except ConfigError as exc:
        raise ConfigError(f"site policy {path}: {str(exc).replace('config key ', 'key ')}") from None


@dataclass(frozen=True)
class Release:
    """One release a site makes in a client-round, as the site counts it (module doc).

    ``noise_multiplier``: the multiplier counted (and held against the floor); ``how``: where it
    comes from, in the job's terms (for the refusal); ``clip``: the clip norm it runs with;
    ``sample_rate`` / ``steps``: DP-SGD's q and steps (record level; 1 for a client-level upload)."""

    level: str
    noise_multiplier: float
    how: str = ""
    clip: float | None = None
    sample_rate: float = 1.0
    steps: int = 1

    def line(self) -> dict[str, Any]:
        """The ledger's fields of this release."""
        out: dict[str, Any] = {"level": self.level, "noise_multiplier": float(self.noise_multiplier)}
        if self.level == "record":
            out.update({"sample_rate": float(self.sample_rate), "steps": int(self.steps)})
        if self.clip is not None:
            out["clip"] = float(self.clip)
        return out


# ----------------------------------------------------------------------------- the accountant
def _rows_epsilon(lines: Sequence[dict[str, Any]], delta: float) -> float:
    """ε(δ) of each row over ``lines`` (module doc): dp-accounting's RDP accountant, add/remove one row."""
    if not lines:
        return 0.0
    if any(ln["level"] == "none" or float(ln["noise_multiplier"]) <= 0 for ln in lines):
        return math.inf
    import dp_accounting
    from absl import logging as absl_logging
    from dp_accounting import rdp

    groups: Counter = Counter()
    for ln in lines:
        if ln["level"] == "record":
            groups[("record", float(ln["noise_multiplier"]), float(ln["sample_rate"]))] += int(ln["steps"])
        else:  # a client-level upload: the whole site's clipped change bounds a row's (sensitivity 2C)
            groups[("client", float(ln["noise_multiplier"]) / 2.0, 1.0)] += 1
    events = []
    for (kind, sigma, q), n in groups.items():
        one = dp_accounting.GaussianDpEvent(sigma)
        if kind == "record" and q < 1.0:
            one = dp_accounting.PoissonSampledDpEvent(q, one)
        events.append(dp_accounting.SelfComposedDpEvent(one, int(n)))
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        acc.compose(dp_accounting.ComposedDpEvent(events))
        return float(acc.get_epsilon(float(delta)))
    finally:
        absl_logging.set_verbosity(verbosity)


def _site_epsilon(lines: Sequence[dict[str, Any]], delta: float) -> float:
    """ε(δ) of the site as a whole over the client-level ``lines`` (module doc; no subsampling)."""
    from fedgalore.privacy.client_dp import client_epsilon

    counts = Counter(float(ln["noise_multiplier"]) for ln in lines if ln["level"].startswith("client"))
    return client_epsilon([(m, 1, n) for m, n in counts.items()], 1, float(delta)) if counts else 0.0


def epsilons(lines: Sequence[dict[str, Any]], delta: float) -> dict[str, float]:
    """``{"rows": ε, "site": ε}`` of the releases in ``lines`` at ``delta`` (module doc)."""
    return {"rows": _rows_epsilon(lines, delta), "site": _site_epsilon(lines, delta)}


def spent(lines: Sequence[dict[str, Any]], delta: float) -> dict[str, Any]:
    """What the releases in ``lines`` cost at ``delta``: ε for each row and for the site as a whole,
    the releases per level, and per run (key, name, first and last time, releases, ε)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        runs.setdefault(str(ln.get("run", "?")), []).append(ln)
    out: dict[str, Any] = {"delta": float(delta), "releases": len(lines), **{f"epsilon_{k}": v for k, v in epsilons(lines, delta).items()},
                           "levels": dict(Counter(ln["level"] for ln in lines)), "runs": []}
    for key, rl in runs.items():
        eps = epsilons(rl, delta)
        out["runs"].append({"run": key, "name": rl[0].get("job"), "first": rl[0].get("time"), "last": rl[-1].get("time"),
                            "releases": len(rl), "levels": sorted({ln["level"] for ln in rl}),
                            "epsilon_rows": eps["rows"], "epsilon_site": eps["site"]})
    return out


# ----------------------------------------------------------------------------- the ledger
class SiteLedger:
    """The site's append-only record of its releases (module doc), one JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def lines(self) -> list[dict[str, Any]]:
        """Every release recorded; a damaged line is skipped."""
        out = []
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        for raw in text.splitlines():
            try:
                ln = json.loads(raw)
            except ValueError:  # cut by a crash while being written: its upload never left
                continue
            if isinstance(ln, dict) and ln.get("level") in LEVELS:
                out.append(ln)
        return out

    def append(self, entries: Iterable[dict[str, Any]], fh: Any = None) -> None:
        """Append ``entries`` and fsync them (the file's folder too when the file is new)."""
        text = "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries)
        own = fh is None
        new = not self.path.exists()
        if own:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+", encoding="utf-8")
        try:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:  # a line cut by a crash stays a line of its own
                fh.seek(fh.tell() - 1)
                if fh.read(1) != "\n":
                    text = "\n" + text
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            if own:
                fh.close()
        if new:
            _fsync_dir(self.path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Locked:
    """The ledger file opened for appending under an exclusive lock (POSIX ``flock``; none elsewhere)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self.fh = open(self.path, "a+", encoding="utf-8")
        if new:  # the file's name in its folder survives a crash too
            _fsync_dir(self.path.parent)
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        return self.fh

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()  # closing releases the lock


# ----------------------------------------------------------------------------- the guard
class SiteGuard:
    """A site's policy and ledger together (module doc). ``policy_path``: where the policy was
    read (None: no policy file — only the ledger is kept)."""

    def __init__(self, name: str, policy: SitePolicy | None, ledger: SiteLedger, policy_path: Path | None = None) -> None:
        self.policy = policy if policy is not None else SitePolicy(accept=LEVELS)
        self.name = self.policy.site or name
        self.ledger, self.policy_path = ledger, policy_path

    def _refuse(self, why: str) -> SiteRefusal:
        return SiteRefusal(f"site {self.name} refuses: {why}")

    def _where(self) -> str:
        return f"policy {self.policy_path}" if self.policy_path is not None else "its policy"

    def check_policy(self, releases: Sequence[Release]) -> None:
        """Raise :class:`SiteRefusal` when a release is at a level the site does not accept, carries
        less noise than its floor or runs with a clip above its ceiling."""
        p = self.policy
        for r in releases:
            if r.level not in p.accept:
                raise self._refuse(f"the job asks for {LEVEL_WORDS[r.level]} ({r.level}), which the site does not accept "
                                   f"({self._where()} accepts: {', '.join(p.accept)}); the site does not train")
        for r in releases:
            if r.level != "none" and p.min_noise_multiplier is not None and r.noise_multiplier < p.min_noise_multiplier - 1e-12:
                raise self._refuse(f"the job's {r.level} release carries noise multiplier {r.noise_multiplier:.4g}"
                                   f"{f' ({r.how})' if r.how else ''}, below the site's floor {p.min_noise_multiplier:g} "
                                   f"({self._where()}); the site does not train")
            if p.max_clip is not None and r.clip is not None and r.clip > p.max_clip * (1 + 1e-12):
                raise self._refuse(f"the job's {r.level} clip {r.clip:g} is above the site's ceiling {p.max_clip:g} "
                                   f"({self._where()}); the site does not train")

    def check_budget(self, releases: Sequence[Release], lines: Sequence[dict[str, Any]] | None = None) -> None:
        """Raise :class:`SiteRefusal` when ``releases`` would take a guarantee they give past the
        budget (module doc); ``lines``: the ledger's (read now when None)."""
        b = self.policy.budget
        if b is None:
            return
        lines = self.ledger.lines() if lines is None else lines  # every line of the site's file counts, whatever name it bears
        new = [{**r.line(), "site": self.name} for r in releases]
        before, after = epsilons(lines, b.delta), epsilons([*lines, *new], b.delta)
        kinds = (["site"] if any(r.level.startswith("client") for r in releases) else []) + ["rows"]
        for kind in kinds:
            if after[kind] > b.epsilon * (1 + 1e-9):
                what = "each row's ε" if kind == "rows" else "the ε of the site's data as a whole"
                raise self._refuse(f"this release would take {what} from {before[kind]:.4g} to {after[kind]:.4g}, past the "
                                   f"site's budget ε = {b.epsilon:g} at δ = {b.delta:g} (ledger {self.ledger.path}); "
                                   "the site does not train")

    def admit(self, releases: Sequence[Release]) -> None:
        """Before training: the policy, then the budget (:class:`SiteRefusal`, one line)."""
        self.check_policy(releases)
        self.check_budget(releases)

    def record(self, releases: Sequence[Release], run: str, job: str | None, round_idx: int) -> None:
        """Before the upload leaves: under the ledger's lock, the budget once more (another run of
        this site may have released since :meth:`admit`), then one line per release, fsynced."""
        with _Locked(self.ledger.path) as fh:
            self.check_budget(releases)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.ledger.append([{"time": stamp, "site": self.name, "run": run, "job": job, "round": int(round_idx) + 1,
                                 **r.line()} for r in releases], fh)
