"""The server's view, declared once per privacy level and enforced at one choke point (docs/privacy.md
"What the server sees"; DESIGN §9 "The server's view is declared, not redacted feature by feature").

Each privacy level — ``none``, ``record`` (DP-SGD at every site), ``client_central``,
``client_distributed`` and ``client_distributed_secagg`` (DP-FedAvg with central noise, with each
client's own share, and with that share summed by Flower's SecAgg+) — has one :class:`ServerView`:

* ``upload_meta``: every metadata field that may leave a site with its upload, grouped, each group
  with the reason it is safe at this level (``None`` at level ``none``: everything leaves, and
  ``privacy.json`` says nothing was protected);
* ``upload_entries``: the tensor entries an upload may carry, by kind;
* ``server_records``: every value the server may write about one site (``clients.jsonl``, the
  console, ``summary.json``, ``metrics.jsonl``, the model card), each with its reason; and the
  switches that follow from them — a client's own error text, its time, its size, its label
  counts, its per-site evaluation, its data's paths.

Two functions apply it, and nothing else decides what crosses: :meth:`ServerView.release` at the site
(:meth:`fedgalore.engine.runtime.Runtime.execute` — the one place every backend, sequential, Ray and
Flower, runs a client — right before the upload is serialised; also a client's error text and its
time) and :meth:`ServerView.record` / :meth:`ServerView.round_record` / :meth:`ServerView.error` on the
server (:class:`fedgalore.records.rundir.RunFiles`, the collector, the Flower strategy, the model
card). A field that is not declared does not leave; a value that is not declared is not written.
``privacy.json``'s ``upload_fields`` / ``server_records`` and the threat-model table of
docs/privacy.md are generated from the declarations (:func:`threat_table`; a test compares the docs).

Under client-level DP an upload's size and every count in it are public constants of the config:
no example or step count travels, and a method whose upload's structure follows the site's step count
(FedGaLore: one update term per projector refresh, the moment view's evidence 1 − β₂^T) needs
``train.local_steps`` (fixed steps; :meth:`fedgalore.engine.stages.client_dp.ClientRelease.build`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["SiteRefusal", "LEVELS", "ServerView", "declare", "view_of", "level_of", "threat_table", "CLIENT_FAILED", "STRUCTURE_META",
           "COUNT_META", "LOSS_META", "DIAGNOSTIC_META", "RECORD_DP_PREFIX", "CLIP_BIT_META"]

class SiteRefusal(ValueError):
    """A site declines a job on its own policy (seeded noise, a σ below its floor, its budget spent): the
    one line says why and quotes no data, so it reaches the server as it is (``origin="site"``)."""


#: the privacy levels, weakest first
LEVELS = ("none", "record", "client_central", "client_distributed", "client_distributed_secagg")

#: what the server records of a client's own failure when its text may quote the site's data
CLIENT_FAILED = "the client failed (its message stays at the site)"

#: upload meta the job itself fixes: the ids the server assigned, the downlink version the client holds (the
#: server's own record of what it sent), a method's fingerprint of public frozen factors (Fed-SB)
STRUCTURE_META = ("client", "round", "held_version", "version", "frozen_sha")
#: counts computed on the site's data
COUNT_META = ("num_examples", "steps", "micro_batches")
#: raw training losses
LOSS_META = ("loss_first", "loss_last", "loss_mean")
#: the optimizer's and the client loop's diagnostics (FedGaLore's warm start and update ratios)
DIAGNOSTIC_META = ("warm_clamped", "prior_retained", "warm_kept", "warm_rescale", "view_step_share", "upload_kept",
                   "v_warm_cold_ratio", "client_update_norm_precond", "client_update_norm_cold",
                   "update_ratio_max", "update_ratio_p99", "update_ratio_above")
#: DP-SGD's schedule (σ, q, steps, C) the per-site accountant reads
RECORD_DP_PREFIX = "dp_"
#: adaptive clipping's noised bit 1[‖Δ‖ ≤ C] (inside σ)
CLIP_BIT_META = "dp_clip_bit"


@dataclass(frozen=True)
class ServerView:
    """What may leave a site and what the server may record about one, at one privacy level (module doc)."""

    level: str
    #: group of meta keys -> (keys, why it is safe); None: every field leaves (level none)
    upload_meta: Mapping[str, tuple[tuple[str, ...], str]] | None
    #: meta keys starting with one of these leave too (DP-SGD's schedule): prefix -> why
    meta_prefixes: Mapping[str, str]
    #: entry kinds -> why
    upload_entries: Mapping[str, str]
    #: value the server writes about a site -> why
    server_records: Mapping[str, str]
    client_error_text: bool
    client_time: bool
    site_size: bool
    site_labels: bool
    site_eval: bool
    site_paths: bool
    #: a method's own state kept at a site (FedSA-LoRA's local B) may be written into the server's run
    #: directory (a simulation's resume); under client-level DP it is the site's raw local model: never
    site_state: bool = True
    #: what the server sees of the uploads themselves (one line)
    sees: str = ""
    _allowed: frozenset = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        keys = set()
        for group in (self.upload_meta or {}).values():
            keys.update(group[0])
        object.__setattr__(self, "_allowed", frozenset(keys))

    # ------------------------------------------------------------------ at the site
    def allows_meta(self, key: str) -> bool:
        """Whether upload meta field ``key`` may leave the site."""
        if self.upload_meta is None:
            return True
        return key in self._allowed or any(key.startswith(p) for p in self.meta_prefixes)

    def release(self, upload: Any) -> Any:
        """The upload as it leaves the site: its meta cut to the declared fields (the entries are the
        mechanism's: clipped and noised before this, by the DP stages)."""
        if self.upload_meta is None:
            return upload
        from fedgalore.protocol.payload import Payload

        return Payload(upload.entries, {k: v for k, v in upload.meta.items() if self.allows_meta(k)})

    def client_error(self, error: str | None) -> str | None:
        """A client's own error as it leaves the site: its text (first line) where declared, else
        :data:`CLIENT_FAILED` (the text may quote the site's data)."""
        if error is None:
            return None
        if self.client_error_text:
            return error
        return CLIENT_FAILED

    def client_seconds(self, seconds: float) -> float:
        """A client's training time as it leaves the site: 0.0 where not declared (under DP-SGD it
        follows the Poisson batch sizes, a known side channel; under client DP the site's size)."""
        return float(seconds) if self.client_time else 0.0

    # ------------------------------------------------------------------ on the server
    def error(self, error: str, origin: str = "client") -> str:
        """The error line the server records: its own decisions (``origin="server"``) as they are,
        a client's own text only where declared. The origin is structural, never read from the text
        (a client's message that starts like the server's stays at the site). ``origin="site"``: a site's
        refusal on its own policy (:class:`SiteRefusal`), which quotes no data."""
        line = (error or "").splitlines()[0] if error else ""
        if origin in ("server", "site") or self.client_error_text:
            return line
        return CLIENT_FAILED

    def record(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        """A site's record (``clients.jsonl``) cut to the declared values."""
        return {k: v for k, v in rec.items() if self._record_ok(k)}

    def _record_ok(self, key: str) -> bool:
        if key in ("round", "attempt", "client", "client_name", "error", "rejected"):
            return True
        if key == "time":
            return self.client_time
        if key == "num_examples":
            return self.site_size
        return self.allows_meta(key) and key not in STRUCTURE_META[:2]

    def round_record(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        """A round's record (``metrics.jsonl``) without what it would say about one site: the clients'
        summed training time (one client a round: that client's) and per-site evaluation, where not
        declared."""
        out = dict(rec)
        if not self.client_time:
            out.pop("time_clients", None)
        if not self.site_eval:
            out.pop("client_eval", None)
            for k in [k for k in out if k.startswith("eval/clients_") or k.startswith("eval/worst_")]:
                out.pop(k)
        return out

    def fields(self) -> dict[str, Any]:
        """``privacy.json``'s ``upload_fields`` and ``server_records`` (generated, never hand-kept)."""
        if self.upload_meta is None:
            up = {"everything": "no differential privacy: every field reaches the server as computed from raw data"}
        else:
            up = {f"meta: {', '.join(keys)}": why for keys, why in self.upload_meta.values()}
            up.update({f"meta: {p}*": why for p, why in self.meta_prefixes.items()})
        up.update({f"entries: {k}": why for k, why in self.upload_entries.items()})
        return {"level": self.level, "upload_fields": up, "server_records": dict(self.server_records)}


def level_of(privacy: Any, secure_aggregation: bool) -> str:
    """The privacy level of a run's ``privacy`` config (client-level DP wins over record-level)."""
    client = getattr(privacy, "client", None)
    if client is not None:
        if client.noise == "distributed":
            return "client_distributed_secagg" if secure_aggregation else "client_distributed"
        return "client_central"
    return "record" if getattr(privacy, "record", None) is not None else "none"


def declare(privacy: Any, secure_aggregation: bool = False, client_eval: bool = False) -> ServerView:
    """The :class:`ServerView` of a run: its level (:func:`level_of`) with the user's own releases
    (``release_metrics``, ``federation.client_eval``) added, each marked NOT protected."""
    level = level_of(privacy, secure_aggregation)
    record = getattr(privacy, "record", None)
    client = getattr(privacy, "client", None)
    losses = bool((client or record) is not None and (client or record).release_metrics)
    structure = (STRUCTURE_META, "the job's ids and the downlink version: assigned or sent by the server itself")
    if level == "none":
        return ServerView(
            level, None, {}, {"all": "no differential privacy: every entry as computed from raw data"},
            {"time, num_examples, every numeric upload field, a client's own error text": "nothing is protected",
             "per-site evaluation, label counts, data paths": "nothing is protected"},
            client_error_text=True, client_time=True, site_size=True, site_labels=True, site_eval=True, site_paths=True,
            sees="every upload as computed from raw data")
    if level == "record":
        meta = {"structure": structure,
                "counts": (COUNT_META, "the site's size and step count: public under record-level DP"),
                "diagnostics": (DIAGNOSTIC_META, "post-processing of the privatised gradients")}
        if losses:
            meta["losses"] = (LOSS_META, "NOT protected: raw training losses (privacy.record.release_metrics: true)")
        recs = {"round, attempt, client, client_name": "the job's ids",
                "num_examples": "the site's size: public under record-level DP",
                "error": "the server's own decisions; a client's own failure as one generic line (its text may quote rows)",
                "numeric upload fields": "those declared in upload_fields"}
        if client_eval:
            recs["per-site evaluation"] = "NOT protected: computed on held-out rows (federation.client_eval)"
        return ServerView(
            level, meta, {RECORD_DP_PREFIX: "DP-SGD's schedule (σ, q, steps, C) for the per-site accountant: fixed by the "
                                            "config and the site's size"},
            {"update, moment, basis, head": "post-processing of the DP-SGD-privatised gradients"}, recs,
            client_error_text=False, client_time=False, site_size=True, site_labels=False, site_eval=bool(client_eval),
            site_paths=False, sees="every upload: post-processing of privatised gradients")
    # client-level DP: nothing counted on the site's data leaves
    meta = {"structure": structure}
    prefixes: dict[str, str] = {}
    if record is not None:  # both levels on: the per-site DP-SGD accountant needs its schedule
        prefixes[RECORD_DP_PREFIX] = ("NOT protected at the client level: DP-SGD's schedule (σ, q, steps, C; q = batch/n "
                                      "reveals the site's size), which record-level accounting needs (privacy.record on too)")
    if client is not None and client.adaptive_clipping is not None:
        meta["clip bit"] = ((CLIP_BIT_META,), "1[‖Δ‖ ≤ C] with its noise (adaptive clipping; inside σ)")
    if losses:
        meta["losses and diagnostics"] = (LOSS_META + DIAGNOSTIC_META,
                                          "NOT protected: raw training statistics (privacy.client.release_metrics: true)")
    noise = {"client_central": "the server's noise on the sum (central: the raw upload reaches the trusted server; "
                               "nothing raw is logged)",
             "client_distributed": "its own share of the noise (N(0, σ²C²/K)); the server sees each noised upload",
             "client_distributed_secagg": "its own share of the noise; SecAgg+ shows the server only the sum"}[level]
    entries = {"update, head": "the client's change from the broadcast, clipped jointly to C, with " + noise,
               "moment": "second-moment blocks clipped to C_m, noised with σ_m (a composed release), when uploaded"}
    recs = {"round, attempt, client, client_name": "the job's ids (which sites took part is not protected)",
            "error": "the server's own decisions (on released values or the protocol); a client's own failure as one "
                     "generic line, decided at the site",
            "upload size": "a public constant of the config (no count travels; FedGaLore needs train.local_steps)"}
    if client_eval:
        recs["per-site evaluation"] = "NOT protected: computed on each site's held-out rows (federation.client_eval)"
    sees = {"client_central": "each raw upload (trusted server), then the noised sum",
            "client_distributed": "each noised upload", "client_distributed_secagg": "only the noised sum"}[level]
    return ServerView(level, meta, prefixes, entries, recs, client_error_text=False, client_time=False, site_size=False,
                      site_labels=False, site_eval=bool(client_eval), site_paths=False, site_state=False, sees=sees)


def view_of(cfg: Any) -> ServerView:
    """The :class:`ServerView` of a run's config (its ``privacy``, ``federation.secure_aggregation`` and
    ``federation.client_eval``): the one reading of a config every process that applies the view uses."""
    fed = cfg.federation
    return declare(cfg.privacy, fed.secure_aggregation is not None, bool(fed.client_eval))


def threat_table() -> str:
    """docs/privacy.md's table of what the server sees and records per level, generated from
    :func:`declare` (``python -m fedgalore.privacy.view``; tests/privacy/test_server_view.py compares
    the docs with it)."""
    from types import SimpleNamespace as NS

    def cfg(level: str) -> tuple[Any, bool]:
        if level == "none":
            return NS(record=None, client=None), False
        if level == "record":
            return NS(record=NS(release_metrics=False), client=None), False
        noise = "central" if level == "client_central" else "distributed"
        return NS(record=None, client=NS(noise=noise, release_metrics=False, adaptive_clipping=None)), level.endswith("secagg")

    rows = ["| level | what leaves a site (meta) | the server sees | per site it may record | "
            "error text | time | size | labels | per-site eval |", "|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for level in LEVELS:
        v = declare(*cfg(level))
        meta = ("everything" if v.upload_meta is None else
                "; ".join(f"{g}: {', '.join(k)}" for g, (k, _) in v.upload_meta.items())
                + "".join(f"; {p}*" for p in v.meta_prefixes))
        recs = "; ".join(v.server_records)
        rows.append(f"| `{level}` | {meta} | {v.sees} | {recs} | {yes[v.client_error_text]} | {yes[v.client_time]} | "
                    f"{yes[v.site_size]} | {yes[v.site_labels]} | {'yes' if v.site_eval else 'only with client_eval (NOT protected)'} |")
    return "\n".join(rows)


if __name__ == "__main__":  # the docs' table
    print(threat_table())
