"""The round loop (paper §3 and Algorithm 1): sample → broadcast → T → A → S → evaluate → checkpoint.

Nothing method-specific lives here: a method supplies T (``client_update``), A (``aggregate``)
and S (``synchronize``); a backend decides where T runs. Per round k:

1. K of the M clients are sampled uniformly without replacement from a per-round seed
   (or all of them), with weights p̃_i = N_i / Σ_{j∈P_k} N_j;
2. the server broadcasts the method's payload (and the round seed s_k);
3. each client runs T; its upload is decoded and counted in the ledger;
4. A and S update the server state; diagnostics measure the two mismatches;
5. the global model is evaluated every ``eval_every`` rounds and the state is checkpointed.

Every random choice derives from (run seed, round, client), so a run resumed from any
checkpoint ends with exactly the metrics of an uninterrupted one.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedgalore.backends import make_backend
from fedgalore.backends.base import ClientJob, Runtime
from fedgalore.federated.checkpoint import atomic_write_text, load_latest_checkpoint, save_checkpoint
from fedgalore.federated.config import ConfigError, FederatedConfig
from fedgalore.federated.diagnostics import drift_diagnostics, update_space_diagnostics
from fedgalore.federated.events import LogProgress, ProgressSink
from fedgalore.federated.partition import label_histograms
from fedgalore.federated.resolve import check_device, config_for_method
from fedgalore.federated.seeding import round_seed, sample_clients
from fedgalore.federated.validation import expected_keys, upload_norm, validate_upload
from fedgalore.jsonl import append_jsonl, read_jsonl
from fedgalore.methods.base import Method
from fedgalore.protocol.payload import Ledger, Payload, PayloadError, decode, encode
from fedgalore.protocol.state import RoundContext
from fedgalore.tasks.base import Task

__all__ = ["Federation", "RunResult", "run", "resume", "extension_problem"]

log = logging.getLogger("fedgalore")


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final(self) -> dict[str, float]:
        return self.summary.get("final", {})


def _jsonl_truncate(path: Path, max_round: int) -> list[dict[str, Any]]:
    """Keep only records of completed (checkpointed) rounds; returns them."""
    recs = [r for r in read_jsonl(path) if int(r.get("round", 0)) <= max_round]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
    return recs


class Federation:
    """One federated run: config → run directory with metrics, ledger, diagnostics, checkpoints."""

    LOG_FILES = ("metrics.jsonl", "clients.jsonl", "ledger.jsonl", "diagnostics.jsonl")

    def __init__(
        self,
        cfg: FederatedConfig,
        *,
        run_dir: str | Path | None = None,
        progress: ProgressSink | None = None,
        task: Task | None = None,
        method: Method | None = None,
        resume: bool = False,
    ) -> None:
        # method.options may hold options of several methods; this run keeps its method's own
        cfg = config_for_method(cfg.validate()) if method is None else cfg.validate()
        check_device(cfg.device)
        self.cfg = cfg
        self.progress = progress or LogProgress()
        self.run_dir = self._choose_run_dir(cfg, run_dir, resume)  # before the (slow) model load
        self.runtime = Runtime(cfg, task=task, method=method)
        self.task, self.method = self.runtime.task, self.runtime.method
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backend = make_backend(cfg.backend.name, self.runtime, cfg.backend.options)
        self._validation = self.runtime.validation_set()
        self.ledger = Ledger()
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self.wall_time_before = 0.0
        ckpt = load_latest_checkpoint(self.run_dir, log=self.progress.message) if resume else None
        if ckpt is None:
            self.state = self.method.init_server_state(self.runtime.model)
            for f in self.LOG_FILES:
                (self.run_dir / f).unlink(missing_ok=True)
        else:
            self.state, info = ckpt
            self.start_round = int(info["round"])
            self.wall_time_before = float(info.get("wall_time", 0.0))
            self.history = _jsonl_truncate(self.run_dir / "metrics.jsonl", self.start_round)
            for f in self.LOG_FILES[1:]:
                recs = _jsonl_truncate(self.run_dir / f, self.start_round)
                if f == "ledger.jsonl":
                    self.ledger.records = recs
            self.progress.message(f"resuming {self.run_dir} after round {self.start_round}")
        self._write_static()

    def _choose_run_dir(self, cfg: FederatedConfig, run_dir: str | Path | None, resume: bool) -> Path:
        """The run directory: ``run_dir``, else ``<output.dir>/<output.run_name>``, else the default
        name ``<name>-<method>-<setting>-s<seed>``. A directory that already holds this very run
        (same config) is refused with what to do instead; under the default name, a directory
        holding a run with another config (e.g. other rounds) is left alone and this run goes to
        the first free ``<default name>-2``, ``-3``, ... (announced, never silent)."""
        default = run_dir is None and cfg.output.run_name is None
        name = cfg.output.run_name or f"{cfg.name}-{cfg.method.name}-{cfg.setting_label().replace(':', '')}-s{cfg.seed}"
        base = Path(run_dir) if run_dir is not None else Path(cfg.output.dir) / name
        if resume:
            return base
        candidate, n, first = base, 1, None
        while (candidate / "summary.json").exists():
            diff = _config_difference(candidate, cfg)
            if diff is None:
                raise ConfigError(_holds_this_run(candidate))
            if not default:
                raise ConfigError(f"run directory {candidate} already holds another run ({diff}); choose another "
                                  f"output.run_name{_extend_hint(candidate, cfg)}")
            first = first or diff
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")
        if candidate != base:
            self.progress.message(f"{base} holds a run with another config ({first}); this run goes to {candidate}"
                                  f"{_extend_hint(base, cfg)}")
        return candidate

    # ------------------------------------------------------------------ files
    def _write_static(self) -> None:
        from omegaconf import OmegaConf

        atomic_write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(self.cfg.to_dict())))
        labels = self.task.partition_labels()
        hist, classes = label_histograms(labels, self.runtime.parts)
        names = self.task.label_names()
        partition = {
            "setting": self.cfg.setting_label(),
            "label_names": names if len(names) == len(classes) else [str(c) for c in classes],
            "histograms": np.asarray(hist).tolist(),
            "sizes": [int(len(p)) for p in self.runtime.parts],
        }
        atomic_write_text(self.run_dir / "partition.json", json.dumps(partition))
        atomic_write_text(self.run_dir / "task.json", json.dumps(self.task.describe(), default=str))
        env = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            # the CPU and the kernel set torch dispatches to: results are bitwise reproducible on
            # one machine, but float kernels differ across CPUs (last digits, which chaotic runs amplify)
            "cpu": _cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "seed": self.cfg.seed,
            "method": self.method.describe(),
            "target_modules": self.runtime.target_modules,
            "head_params": self.runtime.head_params,
            "steps_per_round": self.runtime.steps_per_round,
        }
        for mod in ("transformers", "peft", "safetensors", "numpy"):
            try:
                env[mod] = __import__(mod).__version__
            except Exception:  # pragma: no cover
                pass
        atomic_write_text(self.run_dir / "environment.json", json.dumps(env, indent=1, default=str))

    def _summary(self, status: str, wall: float) -> dict[str, Any]:
        cfg, task = self.cfg, self.task
        evals = [h for h in self.history if any(k.startswith("eval/") for k in h)]
        final = {k[5:]: v for k, v in evals[-1].items() if k.startswith("eval/") and not k.startswith("eval/val_")} if evals else {}
        final_val = {k[9:]: v for k, v in evals[-1].items() if k.startswith("eval/val_")} if evals else {}
        key = f"eval/{task.primary_metric}"
        best = {}
        if evals and key in evals[-1]:
            pick = max if task.higher_is_better else min
            b = pick(evals, key=lambda h: h.get(key, -math.inf if task.higher_is_better else math.inf))
            best = {k[5:]: v for k, v in b.items() if k.startswith("eval/")} | {"round": b["round"]}
        n_up = sum(1 for r in self.ledger.records if r["direction"] == "up")
        n_down = sum(1 for r in self.ledger.records if r["direction"] == "down")
        rounds_done = len(self.history)
        return {
            "name": cfg.name,
            "task": cfg.task.name,
            "method": cfg.method.name,
            "setting": cfg.setting_label(),
            "seed": cfg.seed,
            "rounds": cfg.federation.rounds,
            "rounds_completed": rounds_done,
            "status": status,
            "primary_metric": task.primary_metric,
            "higher_is_better": task.higher_is_better,
            "final": final,
            **({"final_validation": final_val} if final_val else {}),
            "best": best,
            "bytes_up_total": self.ledger.total("up"),
            "bytes_down_total": self.ledger.total("down"),
            "bytes_up_per_client_round": self.ledger.total("up") / max(n_up, 1),
            "bytes_down_per_client_round": self.ledger.total("down") / max(n_down, 1),
            "wall_time": wall,
            "time_per_round": (sum(h.get("time_round", 0.0) for h in self.history) / rounds_done) if rounds_done else 0.0,
            "server_time_fraction": (
                sum(h.get("time_server", 0.0) for h in self.history) / max(sum(h.get("time_round", 0.0) for h in self.history), 1e-12)
            ),
        }

    # ------------------------------------------------------------------ loop
    def run(self) -> RunResult:
        cfg, fed = self.cfg, self.cfg.federation
        t_start = time.perf_counter()
        self.progress.start(fed.rounds, {"run_name": self.run_dir.name, "run_dir": str(self.run_dir), "method": cfg.method.name,
                                         "task": cfg.task.name, "start_round": self.start_round})
        atomic_write_text(self.run_dir / "summary.json", json.dumps(self._summary("running", self.wall_time_before), indent=1))
        try:
            for k in range(self.start_round, fed.rounds):
                self._round(k)
                wall = self.wall_time_before + time.perf_counter() - t_start
                if (k + 1) % cfg.output.checkpoint_every == 0 or k + 1 == fed.rounds:
                    save_checkpoint(self.run_dir, k + 1, self.state, {"wall_time": wall}, keep=cfg.output.keep_checkpoints)
            wall = self.wall_time_before + time.perf_counter() - t_start
            summary = self._summary("complete", wall)
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
            self.progress.finish(summary)
        except KeyboardInterrupt as exc:
            exc.run_dir = self.run_dir  # type: ignore[attr-defined]  # the CLI names it in "continue with ..."
            raise
        finally:
            self.progress.close()
            self.backend.close()
        return RunResult(self.run_dir, summary, self.history)

    def _round(self, k: int) -> None:
        cfg, fed = self.cfg, self.cfg.federation
        t0 = time.perf_counter()
        seed_k = round_seed(cfg.seed, k)
        client_recs: list[dict[str, Any]] = []
        t_clients = 0.0
        for attempt in range(fed.max_round_retries + 1):
            clients = sample_clients(cfg.seed, k, fed.num_clients, fed.clients_per_round, attempt)
            sizes = [len(self.runtime.parts[c]) for c in clients]
            weights = [s / sum(sizes) for s in sizes]
            self.progress.round_start(k, clients)
            rctx = RoundContext(k, fed.rounds, seed_k, clients, weights)
            bcast = self.method.broadcast(self.state, rctx)
            blob = encode(bcast)
            for c in clients:
                self.ledger.record(k + 1, c, "down", bcast, blob)
            jobs = [ClientJob(k, fed.rounds, c, seed_k) for c in clients]
            t1 = time.perf_counter()
            results = self.backend.run_clients(blob, jobs, self.progress)
            t_clients += time.perf_counter() - t1
            uploads, kept_w, kept_c = self._collect(k, attempt, rctx, results, weights, client_recs)
            if len(uploads) >= fed.min_clients:
                break
            self.progress.message(
                f"round {k + 1}: only {len(uploads)} valid upload(s) < federation.min_clients={fed.min_clients}"
                + ("; retrying with a new sample" if attempt < fed.max_round_retries else "")
            )
        else:
            self._append_round_logs(k, client_recs)  # keep the evidence of why the round failed
            first = next((r.get("error") for r in client_recs if "error" in r), None)
            raise RuntimeError(
                f"round {k + 1} failed {fed.max_round_retries + 1} time(s): fewer than {fed.min_clients} valid uploads "
                f"(first error: {first}); the last complete round is checkpointed — fix the cause and resume"
            )
        total = sum(kept_w)
        kept_w = [w / total for w in kept_w]
        rctx = RoundContext(k, fed.rounds, seed_k, kept_c, kept_w)
        self.state.meta["upload_keys"] = sorted(uploads[0].entries)

        t_server = time.perf_counter()
        applied = self.method.aggregate(self.state, uploads, kept_w, rctx)
        sync_diag = self.method.synchronize(self.state, uploads, kept_w, rctx)
        t_server = time.perf_counter() - t_server

        diag: dict[str, Any] = {"round": k + 1, **{f"{kk}": v for kk, v in sync_diag.items()}}
        t_diag = time.perf_counter()
        if cfg.diagnostics:
            diag.update(update_space_diagnostics(applied, self.method.rank))
            deltas = [self.method.client_deltas(self.state, u) for u in uploads]
            diag.update(drift_diagnostics(deltas, kept_w))
        t_diag = time.perf_counter() - t_diag

        t_eval, evals = 0.0, {}
        if (k + 1) % fed.eval_every == 0 or k + 1 == fed.rounds:
            t_eval = time.perf_counter()
            self.method.load_global(self.runtime.model, self.state)
            evals = self.task.evaluate(self.runtime.model, self.task.test_set(), fed.eval_batch_size)
            if self._validation is not None:  # held-out training examples: for model selection
                val = self.task.evaluate(self.runtime.model, self._validation, fed.eval_batch_size)
                evals.update({f"val_{kk}": v for kk, v in val.items()})
            t_eval = time.perf_counter() - t_eval
        losses = [r["loss_mean"] for r in client_recs if "loss_mean" in r and math.isfinite(r["loss_mean"])]
        rec = {
            "round": k + 1,
            "clients": clients,
            "dropped": [r["client"] for r in client_recs if "error" in r],
            "train_loss": sum(losses) / len(losses) if losses else float("nan"),
            **{f"eval/{kk}": float(v) for kk, v in evals.items()},
            "bytes_up": self.ledger.total("up", k + 1),
            "bytes_down": self.ledger.total("down", k + 1),
            "cum_bytes_up": self.ledger.total("up"),
            "cum_bytes_down": self.ledger.total("down"),
            "time_clients": t_clients,
            "time_server": t_server,
            "time_diagnostics": t_diag,
            "time_eval": t_eval,
            "time_round": time.perf_counter() - t0,
        }
        self.history.append(rec)
        self._append_round_logs(k, client_recs)
        append_jsonl(self.run_dir / "diagnostics.jsonl", diag)
        append_jsonl(self.run_dir / "metrics.jsonl", rec)
        self._write_csv()
        self.progress.round_end(k, rec)

    def _append_round_logs(self, k: int, client_recs: list[dict[str, Any]]) -> None:
        for r in client_recs:
            append_jsonl(self.run_dir / "clients.jsonl", r)
        for r in self.ledger.records:
            if r["round"] == k + 1:
                append_jsonl(self.run_dir / "ledger.jsonl", r)

    def _collect(self, k, attempt, rctx, results, weights, client_recs):
        """Decode, validate (and optionally clip) the uploads of one attempt."""
        fed = self.cfg.federation
        decoded = []
        for res in results:
            up = None
            if res.upload is not None:
                try:
                    up = decode(res.upload)
                except PayloadError as exc:
                    res.error = f"undecodable upload: {exc}"
                self.ledger.record(k + 1, res.client, "up", up if up is not None else Payload(), res.upload)
            decoded.append(up)
        keys = expected_keys(self.state, [u for u in decoded if u is not None])
        uploads, kept_w, kept_c = [], [], []
        for res, up, w in zip(results, decoded, weights):
            rec = {"round": k + 1, "attempt": attempt, "client": res.client, "time": res.time,
                   "num_examples": len(self.runtime.parts[res.client])}
            if up is not None and fed.client_timeout_s is not None and res.time > fed.client_timeout_s:
                # the sequential backend cannot preempt a client; a late upload is discarded
                res.error = f"timed out: {res.time:.1f}s > federation.client_timeout_s={fed.client_timeout_s:g}"
                up = None
            if up is not None:
                reason = validate_upload(self.method, self.state, up, rctx, keys, fed.max_update_norm)
                if reason is None and fed.clip_update_norm is not None:
                    norm = upload_norm(self.method, self.state, up)
                    if norm > fed.clip_update_norm:
                        up = self.method.scale_upload(up, fed.clip_update_norm / norm)
                        rec["clipped_from_norm"] = norm
                if reason is None:
                    uploads.append(up)
                    kept_w.append(w)
                    kept_c.append(res.client)
                    rec.update({kk: v for kk, v in up.meta.items() if isinstance(v, (int, float)) and kk != "client"})
                else:
                    res.error = f"rejected: {reason}"
                    for r in reversed(self.ledger.records):
                        if r["round"] == k + 1 and r["client"] == res.client and r["direction"] == "up":
                            r["rejected"] = reason
                            break
            if res.error is not None:
                rec["error"] = res.error.splitlines()[0]
                self.progress.message(f"round {k + 1}: client {res.client} dropped ({rec['error']})")
            client_recs.append(rec)
        return uploads, kept_w, kept_c

    def _write_csv(self) -> None:
        keys: list[str] = []
        for h in self.history:
            keys += [kk for kk in h if kk not in keys and kk not in ("clients", "dropped")]
        with open(self.run_dir / "metrics.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for h in self.history:
                w.writerow(h)


def run(cfg: FederatedConfig, *, resume: str | Path | None = None, progress: ProgressSink | None = None,
        task: Task | None = None, method: Method | None = None, run_dir: str | Path | None = None) -> RunResult:
    """Run (or, with ``resume=RUN_DIR``, continue) one federated run; returns its results.

    ``fedgalore.run(FederatedConfig(...))`` is the Python API behind ``fedgalore run``.
    """
    if resume is not None:
        return _resume(Path(resume), progress=progress, task=task, method=method, cfg=cfg)
    return Federation(cfg, run_dir=run_dir, progress=progress, task=task, method=method).run()


def _saved_summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _config_difference(run_dir: Path, cfg: FederatedConfig) -> str | None:
    """The first difference between ``run_dir``'s saved config and ``cfg`` (None: the same run;
    the progress display does not count)."""
    from omegaconf import OmegaConf

    from fedgalore.compare import _comparable, _first_difference

    try:
        old = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    except Exception:  # noqa: BLE001 - no or unreadable config: not this run
        return "no readable config.yaml"
    return _first_difference(_comparable(old), _comparable(cfg.to_dict()))


def _holds_this_run(run_dir: Path) -> str:
    s = _saved_summary(run_dir)
    done, total = s.get("rounds_completed", "?"), s.get("rounds", "?")
    if s.get("status") == "complete":
        final = " ".join(f"{k}={v:.4f}" for k, v in (s.get("final") or {}).items() if isinstance(v, float))
        return (f"{run_dir} already holds this run (complete, {done}/{total} rounds{': ' + final if final else ''}); "
                f"see it with `fedgalore report {run_dir}`, or set output.run_name=<new name> to run it again")
    return (f"{run_dir} already holds this run, stopped after round {done}/{total}; continue it with "
            f"`fedgalore run --resume {run_dir}`, or set output.run_name=<new name> to start over")


def extension_problem(cfg: FederatedConfig, rounds: int, completed: int) -> str | None:
    """Why a run configured as ``cfg`` (``completed`` rounds done) cannot be continued to
    ``rounds`` rounds with exactly the result of an uninterrupted ``rounds``-round run; None if it can.

    Only the learning-rate schedule depends on ``federation.rounds`` (sampling, round seeds and
    data order derive from (seed, round, client)). With ``train.schedule_scope=global`` the
    warm-up + decay spans all rounds, so the rounds already run used another schedule than a
    longer run would — unless the schedule is flat (``constant`` without warm-up).
    """
    t = cfg.train
    if rounds < completed:
        return f"it has already completed {completed} rounds (federation.rounds must be >= {completed})"
    if t.schedule_scope == "round" or (t.schedule == "constant" and t.warmup_ratio == 0):
        return None
    return (f"its learning-rate schedule (train.schedule={t.schedule}, train.warmup_ratio={t.warmup_ratio:g}, "
            f"train.schedule_scope=global) spans federation.rounds={cfg.federation.rounds}, so rounds 1-{completed} "
            f"differ from those of a {rounds}-round run")


def _extend_hint(run_dir: Path, cfg: FederatedConfig) -> str:
    """'; to extend that run instead: ...' when ``run_dir`` holds ``cfg`` with fewer rounds and
    continuing it is exact (:func:`extension_problem`); else ''."""
    from fedgalore.compare import _comparable, _first_difference
    from fedgalore.federated.config import load_config

    try:
        saved = load_config(run_dir / "config.yaml")
    except Exception:  # noqa: BLE001 - unreadable: no hint
        return ""
    rounds = cfg.federation.rounds
    done = int(_saved_summary(run_dir).get("rounds_completed", 0) or 0)
    if saved.federation.rounds >= rounds or extension_problem(saved, rounds, done) is not None:
        return ""
    saved.federation.rounds = rounds
    if _first_difference(_comparable(saved.to_dict()), _comparable(cfg.to_dict())) is not None:
        return ""
    return f"; to extend that run instead: fedgalore run --resume {run_dir} federation.rounds={rounds}"


def _resume(run_dir: Path, *, progress=None, task=None, method=None, cfg: FederatedConfig | None = None,
            rounds: int | None = None) -> RunResult:
    from fedgalore.federated.config import load_config

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); nothing to resume")
    saved = load_config(run_dir / "config.yaml")
    s = _saved_summary(run_dir)
    if rounds is not None and int(rounds) != saved.federation.rounds:
        if int(rounds) < 1:
            raise ConfigError(f"federation.rounds={rounds} must be >= 1")
        done = int(s.get("rounds_completed", 0) or 0)
        problem = extension_problem(saved, int(rounds), done)
        if problem is not None:
            again = " output.run_name=<new name>" if saved.output.run_name else ""
            raise ConfigError(
                f"cannot continue {run_dir} to {rounds} rounds exactly: {problem}. Start a {rounds}-round run instead "
                f"(fedgalore run --config {run_dir / 'config.yaml'} federation.rounds={rounds}{again}); runs meant to be "
                f"extended need train.schedule_scope=round, or train.schedule=constant with train.warmup_ratio=0"
            )
        saved.federation.rounds = int(rounds)
    elif s.get("status") == "complete":
        return RunResult(run_dir, s, read_jsonl(run_dir / "metrics.jsonl"))
    return Federation(saved, run_dir=run_dir, progress=progress, task=task, method=method, resume=True).run()


def resume(run_dir: str | Path, *, progress: ProgressSink | None = None, rounds: int | None = None) -> RunResult:
    """Continue a stopped run from its last complete round (a finished run is returned as is).

    ``rounds`` extends (or shortens) the run to that many rounds. It is allowed only when the
    result equals an uninterrupted run of ``rounds`` rounds, i.e. when the learning-rate schedule
    does not depend on the total (``train.schedule_scope=round``, or ``train.schedule=constant``
    with ``train.warmup_ratio=0``); otherwise :class:`ConfigError` says why and what to run
    instead (:func:`extension_problem`).
    """
    return _resume(Path(run_dir), progress=progress, rounds=rounds)
