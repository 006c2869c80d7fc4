"""A site with several devices (``train.devices_per_client = N``): one client's local steps run by N processes.

Data parallel, with the gradient torch's ``DistributedDataParallel`` computes. Each optimizer step's
batch (its ``k`` micro-batches, :mod:`fedgalore.federated.client`) is cut into N contiguous row
shards. Rank ``i`` runs forward and backward on shard ``i`` of every micro-batch, and one all-reduce
per step sums the gradients across ranks (gloo on CPU, NCCL on CUDA). Every rank then holds

    ∇L = Σ_j Σ_i (n_ji / n) ∇L_ji,    n = Σ_j Σ_i n_ji,

where ``L_ji`` is the mean loss of shard ``i`` of micro-batch ``j`` over its ``n_ji`` loss terms (rows,
or the task's ``loss_items``: a causal LM's response tokens). Since ``Σ_i n_ji L_ji = n_j L_j``, this is
the single process's accumulated gradient (client.py's rule) to float rounding.

Every rank then runs the same end of step: FedProx's term, gradient clipping, the optimizer and
SCAFFOLD's correction, on the same gradient and from the same state. So the replicas stay equal,
and rank 0 ends the round with the update one process would have made. Rank 0 is the client's own
process: the sequential backend's, a Ray actor, or a Flower ClientApp. It keeps the model and the
optimizer, and the method uploads from it as before. GaLore's bases are the same on every rank
(seeded bases; the RSVD sketch is seeded too; SVD is deterministic), so no GaLore state needs to
travel between ranks. What a rank holds of GaLore is what one process holds: the state is
replicated, not sharded.

Ranks 1..N−1 are helper processes. Rank 0 spawns them the first time it trains with N devices and
keeps them for the life of the process (:func:`site_workers`). A client-round sends the helpers:

* the model, the optimizer with its warm state, the trainable parameters' identities and
  SCAFFOLD's client state, in one pickle;
* the loss function, only when it changed;
* per step, the helper's shards, the step's loss-term count and the learning-rate factor.

Checkpoints and resume are rank 0's as before: the helpers keep nothing between client-rounds.

Deviations from torch's DDP, which this does not wrap the model in:

* The all-reduce runs once after the step's backward passes (one flat buffer per dtype) instead of
  overlapping them bucket by bucket. The sum is the same; the overlap is a GPU speed-up not built
  here.
* Shards are weighted by their loss terms, so a batch that N does not divide, or uneven response
  tokens, gives the exact mean instead of DDP's mean of shard means.
* Dropout draws differ from the single process's. Each rank has its own generator, seeded from the
  client's seed and the rank. Updates equal to one process's need a model without dropout, as with
  DDP.

Not supported, refused when the config is checked (:func:`devices_problem`):

* Record-level DP-SGD (``privacy.record``). Opacus clips per example inside one process; across
  ranks it needs its own DP-DDP wrapper.
With ``train.shard_params: true`` the ranks do not hold replicas: each trains its shard of a copy
of the client's model (FSDP2), GaLore's state sharded with it, and rank 0 writes the gathered
result into the client's model and optimizer at the round's end
(:mod:`fedgalore.federated.sharded_site`, which also says where the whole model lives). Then the
site needs this process's default ``torch.distributed`` group (FSDP2's device mesh is built on
it; one sharded site per process), and a rank that fails ends the site: its collectives cannot be
met half-way, so rank 0 stops every helper and raises, and the next client-round starts new ones.
"""
from __future__ import annotations

import io
import math
import sys
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["SiteWorkers", "site_workers", "rank_devices", "shard_batch", "devices_problem"]

#: seconds a collective waits for a rank before it fails (a helper that died is seen sooner: its socket closes)
TIMEOUT_S = 1800.0
_SITES: dict[tuple[int, str, Optional[int]], "SiteWorkers"] = {}


def devices_problem(devices: int, record_dp: bool, device: str) -> Optional[str]:
    """Why ``train.devices_per_client = devices`` cannot run with this config (``None``: it can)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return f"train.devices_per_client={devices!r} must be an int >= 1 (processes that train one client; 1 = one process)"
    if devices == 1:
        return None
    if record_dp:
        return (f"train.devices_per_client={devices} with privacy.record: DP-SGD clips per example inside one process "
                "(Opacus); set train.devices_per_client=1 for record-level DP")
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        return f"train.devices_per_client={devices} runs on cpu (gloo) or cuda (NCCL), not on device={device!r}"
    return None


def rank_devices(n: int, device: torch.device) -> list[torch.device]:
    """The device of each rank: ``cpu`` for all on the CPU, else ``cuda:d … cuda:d+N−1`` from the
    client's own device ``cuda:d``."""
    if device.type == "cpu":
        return [torch.device("cpu")] * n
    if device.type != "cuda":
        raise ValueError(f"train.devices_per_client={n} runs on cpu or cuda, not {device.type}")
    first = torch.cuda.current_device() if device.index is None else int(device.index)
    have = torch.cuda.device_count()
    if first + n > have:
        raise ValueError(f"train.devices_per_client={n} from {device} needs GPUs {first}..{first + n - 1}; "
                         f"this machine has {have} (lower train.devices_per_client)")
    return [torch.device("cuda", first + i) for i in range(n)]


def shard_batch(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``n`` contiguous row shards (``torch.tensor_split`` along dim 0; the first
    ``rows mod n`` shards are one row longer). A shard with no rows is ``{}``."""
    if not batch:
        return [{} for _ in range(n)]
    rows = {int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(rows) != 1:
        raise ValueError(f"train.devices_per_client={n}: a batch's tensors must share their first (row) dimension "
                         f"to be split across devices; got first dimensions {sorted(rows)} for keys {sorted(batch)}")
    parts = {k: torch.tensor_split(v, n) for k, v in batch.items()}
    out = []
    for i in range(n):
        shard = {k: p[i] for k, p in parts.items()}
        out.append(shard if int(next(iter(shard.values())).shape[0]) > 0 else {})
    return out


def _group(backend: str, store: Any, rank: int, n: int, timeout: timedelta) -> Any:
    """A process group of its own (not torch's default group: the client's process may have one)."""
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, n)
    return dist.ProcessGroupGloo(store, rank, n, timeout)


_DEFAULT_TAKEN = ("train.shard_params=true needs this process's default torch.distributed group for the site's device "
                  "mesh, but one is set up already (this process runs under torchrun or init_process_group); set "
                  "train.shard_params: false, or shard in your own loop (fedgalore.optim.sharded)")


def _mesh(backend: str, store: Any, rank: int, n: int, timeout: timedelta, device: torch.device) -> Any:
    """A sharded site's device mesh: this process's default group over the site's ranks (FSDP2 builds
    its mesh on a registered group), set up on the site's store."""
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        raise RuntimeError(_DEFAULT_TAKEN)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("fedgalore-site-mesh/", store), rank=rank, world_size=n,
                            timeout=timeout)
    return DeviceMesh.from_group(dist.group.WORLD, device.type)


def _reduce_stats(pg: Any, stats: list[float], device: torch.device) -> list[float]:
    """``stats`` summed over the site's ranks (fp64)."""
    t = torch.tensor(stats, dtype=torch.float64)
    if device.type == "cuda":
        t = t.to(device)
    pg.allreduce([t]).wait()
    return [float(x) for x in t.cpu()]


def _backward_shards(model: nn.Module, loss_fn: Callable[..., torch.Tensor], shards: Sequence[dict[str, torch.Tensor]],
                     counts: Sequence[int], n_total: int, device: torch.device) -> list[float]:
    """This rank's part of a step: ``(n_ji / n) L_ji`` backpropagated for each of its shards; returns
    ``n_ji · L_ji`` per micro-batch (0 for an empty shard)."""
    sums = []
    for shard, n in zip(shards, counts):
        if n == 0 or not shard:
            sums.append(0.0)
            continue
        loss = loss_fn(model, {k: v.to(device) for k, v in shard.items()})
        value = float(loss.detach())
        (loss * (n / n_total)).backward()
        sums.append(n * value)
    return sums


def _all_reduce(pg: Any, params: Sequence[torch.Tensor], stats: list[float], sizes: Optional[Sequence[int]] = None,
                device: Optional[torch.device] = None) -> list[float]:
    """Sum every rank's gradients of ``params`` and its ``stats`` (fp64) across the group, in place.

    One flat fp32 buffer for the gradients (bf16 / fp16 gradients are summed in fp32 and rounded
    back) and one for the stats, which end with a has-gradient flag per parameter: a parameter no
    rank gave a gradient keeps ``grad = None``, as in one process (its optimizer skips it). A rank
    without a replica (its job failed) passes ``params=[]`` and the parameters' ``sizes``: it adds zeros."""
    if sizes is not None and not params:  # zeros of the right shapes, so the collective still matches
        flat = torch.zeros(int(sum(sizes)), device=device)
        extra = torch.tensor(list(stats) + [0.0] * len(sizes), dtype=torch.float64)
        if flat.device.type == "cuda":
            extra = extra.to(flat.device)
        pg.allreduce([flat]).wait()
        pg.allreduce([extra]).wait()
        return [float(x) for x in extra.cpu()[:len(stats)]]
    have = [p.grad is not None for p in params]
    dev = params[0].device if params else torch.device("cpu")
    flat = torch.cat([(p.grad.detach().float() if p.grad is not None else torch.zeros(p.numel(), device=dev)).reshape(-1)
                      for p in params]) if params else torch.zeros(0)
    extra = torch.tensor(list(stats) + [float(h) for h in have], dtype=torch.float64)
    if flat.device.type == "cuda":
        extra = extra.to(flat.device)
    pg.allreduce([flat]).wait()
    pg.allreduce([extra]).wait()
    extra = extra.cpu()
    offset = 0
    for i, p in enumerate(params):
        chunk = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if float(extra[len(stats) + i]) <= 0:
            p.grad = None
        elif p.grad is None:
            p.grad = chunk.to(p.dtype).clone()
        else:
            p.grad.copy_(chunk)
    return [float(x) for x in extra[:len(stats)]]


class SiteWorkers:
    """Ranks 1..N−1 of a site with N devices, and the process group rank 0 (this process) shares with
    them (module doc). Built by :func:`site_workers`; one per (N, device) in a process."""

    def __init__(self, n: int, device: torch.device, timeout_s: float = TIMEOUT_S, sharded: bool = False) -> None:
        if n < 2:
            raise ValueError(f"SiteWorkers needs at least 2 ranks, got {n}")
        if sharded and dist.is_initialized():  # checked before any helper starts
            raise RuntimeError(_DEFAULT_TAKEN)
        self.n = n
        self.sharded = sharded
        self.devices = rank_devices(n, device)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, n, True, timeout, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._queues = [ctx.Queue() for _ in range(n - 1)]
        self._errors = ctx.Queue()
        self._procs = [
            ctx.Process(target=_helper_main, name=f"fedgalore-site-rank{i}", daemon=True,
                        args=(i, n, self._store.port, self.backend, str(self.devices[i]), torch.get_num_threads(), q,
                              self._errors, timeout_s, sharded))
            for i, q in enumerate(self._queues, start=1)
        ]
        for p in self._procs:
            p.start()
        self._pg = _group(self.backend, self._store, 0, n, timeout)
        self._mesh = _mesh(self.backend, self._store, 0, n, timeout, self.devices[0]) if sharded else None
        #: the default group this site set up (released once, by whoever stops the site first)
        self._owned = [dist.group.WORLD] if sharded else []
        self._loss_owner: Any = None
        self._copy: Any = None  # sharded: rank 0's ShardedCopy of this client-round
        #: sharded on a GPU: the client's model, waiting on the host, and the device it goes back to
        self._away: Optional[tuple[nn.Module, torch.device]] = None
        self.broken = False
        weakref.finalize(self, _shutdown, self._queues, self._procs, self._owned)

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self._procs)

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Any],
              params: Sequence[torch.Tensor], scaffold: Any, prox_mu: float, grad_clip: Optional[float], seed: int) -> Any:
        """Send this client-round's job: the helpers build their replicas from it. Sharded: every rank
        builds its shard of a copy, and rank 0's is returned (a
        :class:`fedgalore.federated.sharded_site.ShardedCopy`, which rank 0 then trains instead of
        ``model``); else ``None``."""
        owner = getattr(loss_fn, "__self__", loss_fn)
        if owner is not self._loss_owner:  # a task holds its data: sent once, not every round
            self._broadcast(("loss", _dumps(loss_fn)))
            self._loss_owner = owner
        job = {"model": model, "optimizer": optimizer, "params": list(params), "scaffold": scaffold,
               "prox_mu": float(prox_mu), "grad_clip": grad_clip, "seed": int(seed)}
        if not self.sharded:
            self._broadcast(("job", _dumps(job)))
            return None
        from fedgalore.federated.sharded_site import shard_job

        named = {id(p): n for n, p in model.named_parameters()}
        missing = [i for i, p in enumerate(params) if id(p) not in named]
        if missing:
            raise ValueError(f"train.shard_params=true: trainable tensors {missing} are not parameters of the client's "
                             "model; a sharded site trains the model's own parameters")
        job["names"] = [named[id(p)] for p in params]
        data = _dumps(job)
        self._broadcast(("job", data))
        home = next((p.device for p in model.parameters()), torch.device("cpu"))
        if home.type == "cuda":  # the whole model waits on the host while the shards train (sharded_site's doc)
            self._away = (model, home)
            model.to("cpu")
        try:
            mine = _loads(data, torch.device("cpu"))
            self._copy = shard_job(mine["model"], mine["optimizer"], mine["params"], mine["names"], self._mesh)
        except BaseException:
            self._fail()
            self._come_back()
            raise
        return self._copy

    def _come_back(self) -> None:
        """The client's model back on its device (sharded on a GPU)."""
        if self._away is not None:
            model, home = self._away
            self._away = None
            model.to(home)

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Sharded: the round trained; gather the copy into the client's ``model`` and ``optimizer``
        (every rank takes part). Data parallel: nothing to do (rank 0 trained ``model`` itself)."""
        if not self.sharded or self._copy is None:
            return
        from fedgalore.federated.sharded_site import gather_back

        self._broadcast(("gather",))
        self._come_back()
        try:
            gather_back(self._copy, model, optimizer)
        except BaseException as exc:
            self._fail()
            raise RuntimeError(f"train.devices_per_client={self.n}: gathering the sharded model failed ({exc})"
                               f"{self._helper_errors()}") from exc
        finally:
            self._copy = None

    def step(self, loss_fn: Callable[..., Any], micro_batches: Sequence[dict[str, torch.Tensor]], model: nn.Module,
             params: Sequence[torch.Tensor], factor: float, counter: Callable[[dict[str, torch.Tensor]], int]
             ) -> tuple[list[float], list[int], int]:
        """Forward/backward of one optimizer step across the ranks; on return every rank's
        ``params`` hold the summed gradient. Returns each micro-batch's loss (the mean over its
        loss terms; ``nan`` when a rank's was not finite), its loss-term count, and the step's total."""
        shards = [shard_batch(b, self.n) if b else [{} for _ in range(self.n)] for b in micro_batches]
        counts = [[counter(s[i]) if s[i] else 0 for i in range(self.n)] for s in shards]
        n_total = sum(sum(c) for c in counts)
        if self.sharded:
            return self._sharded_step(loss_fn, micro_batches, shards, counts, n_total, factor, counter)
        sizes = [p.numel() for p in params]
        for i, q in enumerate(self._queues, start=1):
            q.put(("step", float(factor), [s[i] for s in shards], [c[i] for c in counts], n_total, sizes))
        try:
            own = _backward_shards(model, loss_fn, [s[0] for s in shards], [c[0] for c in counts], max(n_total, 1),
                                   self.devices[0]) if n_total else [0.0] * len(shards)
        except BaseException:  # the helpers wait in this step's all-reduce: meet them there, flagged, then fail
            try:
                _all_reduce(self._pg, [], [1.0] + [0.0] * len(shards), sizes, self.devices[0])
            except Exception:
                self.broken = True
            for p in params:
                p.grad = None
            raise
        try:
            stats = _all_reduce(self._pg, params, [0.0] + own)
        except Exception as exc:
            self.broken = True
            raise RuntimeError(f"train.devices_per_client={self.n}: the all-reduce failed ({exc}){self._helper_errors()}") from exc
        if stats[0] > 0:
            self.broken = True
            raise RuntimeError(f"train.devices_per_client={self.n}: a helper rank failed{self._helper_errors()}")
        per = [sum(c) for c in counts]
        values = [(s / m if math.isfinite(s) else float("nan")) if m else 0.0 for s, m in zip(stats[1:], per)]
        return values, per, n_total

    def _sharded_step(self, loss_fn: Callable[..., Any], micro_batches: Sequence[dict[str, torch.Tensor]],
                      shards: list, counts: list, n_total: int, factor: float,
                      counter: Callable[[dict[str, torch.Tensor]], int]) -> tuple[list[float], list[int], int]:
        """:meth:`step` on the shards of a copy (:mod:`fedgalore.federated.sharded_site`): FSDP2 sums
        the gradients into each rank's blocks; one all-reduce of the losses and a failure flag."""
        from fedgalore.federated.sharded_site import backward_shards, fillers

        per = [sum(c) for c in counts]
        fill = fillers(micro_batches, counts, counter)
        for i, q in enumerate(self._queues, start=1):
            q.put(("step", float(factor), [s[i] for s in shards], [c[i] for c in counts], n_total, per, fill))
        try:
            own = backward_shards(self._copy.model, loss_fn, [s[0] for s in shards], [c[0] for c in counts], per,
                                  max(n_total, 1), self.n, fill, self.devices[0]) if n_total else [0.0] * len(shards)
            stats = _reduce_stats(self._pg, [0.0] + own, self.devices[0])
        except BaseException as exc:  # a rank failed inside FSDP's collectives: nothing to meet half-way
            errors = self._helper_errors(wait=0.2)
            self._fail()
            if errors:
                raise RuntimeError(f"train.devices_per_client={self.n}: a helper rank failed{errors}") from exc
            raise
        if stats[0] > 0:
            errors = self._helper_errors()
            self._fail()
            raise RuntimeError(f"train.devices_per_client={self.n}: a helper rank failed{errors}")
        values = [(s / m if math.isfinite(s) else float("nan")) if m else 0.0 for s, m in zip(stats[1:], per)]
        return values, per, n_total

    def _fail(self) -> None:
        """A sharded site after a failure: stop the helpers and release the default group."""
        self.broken = True
        self._copy = None
        _shutdown(self._queues, self._procs, self._owned, hard=True)

    def end(self) -> None:
        """The client-round is over: the helpers drop their replicas."""
        self._copy = None
        self._come_back()  # a round that failed before gathering: the model as it was, on its device
        if not self.broken:
            self._broadcast(("end",))

    def _broadcast(self, msg: tuple) -> None:
        for q in self._queues:
            q.put(msg)

    def _helper_errors(self, wait: float = 1.0) -> str:
        texts = []
        while True:
            try:
                texts.append(self._errors.get(timeout=wait))
            except Exception:
                break
        dead = [p.name for p in self._procs if not p.is_alive()]
        # the helper's own error first (a client's error record keeps its first line), then the tracebacks
        last = [t.strip().splitlines()[-1] for t in texts if t.strip()]
        out = (f": {last[-1]}" if last else "") + "".join(f"\n{t}" for t in texts)
        return out + (f"\n(helper processes no longer running: {', '.join(dead)})" if dead else "")


def site_workers(n: int, device: torch.device, sharded: bool = False) -> SiteWorkers:
    """The helpers of a site with ``n`` devices in this process, started on first use and kept
    (started again if one died or a collective failed). One sharded site per process (it holds the
    default group): another sharded one stops it first."""
    key = (n, device.type, device.index, bool(sharded))
    w = _SITES.get(key)
    if w is None or not w.alive():
        if w is not None:
            _shutdown(w._queues, w._procs, w._owned, hard=w.broken)
        if sharded:
            for k in [k for k, v in _SITES.items() if v.sharded and k != key]:
                other = _SITES.pop(k)
                _shutdown(other._queues, other._procs, other._owned)
        w = _SITES[key] = SiteWorkers(n, device, sharded=sharded)
    return w


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes, device: torch.device) -> Any:
    """A pickle from rank 0, its CUDA tensors on this rank's device (CPU tensors stay on the CPU)."""
    def where(storage: Any, location: str) -> Any:
        return storage.cuda(device.index) if location.startswith("cuda") else storage
    return torch.load(io.BytesIO(data), map_location=where if device.type == "cuda" else "cpu", weights_only=False)


def _shutdown(queues: Sequence[Any], procs: Sequence[Any], owned: Optional[list] = None, hard: bool = False) -> None:
    """Stop the helpers (``hard``: at once, they may wait in a collective) and release the default
    group a sharded site set up (``owned``: ``[group]``, emptied; a later site's group is not touched)."""
    if not hard:
        for q in queues:
            try:
                q.put(("stop",))
            except Exception:
                pass
    for p in procs:
        if hard and p.is_alive():
            p.terminate()
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    if owned:
        group = owned.pop()
        if dist.is_initialized() and dist.group.WORLD is group:
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _report(errors: Any, rank: int) -> None:
    """A helper's failure, for rank 0's error message (and this process's stderr)."""
    text = f"rank {rank}: {traceback.format_exc(limit=6)}"
    print(text, file=sys.stderr, flush=True)
    errors.put(text)


def _helper_main(rank: int, n: int, port: int, backend: str, device: str, threads: int, inbox: Any, errors: Any,
                 timeout_s: float, sharded: bool = False) -> None:
    """Rank ``rank``'s loop: build a replica per job, run its shards each step, stop on ``stop``."""
    from fedgalore.federated.step_end import _set_lr, end_of_step  # the same rules as rank 0

    torch.set_num_threads(max(1, int(threads)))
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, n, False, timeout)
    pg = _group(backend, store, rank, n, timeout)
    if sharded:
        _sharded_helper(rank, n, pg, _mesh(backend, store, rank, n, timeout, dev), dev, inbox, errors)
        return
    loss_fn: Any = None
    job: Optional[dict[str, Any]] = None
    failed = False
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "stop":
            return
        try:
            if kind == "loss":
                loss_fn = _loads(msg[1], dev)
            elif kind == "job":
                job, failed = _loads(msg[1], dev), False
                job["model"].to(dev)
                params = job["params"]
                job["anchor"] = [p.detach().clone() for p in params] if job["prox_mu"] > 0 else None
                gen_seed = (int(job["seed"]) * 1000003 + rank) % (1 << 63)
                torch.manual_seed(gen_seed)  # this rank's dropout draws (module doc)
                job["model"].train()
            elif kind == "end":
                job = None
                continue
        except Exception:
            _report(errors, rank)
            failed = True
            if kind != "step":
                continue
        if kind != "step":
            continue
        _, factor, shards, counts, n_total, sizes = msg
        own = [0.0] * len(shards)
        if not failed and job is not None:
            try:
                _set_lr(job["optimizer"], factor)
                if n_total:
                    own = _backward_shards(job["model"], loss_fn, shards, counts, max(n_total, 1), dev)
            except Exception:
                _report(errors, rank)
                failed = True
        broken = failed or job is None
        params = [] if broken else job["params"]
        try:
            stats = _all_reduce(pg, params, [float(broken)] + own, sizes, dev)
        except Exception:  # rank 0 is gone or the group broke: nothing left to serve
            return
        if broken or stats[0] > 0 or not all(math.isfinite(s) for s in stats[1:]) or not n_total:
            for p in params:
                p.grad = None
            continue  # a failed or non-finite step: rank 0 raises and ends the job; no loss terms: no step
        try:
            end_of_step(job["optimizer"], params, job["anchor"], job["prox_mu"], job["grad_clip"], job["scaffold"])
        except Exception:
            _report(errors, rank)
            failed = True


def _sharded_helper(rank: int, n: int, pg: Any, mesh: Any, dev: torch.device, inbox: Any, errors: Any) -> None:
    """Rank ``rank``'s loop on a sharded site: its shard of a copy per job (sharded_site). Any failure
    ends the process: the other ranks wait in collectives it would not join, and rank 0 sees the
    closed connection, raises and starts new helpers."""
    import os

    from fedgalore.federated.sharded_site import backward_shards, gather_back, shard_job
    from fedgalore.federated.step_end import _set_lr, end_of_step

    loss_fn: Any = None
    copy: Any = None
    job: dict[str, Any] = {}
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "stop":
            return
        try:
            if kind == "loss":
                loss_fn = _loads(msg[1], dev)
            elif kind == "job":
                job = _loads(msg[1], torch.device("cpu"))  # sharding moves each rank's blocks to its device
                copy = shard_job(job["model"], job["optimizer"], job["params"], job["names"], mesh)
                job["anchor"] = [p.detach().clone() for p in copy.params] if job["prox_mu"] > 0 else None
                torch.manual_seed((int(job["seed"]) * 1000003 + rank) % (1 << 63))  # this rank's dropout draws
            elif kind == "end":
                copy, job = None, {}
            elif kind == "gather":
                gather_back(copy)
            elif kind == "step":
                _, factor, shards, counts, n_total, per, fill = msg
                _set_lr(copy.optimizer, factor)
                own = backward_shards(copy.model, loss_fn, shards, counts, per, max(n_total, 1), n, fill,
                                      dev) if n_total else [0.0] * len(shards)
                stats = _reduce_stats(pg, [0.0] + own, dev)
                if stats[0] > 0 or not all(math.isfinite(x) for x in stats[1:]) or not n_total:
                    for p in copy.params:
                        p.grad = None
                    continue  # rank 0 raises (a failed or non-finite step) or skips (no loss terms)
                end_of_step(copy.optimizer, copy.params, job["anchor"], job["prox_mu"], job["grad_clip"], None)
        except BaseException:
            _report(errors, rank)
            errors.close()
            errors.join_thread()  # the report reaches rank 0 before this process ends
            sys.stderr.flush()
            os._exit(1)
