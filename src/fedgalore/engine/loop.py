"""The round loop (paper §3 and Algorithm 1): sample → broadcast → T → collect → A → S → evaluate → checkpoint.

Nothing method-specific and no round feature lives here: a method supplies T (``client_update``),
A (``aggregate``) and S (``synchronize``); a backend decides where T runs; every feature that
changes a round — client- and record-level DP and their accountant, secure aggregation, robust
aggregation, a simulated attack, SCAFFOLD's controls, the server optimizer, the norm guard — is a
stage (:mod:`fedgalore.engine.stages`) composed from the config in one place and called at the
round's seams; the run directory's files are written by :mod:`fedgalore.records.rundir`. Per
round k (:meth:`Federation._round`):

1. K of the M clients are sampled uniformly without replacement from a per-round seed
   (or all of them), with weights p̃_i = N_i / Σ_{j∈P_k} N_j (the stages may change them, e.g.
   uniform under client-level DP, and hold sites back);
2. the server broadcasts the method's payload (and the round seed s_k), each client's message
   with the stages' own entries;
3. each client runs T; the collector (:mod:`fedgalore.engine.collect`) decodes each upload,
   counts it in the ledger, validates it and builds its dense deltas ΔW_i once, against the
   state the round started from, for whoever needs them — one typed
   :class:`~fedgalore.engine.stages.base.Attempt` of :class:`~fedgalore.engine.stages.base.
   Contribution` objects; a round with fewer than ``federation.min_clients`` valid uploads is
   retried with a new sample;
4. A (wrapped by the stages, e.g. a server optimizer) and S update the server state;
   diagnostics measure the two mismatches;
5. the global model is evaluated every ``eval_every`` rounds and after each of the last
   ``eval_last`` (with ``federation.client_eval`` also on each client's held-out share, every
   ``client_eval_every`` rounds, :mod:`fedgalore.engine.client_eval`) and the state is checkpointed (streamed to disk; the
   fsync, hash and rename overlap the next round).

The process holds the run directory's lock from the moment it is chosen to the end of the run,
keeps ``summary.json`` current (status, rounds done, pid, heartbeat) and records how the run
ended — complete, interrupted (Ctrl-C, SIGTERM) or failed (:mod:`fedgalore.records.liveness`).

Every random choice derives from (run seed, round, client) (:mod:`fedgalore.federated.seeding`),
so a run resumed from any checkpoint ends with exactly the metrics of an uninterrupted one.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgalore.engine.backends import Backend, make_backend
from fedgalore.engine.client_eval import evaluate_clients, summarize_clients
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.engine.events import LogProgress, ProgressSink, TrackingProgress, phase_note
from fedgalore.records.identity import run_identity
from fedgalore.records.liveness import FINISHED, Heartbeat, RunLock, Terminated, sigterm_stops
from fedgalore.job.resolve import check_device, config_for_method
from fedgalore.engine.round_adapters import save_round_adapter
from fedgalore.records.rundir import RunDirectory, choose_run_dir, run_summary
from fedgalore.engine.collect import Collector
from fedgalore.engine.jobs import ClientJob, ClientResult
from fedgalore.engine.runtime import Runtime
from fedgalore.engine.stages import Attempt, RunView, StopRun, backend_problems, compose
from fedgalore.federated.partitioners.nodes import NODES_ONLY
from fedgalore.federated.checkpoint import CheckpointError, CheckpointWriter, kept_rounds, load_latest_checkpoint
from fedgalore.federated.diagnostics import drift_diagnostics, update_space_diagnostics
from fedgalore.federated.seeding import round_seed, sample_clients
from fedgalore.methods.base import Method
from fedgalore.methods.traits import per_client_downlink_ops
from fedgalore.protocol.payload import Ledger, Payload, encode, encoded_size
from fedgalore.protocol.state import RoundContext
from fedgalore.tasks.base import Task

__all__ = ["Federation", "RunResult"]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final(self) -> dict[str, float]:
        return self.summary.get("final", {})


@dataclass
class _Round:
    """A round's collected uploads: the attempt that succeeded and the context A and S get."""

    ctx: RoundContext  # the clients whose uploads were kept, weights renormalised over them
    att: Attempt  # the kept uploads (att.kept), the round's client records, the stages' numbers
    time_clients: float

    @property
    def uploads(self) -> list[Payload]:
        return [item.upload for item in self.att.kept]


class Federation:
    """One federated run: config → run directory with metrics, ledger, diagnostics, checkpoints.

    ``backend``: where the clients train (default: ``make_backend(cfg.backend.name,
    cfg.backend.options)``); the loop starts it on its runtime and closes it at the end.
    ``task`` / ``method``: objects to use instead of building them from the config.
    """

    def __init__(
        self,
        cfg: FederatedConfig,
        *,
        run_dir: str | Path | None = None,
        progress: ProgressSink | None = None,
        task: Task | None = None,
        method: Method | None = None,
        backend: Backend | None = None,
        resume: bool = False,
    ) -> None:
        # method.options may hold options of several methods; this run keeps its method's own
        cfg = config_for_method(cfg.validate()) if method is None else cfg.validate()
        check_device(cfg.device)
        self.cfg = cfg
        self.progress = progress or LogProgress()
        identity = run_identity(cfg, task=task, method=method)  # what shapes this run (fedgalore.records.identity)
        # the directory is chosen before the slow model load
        self.files = RunDirectory(choose_run_dir(cfg, run_dir, resume, self.progress.message, identity))
        self.run_dir = self.files.path
        # the folders this call creates (never a resumed run's): removed again if the task, data or model
        # fails to build, so a run that never started leaves no empty run directory behind
        from fedgalore.records.rundir import discard_unstarted, missing_dirs

        created = [] if resume else missing_dirs(self.run_dir)
        # one process per run directory (fedgalore.records.liveness): locked before anything in it changes,
        # released when run() ends, or when this object is dropped without running
        self._lock = RunLock(self.run_dir)
        try:
            self._lock.acquire(self.progress.message)
            weakref.finalize(self, self._lock.release)
            self._setup(cfg, task, method, backend, resume)
        except BaseException:
            discard_unstarted(created, self._lock.release)  # releases the lock in every case
            raise

    def _setup(self, cfg: FederatedConfig, task: Task | None, method: Method | None, backend: Backend | None,
               resume: bool) -> None:
        """Everything after the directory is chosen and locked: backend, runtime (model and data),
        the server state (fresh, or the newest checkpoint's with ``resume``), the static files."""
        self.backend = backend if backend is not None else make_backend(cfg.backend.name, cfg.backend.options)
        backend_problems(cfg, self.backend)  # a stage this backend cannot run (e.g. SecAgg+ without Flower)
        nodes = None
        if cfg.federation.partition.kind == "nodes":  # each node brings its own data: ask them who they are
            nodes = self.backend.node_clients(cfg)
            if nodes is None:
                raise ConfigError(NODES_ONLY)
        self.runtime = Runtime(cfg, task=task, method=method, clients=nodes)
        cfg = self.cfg = self.runtime.cfg  # as it runs: a natural partition's federation.num_clients filled in
        self.task, self.method = self.runtime.task, self.runtime.method
        self._client_eval: dict[str, Any] | None = None  # the last evaluation's per-client record (client_eval)
        #: recorded after the build, which may have made a default input (e.g. the pretrained tiny ViT)
        self.identity = run_identity(self.runtime.recorded_cfg, task=task, method=method)  # sites by name as given
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backend.start(self.runtime)
        if self._downlink_mode() == "dense":
            self.progress.message(f"method {cfg.method.name}: a per-client (factored) downlink needs clients that keep "
                                  f"their model between rounds; the {self.backend.name} backend's do not, so every "
                                  "client receives the dense model (set method.options.downlink=dense to silence this)")
        for note in self.method.start_notes(cfg.train):
            self.progress.message(note)
        self._validation = self.runtime.validation_set()
        self.ledger = Ledger()
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self.wall_time_before = 0.0
        #: the loop's own state, checkpointed with the server state: the accepted upload key set
        self.upload_keys: list[str] | None = None
        ckpt = load_latest_checkpoint(self.run_dir, log=self.progress.message) if resume else None
        if ckpt is None:
            self.state = self.method.init_server_state(self.runtime.model)
            self.files.start_fresh()
        else:
            self.state, info = ckpt
            self.start_round = int(info["round"])
            self.wall_time_before = float(info.get("wall_time", 0.0))
            self.upload_keys = info.get("loop", {}).get("upload_keys")
            self.history, self.ledger.records = self.files.restore(self.start_round)
            self.progress.message(f"resuming {self.run_dir} after round {self.start_round}")
        partition = self.files.write_static(self.runtime.recorded_cfg, self.runtime, self.identity)
        if ckpt is None:  # the split's coverage (a label one site alone holds ...), before the first round
            for line in partition.get("warnings", []):
                self.progress.message(f"warning: {line}")
        #: the round's stages (fedgalore.engine.stages): the runtime's client side and the server's own, composed from the config
        view = RunView(self.run_dir, self.method, self.runtime, lambda line: self.progress.message(line))
        self.stages = compose(cfg, self.runtime, view, have=self.runtime.stages)
        collector = self.stages.collector or Collector
        self.collector = collector(cfg, self.method, self.runtime, self.backend, self.ledger, self.stages, view.say)
        #: why the run stopped before its last round (e.g. privacy.client.target_epsilon spent), or None
        self.stopped: str | None = None
        self.stages.start(self.state, ckpt is not None, self.start_round, cfg.federation.rounds)
        if self.backend.startup_records:  # e.g. SuperNodes whose data did not fit the task (kind nodes)
            self.files.append_round(0, self.backend.startup_records, Ledger())
        self._first_round_here = len(self.history)  # checkpoint_every=auto counts this process's rounds
        self._writer: CheckpointWriter | None = None  # run() makes it; the round waits on its pending checkpoint
        self._pending_rec: dict[str, Any] | None = None  # the round record whose checkpoint is still being written
        self._last_checkpoint = self.start_round  # the rounds the newest checkpoint holds

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        """Run the remaining rounds. ``summary.json`` is kept current (``running``, rewritten after
        every round and by a heartbeat in between) and ends ``complete``; Ctrl-C and SIGTERM end it
        ``interrupted``, an exception ``failed`` with its ``error`` line (fedgalore.records.liveness);
        either way the started checkpoint is finished and the run directory's lock released."""
        cfg, fed = self.cfg, self.cfg.federation
        t_start = time.perf_counter()
        self._lock.running = True
        self.progress = tracker = TrackingProgress(self.progress)  # where inside a round we are (status reads it)
        self.progress.start(fed.rounds, {"run_name": self.run_dir.name, "run_dir": str(self.run_dir), "method": cfg.method.name,
                                         "task": self.task.name, "start_round": self.start_round,
                                         "client_names": self.runtime.clients.names})
        heartbeat = Heartbeat(self.files.write_summary, extra=tracker.position)
        heartbeat.beat(self._summary("running", self.wall_time_before))
        heartbeat.start()
        writer = self._writer = CheckpointWriter(self.run_dir, keep=cfg.output.keep_checkpoints)
        status, detail = "failed", {}
        try:
            with sigterm_stops():  # SIGTERM: a clean stop, like Ctrl-C
                for k in range(self.start_round, fed.rounds):
                    try:
                        self._round(k)
                    except StopRun as stop:  # a stage ends the run inside a round (e.g. a retry past the privacy budget)
                        self.stopped = str(stop)
                        self.stages.stopped(self.state)
                        if k > self.start_round and not self._checkpointed(k):
                            self._checkpoint(k - 1, t_start)
                        self.progress.message(self.stopped)
                        break
                    if k + 1 < fed.rounds:  # a stage may stop the run before the next round (e.g. the privacy budget)
                        self.stopped = self.stages.next_round_stop(self.state, k + 1)
                    if self._checkpoint_due(k, t_start) or self.stopped:
                        self._checkpoint(k, t_start)
                    if self.stopped:
                        self.progress.message(self.stopped)
                        break
                    heartbeat.beat(self._summary("running", self.wall_time_before + time.perf_counter() - t_start))
                self._checkpoint_wait()  # the last checkpoint is durable before the run says it is complete
            heartbeat.stop()
            wall = self.wall_time_before + time.perf_counter() - t_start
            summary = self._summary(FINISHED, wall)
            self.files.write_summary(Heartbeat.stamp(summary))
            status = FINISHED
            self.progress.finish(summary)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
            if status != FINISHED:  # (a run already recorded finished stays so)
                status, detail = "interrupted", {"interrupted_by": "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"}
            exc.run_dir = self.run_dir  # type: ignore[attr-defined]  # the CLI names it in "continue with ..."
            raise
        except SystemExit as exc:  # a handler someone else installed (e.g. a Flower app's) ended the process
            if status != FINISHED:
                status, detail = "interrupted", {"interrupted_by": f"SystemExit({exc.code})"}
            raise
        except BaseException as exc:
            if status != FINISHED:
                status, detail = "failed", {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:500]}
            raise
        finally:
            heartbeat.stop()
            try:
                self.files.finish_static()  # partition.png, drawn beside round 1
            except Exception as exc:  # noqa: BLE001 - a figure that cannot be drawn does not fail a run
                self.progress.message(f"could not draw partition.png ({type(exc).__name__}: {exc})")
            try:
                writer.wait()  # an interrupted run still finishes the checkpoint it started
            except CheckpointError as exc:
                self.progress.message(str(exc))
            if status != FINISHED:
                wall = self.wall_time_before + time.perf_counter() - t_start
                kept = kept_rounds(self.run_dir)
                try:
                    self.files.write_summary(Heartbeat.stamp({**self._summary(status, wall), **detail,
                                                              "checkpointed_round": kept[-1] if kept else 0}))
                except OSError as exc:  # a full disk: the run still ends with its own error
                    self.progress.message(f"could not record the run's status in summary.json ({exc})")
            self._lock.release()
            self.progress.close()
            self.backend.close()
        return RunResult(self.run_dir, summary, self.history)

    def _checkpoint_due(self, k: int, t_start: float) -> bool:
        """Whether to checkpoint after round ``k``: after the last round always; every
        ``output.checkpoint_every`` rounds; or, with ``"auto"``, after the first round of this
        process (to measure the cost) and then whenever the time this process has spent in
        checkpoints, plus the last one's cost, stays within ``output.checkpoint_budget`` of its
        wall time — the cost is amortised over as many rounds as it takes (a resume repeats the
        rounds after the last checkpoint, with the same result)."""
        out = self.cfg.output
        if k + 1 == self.cfg.federation.rounds:
            return True
        if out.checkpoint_every != "auto":
            return (k + 1) % int(out.checkpoint_every) == 0
        costs = [h["time_checkpoint"] for h in self.history[self._first_round_here:] if "time_checkpoint" in h]
        if not costs:
            return True
        return sum(costs) + costs[-1] <= out.checkpoint_budget * (time.perf_counter() - t_start)

    def _checkpointed(self, rounds: int) -> bool:
        """Whether the state after ``rounds`` rounds is checkpointed (or being written)."""
        return self._last_checkpoint == rounds

    def _checkpoint(self, k: int, t_start: float) -> None:
        """Checkpoint the state after round ``k``: the metadata is snapshotted here; streaming the
        state's tensors, fsync, hash and rename run beside the next round's client training
        (:class:`CheckpointWriter` with ``defer_tensors``), which does not touch the server state;
        the next aggregation waits for it (:meth:`_checkpoint_wait`) before changing the state in
        place. The time this thread spent — here and waiting — is the round's ``time_checkpoint``
        (metrics.csv; summary ``time_checkpoint``)."""
        t0 = time.perf_counter()
        wall = self.wall_time_before + t0 - t_start
        self._last_checkpoint = k + 1
        self._writer.save(k + 1, self.state, {"wall_time": wall, "loop": {"upload_keys": self.upload_keys}}, defer_tensors=True)
        self._pending_rec = self.history[-1]
        self._pending_rec["time_checkpoint"] = time.perf_counter() - t0
        self.files.write_csv(self.history)

    def _checkpoint_wait(self) -> None:
        """Wait for the pending checkpoint (before the state changes in place, and before the run
        says it is complete); the wait counts as that checkpoint's ``time_checkpoint``."""
        if self._writer is None:
            return
        t0 = time.perf_counter()
        self._writer.wait()
        rec, self._pending_rec = self._pending_rec, None
        if rec is not None:
            rec["time_checkpoint"] += time.perf_counter() - t0
            self.files.write_csv(self.history)

    def _summary(self, status: str, wall: float) -> dict[str, Any]:
        out = run_summary(self.cfg, self.task, self.history, self.ledger, status, wall, self.identity)
        if self.stopped:
            out["stopped"] = self.stopped
        return out

    # ------------------------------------------------------------------ one round
    def _round(self, k: int) -> None:
        t0 = time.perf_counter()
        rnd = self._train_clients(k)  # sample → broadcast → T → collect (retried while too few uploads)
        self._checkpoint_wait()  # the last checkpoint has the state's tensors: done before A changes them
        t_diag = time.perf_counter()
        drift = self._drift(rnd)  # before A: factored deltas read the round's W, which A changes in place
        t_diag = time.perf_counter() - t_diag
        t_server = time.perf_counter()
        uploads = rnd.uploads
        applied = self.stages.aggregate(self.state, lambda: self.method.aggregate(self.state, uploads, rnd.ctx.weights, rnd.ctx))  # A
        self.stages.after_aggregate(self.state, rnd.att)
        sync_diag = self.method.synchronize(self.state, uploads, rnd.ctx.weights, rnd.ctx)  # S
        t_server = time.perf_counter() - t_server
        t1 = time.perf_counter()
        diag = {"round": k + 1, **sync_diag, **self._update_space(applied), **drift, **rnd.att.diag}
        t_diag += time.perf_counter() - t1
        evals, t_eval = self._evaluate(k)
        if self.cfg.export.every_round:  # this round's PEFT adapter (fedgalore.engine.round_adapters)
            save_round_adapter(self.runtime, self.state, self.run_dir, k + 1)
        client_recs = rnd.att.records
        losses = [r["loss_mean"] for r in client_recs if "loss_mean" in r and math.isfinite(r["loss_mean"])]
        rec = {
            "round": k + 1,
            "clients": rnd.att.clients,
            "dropped": [r["client"] for r in client_recs if "error" in r],
            "train_loss": sum(losses) / len(losses) if losses else float("nan"),
            **{f"eval/{kk}": float(v) for kk, v in evals.items()},
            "bytes_up": self.ledger.total("up", k + 1),
            "bytes_down": self.ledger.total("down", k + 1),
            "cum_bytes_up": self.ledger.total("up"),
            "cum_bytes_down": self.ledger.total("down"),
            "time_clients": rnd.time_clients,
            "time_server": t_server,
            "time_diagnostics": t_diag,
            "time_eval": t_eval,
            "time_round": time.perf_counter() - t0,
        }
        rec.update(self.stages.round_record(self.state, k, uploads))  # e.g. privacy.json and dp_epsilon
        if self._client_eval is not None:  # federation.client_eval: each client's metrics (fedgalore.engine.client_eval)
            rec["client_eval"], self._client_eval = self._client_eval, None
        if self.backend.eval_bytes:  # a deployment's federated evaluation: the model sent to the nodes, their replies
            rec["bytes_eval"], self.backend.eval_bytes = self.backend.eval_bytes, 0
        # what the server may record of the round (fedgalore.privacy.view): history, metrics, console, summary follow
        rec = self.runtime.view.round_record(rec)
        self.history.append(rec)
        self.files.append_round(k + 1, client_recs, self.ledger, diag, rec)
        self.files.write_csv(self.history)
        self.progress.round_end(k, rec)
        if len(self.history) == self._first_round_here + 1:  # after this process's first round: where did the time go
            note = phase_note(rec)
            if note:
                self.progress.message(note)

    def _train_clients(self, k: int) -> _Round:
        """Sample the round's clients, broadcast, run T on the backend and collect the valid
        uploads; a round with fewer than ``federation.min_clients`` is retried with a new sample
        (``federation.max_round_retries`` times, then the run stops at its last checkpoint)."""
        cfg, fed = self.cfg, self.cfg.federation
        seed_k = round_seed(cfg.seed, k)
        records: list[dict[str, Any]] = []  # the round's client records, over its attempts
        t_clients = 0.0
        for attempt in range(fed.max_round_retries + 1):
            clients = sample_clients(cfg.seed, k, fed.num_clients, fed.clients_per_round, attempt)
            sizes = [len(self.runtime.parts[c]) for c in clients]
            att = Attempt(k, attempt, clients, sizes, [s / sum(sizes) for s in sizes], records=records)
            try:
                self.stages.plan(att, self.state)  # weights, held-back sites, the budget
            except StopRun:
                if records:  # the earlier attempts' evidence (their releases are accounted)
                    self.files.append_round(k + 1, records, self.ledger)
                raise
            self.progress.round_start(k, clients)
            rctx = RoundContext(k, fed.rounds, seed_k, clients, att.weights, cfg.diagnostics, cfg.diagnostics_exact)
            blob = self._broadcast(k, rctx, att)
            jobs = [ClientJob(k, fed.rounds, c, seed_k) for c in clients if c not in att.held_back]
            t1 = time.perf_counter()
            results, summed = self.collector.run(blob, jobs, att, self.progress)  # T on the backend
            if att.held_back:  # in the sample's order, as dropped clients
                got = {r.client: r for r in results}
                results = [got.get(c) or ClientResult(c, None, att.held_back[c], 0.0) for c in clients]
            t_clients += time.perf_counter() - t1
            self.stages.observe(att, results, self.state)
            self.collector.collect(att, results, summed, self.state, rctx, self.upload_keys)
            self.stages.screen(att, self.state)  # e.g. robust aggregation drops or outvotes uploads
            if att.kept and len(att.kept_clients) >= fed.min_clients:
                self.stages.release(att, self.state)  # e.g. client-level DP's central noise
                total = sum(item.weight for item in att.kept)
                self.upload_keys = sorted(att.kept[0].upload.entries)
                ctx = RoundContext(k, fed.rounds, seed_k, att.kept_clients, [item.weight / total for item in att.kept],
                                   cfg.diagnostics, cfg.diagnostics_exact)
                return _Round(ctx, att, t_clients)
            self.progress.message(
                f"round {k + 1}: only {len(att.kept_clients)} valid upload(s) < federation.min_clients={fed.min_clients}"
                + ("; retrying with a new sample" if attempt < fed.max_round_retries else "")
            )
        self.files.append_round(k + 1, records, self.ledger)  # keep the evidence of why the round failed
        first = next((r.get("error") for r in records if "error" in r), None)
        raise RoundFailed(
            f"round {k + 1} failed {fed.max_round_retries + 1} time(s): fewer than {fed.min_clients} valid uploads "
            f"(first error: {first}); the run stops at its last checkpoint", k + 1, self.run_dir)

    def _downlink_mode(self) -> str | None:
        """How a method's per-client (factored) downlink runs on this backend: ``replay`` (the
        clients keep their model and are sent the message the ledger counts), ``account`` (a
        simulation: clients are handed the dense model, the ledger counts what a client that kept
        its last model would receive), ``dense`` (a deployment whose clients keep nothing: dense is
        sent and counted); None when the method's downlink is the same for every client."""
        if not self.method.run_traits.per_client_downlink:
            return None
        if self.backend.keeps_client_state:
            return "replay"
        return "account" if self.backend.simulated else "dense"

    def _broadcast(self, k: int, rctx: RoundContext, att: Attempt) -> bytes | Payload | dict[int, bytes | Payload]:
        """The round's broadcast, serialised (an :attr:`~Backend.in_process` backend gets the
        payloads themselves and the ledger their exact encoded size) and counted per client. A method with a
        per-client downlink (``client_broadcast(state, ctx, common, held)``, e.g. FedGaLore's
        factored chain, fedgalore.protocol.downlink) builds each client's message from the version
        of the model that client holds: its own store's (``replay``) or the server's record of what
        it sent it (``account``; :meth:`_downlink_mode`); the ledger counts that message. The
        backend gets the messages themselves (``replay``, and SCAFFOLD's per-client c − c_i) or,
        in an ``account`` simulation, the dense broadcast, which yields the same model."""
        bcast = self.stages.broadcast(self.method.broadcast(self.state, rctx), self.state)  # e.g. the round's DP clip norm
        att.reference = bcast  # what the clients started from: client-level DP's public reference
        ops = per_client_downlink_ops(self.method)  # None: every client gets bcast
        per_client = None if ops is None else ops.client_broadcast
        mode = self._downlink_mode()
        if mode == "replay":
            held = self.backend.client_versions(self.method, rctx.clients)
        elif mode == "account":
            held = ops.held_versions(self.state, rctx.clients)
        else:
            held = {}
        by_held: dict[int | None, Payload] = {}  # a message depends on the held version only: built once per version

        def message(c: int) -> Payload:
            h = held.get(c)
            if h not in by_held:
                by_held[h] = per_client(self.state, rctx, bcast, h)
            return by_held[h]

        msgs = {c: message(c) if per_client is not None else bcast for c in rctx.clients}
        if mode in ("replay", "account"):
            ops.downlink_sent(self.state, rctx.clients)
        # a stage's per-client entries (e.g. SCAFFOLD's c − c_i), counted down
        msgs = {c: self.stages.message(m, c, self.state) for c, m in msgs.items()}
        train = msgs if mode != "account" else {c: self.stages.message(bcast, c, self.state) for c in rctx.clients}
        in_process = self.backend.in_process
        blob_of: dict[int, Any] = {}  # encode (or size) each distinct message once

        def blob(m: Payload) -> bytes | Payload:
            if id(m) not in blob_of:
                blob_of[id(m)] = m if in_process else encode(m)
            return blob_of[id(m)]

        size_of: dict[int, int] = {}

        def size(m: Payload) -> int:
            if id(m) not in size_of:
                size_of[id(m)] = encoded_size(m) if in_process else len(blob(m))
            return size_of[id(m)]

        for c in rctx.clients:
            self.ledger.record(k + 1, c, "down", msgs[c], size(msgs[c]))
        if all(m is bcast for m in train.values()):
            return blob(bcast)
        return {c: blob(m) for c, m in train.items()}

    def _update_space(self, applied: dict[str, Any]) -> dict[str, float]:
        """The update-space mismatch of the applied update (``diagnostics: true``; from its factors
        unless ``diagnostics_exact``: fedgalore.federated.diagnostics)."""
        if not self.cfg.diagnostics:
            return {}
        return update_space_diagnostics(applied, self.method.rank, exact=self.cfg.diagnostics_exact)

    def _drift(self, rnd: _Round) -> dict[str, float]:
        """The client drift of the round's deltas (``diagnostics: true``), computed before A."""
        if not self.cfg.diagnostics or self.stages.hides_clients:  # e.g. privacy.client: it would read raw uploads
            return {}
        return drift_diagnostics([item.delta for item in rnd.att.kept], rnd.ctx.weights)

    def _evaluate(self, k: int) -> tuple[dict[str, float], float]:
        """The global model's test (and validation) metrics, every ``eval_every`` rounds, after
        each of the last ``eval_last`` rounds and at the end; its per-client metrics every
        ``client_eval_every`` rounds and at the end (default: with every evaluation); and the
        seconds they took."""
        fed = self.cfg.federation
        pooled = (k + 1) % fed.eval_every == 0 or k + 1 == fed.rounds or k + 1 > fed.rounds - fed.eval_last
        clients = pooled if fed.client_eval_every is None else ((k + 1) % fed.client_eval_every == 0 or k + 1 == fed.rounds)
        if not (pooled or clients):
            return {}, 0.0
        t0 = time.perf_counter()
        self.method.load_global(self.runtime.model, self.state)
        evals: dict[str, float] = {}
        test = self.task.test_set()  # empty on a nodes deployment's server without a test file of its own
        if pooled and len(test):
            evals = self.task.evaluate(self.runtime.model, test, fed.eval_batch_size)
        if pooled and self._validation is not None:  # held-out training examples: for model selection
            val = self.task.evaluate(self.runtime.model, self._validation, fed.eval_batch_size)
            evals.update({f"val_{kk}": v for kk, v in val.items()})
        per = None
        if clients and self.runtime.clients.test_parts is not None:  # each client's held-out share (federation.client_eval)
            per = evaluate_clients(self.task, self.runtime.model, self.runtime.train_data, self.runtime.clients,
                                   fed.eval_batch_size)
        elif clients:  # a deployment whose nodes evaluate on their own test data (kind nodes)
            per = self.backend.evaluate_clients(self.runtime, fed.eval_batch_size)
        if per:
            summary, worst = summarize_clients(per, self.task.primary_metric, self.task.higher_is_better)
            evals.update(summary)
            self._client_eval = {"worst_client": worst, "clients": per}
        return evals, time.perf_counter() - t0


class RoundFailed(RuntimeError):
    """A round got fewer than ``federation.min_clients`` valid uploads in each of its
    ``federation.max_round_retries + 1`` attempts: the run stops (``summary.json``: ``failed``, this
    line its ``error``) and keeps its last checkpoint. ``round``: the 1-based round that failed;
    ``run_dir``: the run's directory (the ``fedgalore`` command names it in its one line)."""

    def __init__(self, message: str, round: int, run_dir: Path) -> None:  # noqa: A002
        super().__init__(message)
        self.round, self.run_dir = int(round), Path(run_dir)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (an exception crossing a process boundary)
        return type(self), (str(self), self.round, self.run_dir)

    def advice(self) -> str:
        """One line: what failed, which checkpoint is kept and the command that continues the run."""
        kept = kept_rounds(self.run_dir)
        where = (f"its checkpoint of round {kept[-1]} is kept in {self.run_dir}" if kept
                 else f"{self.run_dir} holds no checkpoint yet, so resuming starts again at round 1")
        return (f"{str(self).removesuffix('; the run stops at its last checkpoint')}; the run stopped: {where}; "
                f"fix the cause, then continue with: fedgalore run --resume {self.run_dir}")
