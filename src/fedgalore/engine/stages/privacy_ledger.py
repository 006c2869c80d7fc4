"""The privacy accountant of a run as a round stage: what the server saw, what it cost, ``privacy.json``.

Each site's DP-SGD is :mod:`fedgalore.engine.stages.record_dp`; client-level DP's clipping and
noise :mod:`fedgalore.engine.stages.client_dp`. :class:`PrivacyAccountant` is the stage (always
on: a run without DP writes that nothing was protected); it keeps one :class:`PrivacyLedger`.

:class:`PrivacyLedger` is the server's: every upload that came back — kept, rejected or from a
retried attempt, since the server saw it — adds the site's ``(σ, q, steps)`` (the client's
report, :meth:`DPSGD.stats`) to that site's history, kept in ``ServerState.meta["privacy"]`` so
a checkpoint carries it and a resumed run continues the accountant exactly. After each round
the sites that took part get their ε(δ) over everything they ran (Opacus' accountant,
:func:`~fedgalore.privacy.accounting.epsilon`) and ``privacy.json`` is rewritten: per round and
per release type (update, moment, basis, head, control variate, metrics, counts) whether it was
clipped, its sensitivity and σ, and per site its ε. A run without DP writes that nothing was
protected.

Client-level DP (``privacy.client``; the mechanism is fedgalore.engine.stages.client_dp): the same
ledger keeps the federation's accountant in ``ServerState.meta["privacy_client"]`` — one
``(σ of the round, K, rounds)`` history entry per release (the server's noised aggregate under
central noise; every attempt whose noised uploads came back under distributed noise), ε(δ) after
each round, the adaptive clip norm — writes privacy.json's ``client`` part, and
:meth:`PrivacyLedger.budget_stop` tells the round loop when the next round would exceed
``target_epsilon``.

The cap holds at every release: before each attempt (a retry included) :meth:`PrivacyLedger.
budget_stop` checks the client-level budget with that attempt's worst case (distributed noise
through secure aggregation: only the fewest shares SecAgg+ still unmasks in the sum; without it: each
sampled client's next upload as the server sees it), and :meth:`PrivacyLedger.spent_sites` holds
back a site whose next client-round would take its record-level ε past ``privacy.record.
target_epsilon``. Account before release: every release is journaled (``privacy_journal.jsonl``,
fsynced) before anything derived from it exists — a client's upload as the server receives it,
central noise's aggregate before the noise is drawn (:meth:`PrivacyLedger.central_release`) — so
no aggregate, per-round adapter, printed evaluation or checkpoint precedes its entry. A run that
starts in a directory with a journal (resumed from a checkpoint, or restarted at round 0 when a
crash came before the first one) adds every journaled release its state lacks, unless
``privacy.reproducible`` (then the re-run releases the very same values).
"""
from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from fedgalore.engine.stages.base import Attempt, RoundStage, RunView, StopRun
from fedgalore.engine.stages.client_dp import client_book
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.privacy.randomness import REPRODUCIBLE_REFUSED
from fedgalore.federated.checkpoint import atomic_write_text
from fedgalore.privacy.view import view_of
from fedgalore.jsonl import read_json
from fedgalore.privacy.accounting import epsilon, merge_history, site_schedule
from fedgalore.privacy.statement import (NOT_AGAINST_CONFIG, NOTHING_PROTECTED, client_mechanism, client_noised,
                                         client_release_record, client_statement, mechanism, not_protected, record_noised,
                                         record_statement, release_record)
from fedgalore.protocol.payload import GaLoreUpdate, LowRank, MomentView, Payload

__all__ = ["PrivacyAccountant", "PrivacyLedger", "BudgetStop", "PRIVACY_FILE", "JOURNAL_FILE", "release_kinds", "read_privacy", "privacy_plan",
           "client_signal"]

PRIVACY_FILE = "privacy.json"
#: every release as the server received it, appended and fsynced (module doc)
JOURNAL_FILE = "privacy_journal.jsonl"


def release_kinds(upload: Payload, heads: Sequence[str], scaffold: bool = False) -> list[str]:
    """The release types in one upload (:data:`fedgalore.privacy.statement.RELEASE_KINDS`):
    ``moment/…`` entries are second moments (with a basis unless seeded), GaLore records with a
    data-driven term carry bases, entries of the head parameters (``heads``: raw names, also
    found inside adapter wrappers' names) are the head, the rest updates; metrics and counts
    ride in every upload's meta."""
    kinds: set[str] = {"metrics", "counts"}
    head_names = [h for h in heads]
    for key, e in upload.entries.items():
        if key.startswith("moment/"):
            kinds.add("moment")
            if isinstance(e, MomentView) and e.basis is not None:
                kinds.add("basis")
        elif any(key == h or key.endswith("." + h) or _wrapped_name(key) == h for h in head_names):
            kinds.add("head")
        else:
            kinds.add("update")
            if isinstance(e, GaLoreUpdate) and any(isinstance(t, LowRank) for t in e.terms):
                kinds.add("basis")
    if scaffold:
        kinds.add("control_variate")
    order = ("update", "moment", "basis", "head", "control_variate", "metrics", "counts")
    return [k for k in order if k in kinds]


def _wrapped_name(key: str) -> str:
    """A PEFT name without its wrappers: ``base_model.model.classifier.modules_to_save.default.weight``
    → ``classifier.weight``."""
    parts = key.split(".")
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    out, i = [], 0
    while i < len(parts):
        if parts[i] in ("modules_to_save", "original_module") and i + 1 < len(parts):
            i += 2 if parts[i] == "modules_to_save" else 1
            continue
        out.append(parts[i])
        i += 1
    return ".".join(out)


def read_privacy(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's ``privacy.json`` (None when it has none or it does not parse)."""
    return read_json(Path(run_dir) / PRIVACY_FILE)


class BudgetStop(StopRun):
    """The next release would pass ``privacy.client.target_epsilon``: the run ends cleanly (its
    message is the one line that says so)."""


class PrivacyLedger:
    """The server's record of what it saw and what it cost (module doc)."""

    def __init__(self, cfg: FederatedConfig, heads: Sequence[str], names: Callable[[int], str],
                 sizes: Sequence[int], support: dict[str, list[str]] | None = None, release: Any = None,
                 sites: Any = None, run_dir: Path | None = None) -> None:
        self.cfg, self.record = cfg, cfg.privacy.record
        self.heads, self.names, self.sizes, self.support = list(heads), names, list(sizes), support
        #: client-level DP (fedgalore.engine.stages.client_dp.ClientRelease; None: off)
        self.release = release
        #: record-level DP-SGD's schedules (σ, q, steps per site), for the per-site cap (None: off)
        self.sites = sites
        #: where the journal of releases lives (None: not journaled)
        self.journal = Path(run_dir) / JOURNAL_FILE if run_dir is not None and cfg.privacy.enabled else None

    # ------------------------------------------------------------------ the journal of releases
    def _journal(self, state: Any, entry: dict[str, Any]) -> None:
        """Append one release to the journal (fsynced) and mark it absorbed into ``state``."""
        if self.journal is None:
            return
        entry = {"id": uuid.uuid4().hex[:16], **entry}
        with open(self.journal, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        state.meta.setdefault("privacy_journal", []).append(entry["id"])

    def recover(self, state: Any) -> int:
        """A run starting in a directory whose journal holds releases: add to ``state``'s
        accountants every journaled release it lacks — the rounds a crash lost after the last
        checkpoint, or every release when there is no checkpoint (``state`` fresh: the run restarts
        at round 0); their re-run draws fresh noise, so both count. None under
        ``privacy.reproducible`` (a re-run releases the same values). Returns how many releases
        were added."""
        if self.journal is None or self.cfg.privacy.reproducible or not self.journal.exists():
            return 0
        seen = set(state.meta.setdefault("privacy_journal", []))
        added = 0
        for line in self.journal.read_text(encoding="utf-8").splitlines():
            try:
                e = json.loads(line)
            except ValueError:  # a line cut by the crash: the release it names was not complete
                continue
            if e.get("id") in seen:
                continue
            if e.get("level") == "record" and self.record is not None:
                book = self._book(state)
                c = str(int(e["client"]))
                book["sites"][c] = merge_history([*book["sites"].get(c, []), e["entry"]])
                book["epsilon"][c] = epsilon(book["sites"][c], self.record.delta, self.record.accountant)
            elif e.get("level") == "client" and self.release is not None:
                cb = client_book(state)
                cb["history"] = _merge_client([*cb["history"], *_as_rounds([e["event"]])])
                _count_uploads(cb, e.get("uploads", []))
                self._client_headline(cb)
            else:
                continue
            state.meta["privacy_journal"].append(e["id"])
            state.meta.setdefault("privacy_recovered", []).append({k: v for k, v in e.items() if k != "id"})
            added += 1
        if added:
            logging.getLogger("fedgalore").warning(
                "privacy: %d release(s) that no checkpoint holds were lost with the process that made them; they are "
                "accounted (privacy.json: recovered_releases)", added)
        return added

    # ------------------------------------------------------------------ client-level (privacy.client)
    def _client_event(self, book: dict[str, Any], received: int, sampled: int) -> list:
        """One release of the sampled clients' uploads: ``(σ of the round, K, 1)`` joins the history.
        Fewer noised uploads than sampled (dropouts; under secure aggregation, nodes lost in the
        SecAgg+ round) leave the sum σ·√(k/K): accounted so, and said in the log."""
        sigma = self.release.round_multiplier(received)
        if received < sampled:
            logging.getLogger("fedgalore").warning(
                "privacy.client: %d of %d clients' noised uploads reached the sum; it carries noise multiplier %.4g "
                "instead of %.4g (accounted)", received, sampled, sigma, self.release.round_multiplier(sampled))
        book["pending"].append([sigma, int(sampled), int(received)])
        return [sigma, int(sampled), int(received)]

    def current_clip(self, state: Any) -> float | None:
        """The clip norm C of the next round (adaptive clipping moves it; else ``privacy.client.clip``)."""
        if self.release is None:
            return None
        return self.release.clip_now(state)

    def client_epsilon(self, history: Sequence[Sequence[float]]) -> float:
        """ε(δ) of the federation after ``history`` (fedgalore.privacy.client_dp.client_epsilon)."""
        from fedgalore.privacy.client_dp import client_epsilon

        return client_epsilon([(h[0], h[1], h[2]) for h in history], self.release.num_clients, self.release.client.delta)

    def server_view_epsilon(self, uploads: int) -> float:
        """ε(δ) of one client after ``uploads`` noised uploads that the server saw one by one
        (distributed noise without secure aggregation; no amplification: the server knows whom it
        sampled)."""
        from fedgalore.privacy.client_dp import client_epsilon

        return client_epsilon([(self.release.upload_multiplier(), 1, int(uploads))], 1, self.release.client.delta)

    def _flush_client(self, cb: dict[str, Any]) -> list[list[float]]:
        """The round's pending releases join the history (ε updated); returns them."""
        events, cb["pending"] = cb["pending"], []
        cb["history"] = _merge_client([*cb["history"], *_as_rounds(events)])
        self._client_headline(cb)
        return events

    def _client_headline(self, cb: dict[str, Any]) -> None:
        """The federation's ε after the book's releases: the sum's (amplified by the server's
        sampling) and, when the server sees each upload, the worst client's as the server sees it
        — then the headline ``epsilon``."""
        cb["epsilon_sum"] = self.client_epsilon(cb["history"])
        cb["epsilon"] = cb["epsilon_sum"]
        if self.release.server_sees_uploads:
            most = max(cb.get("uploads", {}).values(), default=0)
            cb["epsilon"] = max(cb["epsilon_sum"], self.server_view_epsilon(most))

    def budget_stop(self, state: Any, round_idx: int, clients: Sequence[int] | None = None, attempt: int = 0) -> str | None:
        """Why round ``round_idx`` (attempt ``attempt``, for ``clients``; None: any sample) must not
        start — its release, at its worst case, would take ε past ``privacy.client.target_epsilon`` —
        as one line; None when it fits (or no budget is set). The worst case: central noise, one
        release of σ on the sum; distributed noise through secure aggregation, a sum of only
        the fewest shares SecAgg+ still unmasks (this round's earlier attempts counted); without secure
        aggregation, the sampled client with the most uploads so far sending one more."""
        if self.release is None or self.release.client.target_epsilon is None:
            return None
        target = float(self.release.client.target_epsilon)
        book = client_book(state)
        rel, k = self.release, self.release.sample
        # released so far: the history and this round's earlier attempts (pending only under distributed noise)
        released = [*book["history"], *_as_rounds(book["pending"])]
        distributed_sum = rel.client.noise == "distributed" and not rel.server_sees_uploads
        worst = self.cfg.federation.secure_aggregation.min_survivors(k) if distributed_sum else k
        nxt = self.client_epsilon([*released, [rel.round_multiplier(worst), k, 1]])
        if rel.server_sees_uploads:  # each sampled client's next upload, as the server sees it
            counts = book.get("uploads", {})
            pool = [str(c) for c in clients] if clients is not None else list(counts) or ["-"]
            most = max((counts.get(c, 0) for c in pool), default=0)
            nxt = max(nxt, self.server_view_epsilon(most + 1))
        if nxt <= target * (1 + 1e-9):
            return None
        what = f"round {round_idx + 1}" + (f" (attempt {attempt + 1})" if attempt else "")
        return (f"privacy budget: {what} would take ε from {book['epsilon']:.3g} to {nxt:.3g} > "
                f"privacy.client.target_epsilon={target:g} (δ = {self.release.client.delta:g}); the run stops after round "
                f"{round_idx} (checkpointed)")

    def spent_sites(self, state: Any, clients: Sequence[int]) -> dict[int, str]:
        """The sampled sites that must not train this round: their next client-round of DP-SGD
        would take their ε past ``privacy.record.target_epsilon`` (the cap; with
        ``calibration: every_round`` only retries reach it). ``{client: one line}``."""
        if self.record is None or self.record.target_epsilon is None or self.sites is None:
            return {}
        book, target, out = self._book(state), float(self.record.target_epsilon), {}
        for c in clients:
            sch = self.sites.schedule(int(c))
            nxt = epsilon([*book["sites"].get(str(int(c)), []), [sch.noise_multiplier, sch.sample_rate, sch.steps_per_round]],
                          self.record.delta, self.record.accountant)
            if nxt > target * (1 + 1e-9):
                out[int(c)] = (f"privacy budget spent: another round would take this site's ε to {nxt:.3g} > "
                               f"privacy.record.target_epsilon={target:g}; not trained")
        if out:
            book.setdefault("stopped_sites", {}).update({str(c): why for c, why in out.items()})
        return out

    def close_attempts(self, state: Any, run_dir: Path) -> None:
        """A round abandoned after some of its attempts released (the budget stop): their
        releases join the history now, and privacy.json says so."""
        if self.release is not None:
            self._flush_client(client_book(state))
        if self.record is not None:
            book = self._book(state)
            for c in book["pending"]:
                book["epsilon"][c] = epsilon(book["sites"][c], self.record.delta, self.record.accountant)
            book["pending"] = {}
        self.write(run_dir, state)

    @staticmethod
    def _book(state: Any) -> dict[str, Any]:
        return state.meta.setdefault("privacy", {"sites": {}, "epsilon": {}, "pending": {}, "rounds": [], "unaccounted": []})

    def observe(self, state: Any, round_idx: int, attempt: int, results: Sequence[Any]) -> None:
        """Count every upload that came back in one attempt of round ``round_idx`` (the server saw
        it, whatever validation decides): its site's ``(σ, q, steps)`` joins that site's history."""
        if self.release is not None and self.release.client.noise == "distributed":
            out = [r for r in results if _released(r, unknown_counts=self.release.server_sees_uploads)]
            if out:  # the clients released their noised uploads, whatever the server keeps
                cb = client_book(state)
                event = self._client_event(cb, len(out), len(results))
                ups = [int(r.client) for r in out] if self.release.server_sees_uploads else []
                _count_uploads(cb, ups)
                self._journal(state, {"level": "client", "round": round_idx + 1, "attempt": attempt, "event": event,
                                      "uploads": ups})
        if self.record is None:
            return
        book = self._book(state)
        for res in results:
            if not _released(res):  # no upload: nothing was released
                continue
            st = res.stats or {}
            c = str(int(res.client))
            if not isinstance(st.get("dp_steps"), (int, float)):
                book["unaccounted"].append({"round": round_idx + 1, "client": int(res.client)})
                continue
            entry = [float(st["dp_noise_multiplier"]), float(st["dp_sample_rate"]), int(st["dp_steps"])]
            book["sites"][c] = merge_history([*book["sites"].get(c, []), entry])
            self._journal(state, {"level": "record", "round": round_idx + 1, "attempt": attempt, "client": int(res.client),
                                  "entry": entry})
            p = book["pending"].setdefault(c, {"steps": 0, "noise_multiplier": entry[0], "sample_rate": entry[1],
                                               "attempts": []})
            p["steps"] += entry[2]
            p["attempts"].append(attempt)

    def central_release(self, state: Any, round_idx: int, kept: int) -> None:
        """Central noise: the server is about to noise the sum of the round's ``kept`` clipped uploads
        — journaled (fsynced) before the noise is drawn, so nothing derived from the release (the
        aggregate, a per-round adapter, a printed evaluation, a checkpoint) exists unaccounted."""
        if self.release is None or self.release.client.noise != "central":
            return
        event = self._client_event(client_book(state), kept, self.release.sample)
        self._journal(state, {"level": "client", "round": round_idx + 1, "event": event, "uploads": []})

    def end_round(self, state: Any, round_idx: int, uploads: Sequence[Payload], run_dir: Path) -> dict[str, float]:
        """Close round ``round_idx``: ε of the sites that took part, the round's release record,
        ``privacy.json`` rewritten; returns what joins the round's metrics (``dp_epsilon``: the
        largest ε of any site so far)."""
        book = self._book(state)
        kinds = release_kinds(uploads[0], self.heads, bool(self.cfg.train.scaffold)) if uploads else ["metrics", "counts"]
        clip = self.cfg.federation.clip_update_norm
        rec: dict[str, Any] = {"round": round_idx + 1,
                               "releases": {k: release_record(k, self.record, clip) for k in kinds}}
        out: dict[str, float] = {}
        if self.record is not None:
            sites = {}
            for c, p in sorted(book["pending"].items(), key=lambda kv: int(kv[0])):
                eps = epsilon(book["sites"][c], self.record.delta, self.record.accountant)
                book["epsilon"][c] = eps
                sites[c] = {"name": self.names(int(c)), "steps": p["steps"], "noise_multiplier": p["noise_multiplier"],
                            "sample_rate": p["sample_rate"], "epsilon": eps}
                if len(p["attempts"]) > 1 or any(a > 0 for a in p["attempts"]):
                    sites[c]["attempts"] = p["attempts"]
            book["pending"] = {}
            rec["sites"] = sites
            rec["epsilon_max"] = max(book["epsilon"].values(), default=0.0)
            out["dp_epsilon"] = rec["epsilon_max"]
        if self.release is not None:
            cb = client_book(state)
            events = self._flush_client(cb)  # central noise: the aggregate's release, journaled by central_release
            clip = self.current_clip(state)
            rec["client"] = {"releases": [{"noise_multiplier": e[0], "sampled": e[1], "uploads": e[2]} for e in events],
                             "epsilon": cb["epsilon"], "clip": clip}
            if self.release.client.adaptive_clipping is not None:  # Andrew et al.: C follows the noised bits' share
                bits = [float(u.meta["dp_clip_bit"]) for u in uploads if isinstance(u.meta.get("dp_clip_bit"), (int, float))]
                cb["clip"] = self.release.next_clip(clip, bits)
                rec["client"]["clip_next"] = cb["clip"]
                rec["client"]["clip_bits_share"] = sum(bits) / len(bits) if bits else None
            out["dp_clip"] = clip
            by_kind = {k: client_release_record(k, self.release) for k in kinds}
            if self.record is None:
                rec["releases"] = by_kind
            else:  # both levels: the record-level records stay in "releases", the client-level ones beside them
                rec["client"]["releases_by_kind"] = by_kind
            out["dp_client_epsilon"] = cb["epsilon"]
        book["rounds"].append(rec)
        self.write(run_dir, state)
        return out

    def document(self, state: Any) -> dict[str, Any]:
        """``privacy.json`` (module doc)."""
        doc = self._document(state)
        if self.cfg.privacy.enabled:
            doc["reproducible"] = bool(self.cfg.privacy.reproducible)
            # generated from the server view's declaration (fedgalore.privacy.view), never hand-kept
            view = view_of(self.cfg).fields()
            doc["server_view"], doc["upload_fields"], doc["server_records"] = (view["level"], view["upload_fields"],
                                                                              view["server_records"])
            if state.meta.get("privacy_recovered"):
                doc["recovered_releases"] = state.meta["privacy_recovered"]
            stopped = (state.meta.get("privacy") or {}).get("stopped_sites")
            if stopped:
                doc["stopped_sites"] = stopped
        return doc

    def _document(self, state: Any) -> dict[str, Any]:
        book = state.meta.get("privacy") or {"sites": {}, "epsilon": {}, "rounds": [], "unaccounted": []}
        r = self.record
        reproducible = bool(self.cfg.privacy.reproducible)
        client = self._client_document(state) if self.release is not None else None
        if r is None and client is not None:
            return {"protected": client_noised(self.release), "statement": client["statement"], "mechanism": None,
                    "not_protected": client.pop("not_protected"), "client": client, "rounds": book.get("rounds", [])}
        if r is None:
            return {"protected": False, "statement": NOTHING_PROTECTED, "mechanism": None,
                    "not_protected": not_protected(None), "rounds": book.get("rounds", [])}
        sites = {}
        for c, hist in sorted(book["sites"].items(), key=lambda kv: int(kv[0])):
            rounds = [rd["round"] for rd in book["rounds"] if c in (rd.get("sites") or {})]
            sites[c] = {"name": self.names(int(c)), "num_examples": self.sizes[int(c)] if int(c) < len(self.sizes) else None,
                        "rounds": rounds, "steps": sum(int(h[2]) for h in hist),
                        "noise_multiplier": hist[-1][0], "sample_rate": hist[-1][1],
                        "history": hist, "epsilon": book["epsilon"].get(c)}
        eps = [v for v in book["epsilon"].values() if v is not None]
        unprotected = not_protected(r, reproducible)
        if self.cfg.federation.client_eval:
            unprotected.append("the per-site evaluation metrics of federation.client_eval (computed on the sites' held-out "
                               "rows, not by DP-SGD)")
        # σ = 0 clips and adds no noise (ε = ∞): not protected, and said so (statement, not_protected)
        doc = {"protected": record_noised(r) or client_noised(self.release), "statement": record_statement(r, reproducible),
               "mechanism": mechanism(r, self.support, reproducible),
               "delta": r.delta, "epsilon_max": max(eps) if eps else 0.0,
               "not_protected": unprotected, "sites": sites, "rounds": book["rounds"]}
        if client is not None:
            doc["not_protected"] = [x for x in doc["not_protected"] if not x.startswith("a site's data as a whole")
                                    and x != NOT_AGAINST_CONFIG]
            doc["client"] = {k: v for k, v in client.items() if k != "not_protected"}
            doc["not_protected"] += [x for x in client["not_protected"] if x not in doc["not_protected"]]
            doc["statement"] += " " + client["statement"]
        if book.get("unaccounted"):
            doc["unaccounted_uploads"] = book["unaccounted"]
            doc["statement"] += (f" WARNING: {len(book['unaccounted'])} upload(s) came without a DP-SGD record (a client "
                                 "that did not run DP-SGD); they are not protected.")
        return doc

    def _client_document(self, state: Any) -> dict[str, Any]:
        """``privacy.json``'s ``client`` part: the mechanism, σ, the history and ε of the federation."""
        rel, c = self.release, self.release.client
        cb = state.meta.get("privacy_client") or {"history": [], "epsilon": 0.0}
        unprotected = ["which sites took part in which round (DP does not hide participation)"]
        if not client_noised(rel):
            unprotected.insert(0, "each site's data: privacy.client.noise_multiplier=0 clips the uploads and adds no noise "
                                  "(ε = ∞)")
        if c.release_metrics:
            unprotected.append("the clients' training losses (privacy.client.release_metrics: true sends them in the clear)")
        if self.cfg.federation.client_eval:
            unprotected.append("the per-site evaluation metrics of federation.client_eval")
        if rel.reproducible:
            unprotected.append(NOT_AGAINST_CONFIG)
        out = {"statement": client_statement(rel), "mechanism": client_mechanism(rel), "delta": c.delta,
               "noise_multiplier": rel.sigma, "moment_noise_multiplier": rel.sigma_m,
               "update_noise_multiplier": rel.sigma_update, "count_noise_multiplier": rel.sigma_b,
               "clip": cb.get("clip", c.clip),
               "history": cb["history"], "epsilon": cb["epsilon"], "not_protected": unprotected}
        if rel.server_sees_uploads:
            out["epsilon_sum"] = cb.get("epsilon_sum", cb["epsilon"])
            out["upload_noise_multiplier"] = rel.upload_multiplier()
            out["uploads_seen"] = dict(cb.get("uploads", {}))
        return out

    def write(self, run_dir: Path, state: Any) -> None:
        """Rewrite ``<run_dir>/privacy.json`` (atomically)."""
        doc = self.document(state)
        atomic_write_text(Path(run_dir) / PRIVACY_FILE, json.dumps(_finite(doc), indent=1, ensure_ascii=False))


def _as_rounds(events: Sequence[Sequence[float]]) -> list[list[float]]:
    """Release events ``(σ, K, uploads)`` as history entries ``(σ, K, 1 round)``."""
    return [[e[0], e[1], 1] for e in events]


def _count_uploads(cb: dict[str, Any], clients: Sequence[int]) -> None:
    """One more noised upload seen by the server for each of ``clients`` (``cb["uploads"]``)."""
    counts = cb.setdefault("uploads", {})
    for c in clients:
        counts[str(c)] = counts.get(str(c), 0) + 1


def _merge_client(history: Sequence[Sequence[float]]) -> list[list[float]]:
    """Consecutive ``(σ, K, rounds)`` entries with the same σ and K merged (their rounds added)."""
    out: list[list[float]] = []
    for sigma, k, n in history:
        if out and out[-1][0] == float(sigma) and out[-1][1] == int(k):
            out[-1][2] += int(n)
        else:
            out.append([float(sigma), int(k), int(n)])
    return out


def _finite(obj: Any) -> Any:
    """∞ as the string "inf" (JSON has no infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else "nan"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def privacy_plan(cfg: FederatedConfig, sizes: Sequence[int], steps: Callable[[int], int]) -> dict[str, Any]:
    """What ``privacy.record`` will spend, before the run (``fedgalore plan``): per site (sites of
    the same size share a row) q, steps per round, σ and ε(δ) over its planned rounds and over
    every round; ``{"record": None}`` without DP. ``steps(n)``: optimizer steps per round of a site
    with ``n`` examples."""
    record = cfg.privacy.record
    client = client_plan(cfg, len(sizes))
    if record is None:
        return {"record": None, "statement": NOTHING_PROTECTED} if client is None else {"record": None, "client": client}
    fed, tc = cfg.federation, cfg.train
    m = len(sizes)
    participation = (fed.clients_per_round or m) / m
    rows: dict[int, dict[str, Any]] = {}
    for i, n in enumerate(sizes):
        if int(n) not in rows:
            sch = site_schedule(record, int(n), tc.batch_size, tc.grad_accum_steps, steps(int(n)), fed.rounds, participation)
            rows[int(n)] = {"num_examples": int(n), "sites": 0, "sample_rate": sch.sample_rate,
                            "steps_per_round": sch.steps_per_round, "noise_multiplier": sch.noise_multiplier,
                            "planned_rounds": sch.planned_rounds, "epsilon_planned": sch.planned_epsilon(record),
                            "epsilon_every_round": sch.epsilon_every_round(record)}
        rows[int(n)]["sites"] += 1
    table = sorted(rows.values(), key=lambda r: r["num_examples"])
    return {"client": client, "record": {"max_grad_norm": record.max_grad_norm, "noise_multiplier": record.noise_multiplier,
                       "target_epsilon": record.target_epsilon, "delta": record.delta, "accountant": record.accountant,
                       "calibration": record.calibration},
            "participation": participation, "rounds": fed.rounds, "sites": table,
            "epsilon_planned_max": max((r["epsilon_planned"] for r in table), default=0.0),
            "epsilon_every_round_max": max((r["epsilon_every_round"] for r in table), default=0.0)}


def client_plan(cfg: FederatedConfig, num_clients: int) -> dict[str, Any] | None:
    """What ``privacy.client`` will spend (``fedgalore plan``): σ (given or calibrated), σ_m, the
    round's combined σ, ε(δ) after the first round and after every round of the run; a config a
    run refuses carries its one-line reason in ``error``. None without client-level DP."""
    c = cfg.privacy.client
    if c is None:
        return None
    from fedgalore.engine.stages.client_dp import ClientRelease
    from fedgalore.job.resolve import method_options
    from fedgalore.methods.base import build_method

    out: dict[str, Any] = {"clip": c.clip, "noise": c.noise, "delta": c.delta, "target_epsilon": c.target_epsilon,
                           "calibrated": c.noise_multiplier is None,
                           "num_clients": int(num_clients), "rounds": cfg.federation.rounds}
    try:
        method = build_method(cfg.method.name, cfg.method.rank, method_options(cfg))
        rel = ClientRelease.build(cfg, method, num_clients)
    except (ConfigError, ValueError) as exc:
        return {**out, "error": str(exc)}
    from fedgalore.privacy.client_dp import client_epsilon

    sigma = rel.round_multiplier(rel.sample)
    out.update({"sampled": rel.sample, "noise_multiplier": rel.sigma, "moment_noise_multiplier": rel.sigma_m,
                "round_noise_multiplier": sigma, "aggregate": "mean" if rel.mean else "individual",
                "epsilon_first_round": client_epsilon([(sigma, rel.sample, 1)], num_clients, c.delta),
                "epsilon_planned": client_epsilon([(sigma, rel.sample, cfg.federation.rounds)], num_clients, c.delta)})
    if rel.server_sees_uploads:  # distributed noise without secure aggregation: one upload as the server sees it is the headline
        up = rel.upload_multiplier()
        out.update({"epsilon_sum_planned": out["epsilon_planned"], "upload_noise_multiplier": up,
                    "epsilon_first_round": client_epsilon([(up, 1, 1)], 1, c.delta),
                    "epsilon_planned": client_epsilon([(up, 1, cfg.federation.rounds)], 1, c.delta),
                    "headline": "one upload as the server sees it (no secure aggregation)"})
    return out


def client_signal(cfg: FederatedConfig, method_name: str, options: Any, num_clients: int, dim: int) -> Any:
    """Client-level DP's noise in the released mean against the signal, for ``method_name`` with
    its parsed ``options`` and ``dim`` coordinates per client (``fedgalore plan``; the run says the
    same at its start): :meth:`ClientRelease.noise_vs_signal`. None without ``privacy.client`` or
    for a config a run refuses (client_plan's ``error`` says why)."""
    if cfg.privacy.client is None:
        return None
    from fedgalore.engine.stages.client_dp import ClientRelease
    from fedgalore.methods.base import build_method

    try:
        rel = ClientRelease.build(cfg, build_method(method_name, cfg.method.rank, options), num_clients)
    except (ConfigError, ValueError):
        return None
    return rel.noise_vs_signal(dim)


#: errors after which a client's upload may have left its site although none came back (a reply lost or late)
_UNKNOWN = ("no reply", "timed out")


def _released(res: Any, unknown_counts: bool = False) -> bool:
    """Whether a client's upload left its site: an upload came back, or (secure aggregation) it went
    into the round's masked sum; with ``unknown_counts``, also a client whose reply was lost or
    late (it may have sent it: counted, the conservative side)."""
    if res.upload is not None or bool((res.stats or {}).get("secagg_summed")):
        return True
    return unknown_counts and any(m in (res.error or "") for m in _UNKNOWN)


class PrivacyAccountant(RoundStage):
    """The run's :class:`PrivacyLedger` at the round's seams (module doc): the budget checked
    before every attempt (a site past its record-level target held back), every upload the
    server saw counted, the round's ε and ``privacy.json`` after it, the next round's budget."""

    name = "privacy"
    server_only = True

    def __init__(self, ledger: PrivacyLedger, run_dir: Path, say: Callable[[str], None] | None = None,
                 signal: Any = None) -> None:
        self.ledger, self.run_dir = ledger, Path(run_dir)
        #: client-level DP's noise against the signal (fedgalore.privacy.signal.NoiseVsSignal; None: off), said at the start
        self.say, self.signal = say, signal

    @classmethod
    def backend_problem(cls, cfg: FederatedConfig, backend: Any) -> str | None:
        if cfg.privacy.enabled and cfg.privacy.reproducible and not backend.simulated:
            return REPRODUCIBLE_REFUSED
        return None

    @classmethod
    def build(cls, cfg: FederatedConfig, runtime: Any, run: RunView | None) -> "PrivacyAccountant":
        record = runtime.stages.get("record_dp")
        client = runtime.stages.get("client_dp")
        sites = record.sites if record is not None else None
        ledger = PrivacyLedger(cfg, runtime.head_params, runtime.clients.name, [len(p) for p in runtime.parts],
                               sites.support if sites is not None else None, client.mechanism if client is not None else None,
                               sites=sites, run_dir=run.run_dir)
        return cls(ledger, run.run_dir, run.say, client.signal(runtime) if client is not None else None)

    def start(self, state: Any, resumed: bool, start_round: int, rounds: int) -> None:
        # releases a crash lost still count (privacy_journal.jsonl): after the checkpoint, or before the first
        # one — a run restarted from round 0 in its own directory (no checkpoint) has no other record of them
        recovered = self.ledger.recover(state)
        if start_round < rounds:
            why = self.ledger.budget_stop(state, start_round)
            if why is not None:
                raise ConfigError(why.split("; the run stops")[0] + (
                    "; nothing to resume — a larger budget needs a new run" if start_round or recovered else
                    "; not even one round fits: raise privacy.client.target_epsilon or the noise"))
        self.ledger.write(self.run_dir, state)
        if self.signal is not None and self.say is not None and start_round < rounds:  # before any round is paid for
            self.say(self.signal.line())

    def plan(self, att: Attempt, state: Any) -> None:
        # the cap holds at every release: this attempt's worst case must fit the client-level budget,
        # and a site whose next round would pass its record-level target is held back
        why = self.ledger.budget_stop(state, att.round, att.clients, att.number)
        if why is not None:
            raise BudgetStop(why)
        att.held_back.update(self.ledger.spent_sites(state, att.clients))

    def observe(self, att: Attempt, results: list[Any], state: Any) -> None:
        self.ledger.observe(state, att.round, att.number, results)  # every upload the server saw counts

    def release(self, att: Attempt, state: Any) -> None:
        # account before release: this stage acts first, so central noise's release is journaled before it is drawn
        self.ledger.central_release(state, att.round, len(att.kept))

    def round_record(self, state: Any, round_idx: int, uploads: list[Payload]) -> dict[str, float]:
        return self.ledger.end_round(state, round_idx, uploads, self.run_dir)  # privacy.json; dp_epsilon

    def next_round_stop(self, state: Any, round_idx: int) -> str | None:
        return self.ledger.budget_stop(state, round_idx)

    def stopped(self, state: Any) -> None:
        self.ledger.close_attempts(state, self.run_dir)
