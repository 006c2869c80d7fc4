"""The default backend: clients run one after another in this process on one shared model.

Memory is one model plus one client's optimizer state: each client's ``client_update`` loads the
broadcast into the shared model, trains, and returns its upload. Nothing is serialised: the
broadcast and the uploads are handed over as payload objects, each side on its own copy of the
tensors (``fedgalore.protocol.payload.transfer``, what decoding the bytes would give), and the
ledger counts exactly the bytes the codec would write (``encoded_size``).

Option ``keep_client_models`` (default false). A per-client downlink (FedGaLore's factored one,
fedgalore.protocol.downlink) is exact, so by default the simulated clients are handed the dense
broadcast to train from while the ledger counts the factored message a client that kept its
last global model would receive (the server's record of the version it sent each client,
checkpointed). With ``keep_client_models: true`` every simulated client keeps its own fp32 copy
of the adapted matrices between rounds (``Runtime.client_state``) and rebuilds the next model
from exactly the message the ledger counts — an end-to-end check of the protocol, at one copy of
those matrices per client seen (plus W_0 once). The two modes train bit-identically and count
the same bytes (tests/protocol/test_downlink.py); after a resume the kept copies are gone, so that mode's
clients start again from W_0 (bytes may differ after the resume; the model does not).
"""
from __future__ import annotations

import time

from fedgalore.engine.backends.base import Backend
from fedgalore.job.config import ConfigError
from fedgalore.engine.events import ProgressSink
from fedgalore.engine.runtime import ClientJob, ClientResult
from fedgalore.methods.traits import per_client_downlink_ops
from fedgalore.protocol.downlink import ClientCache


class SequentialBackend(Backend):
    name = "sequential"
    in_process = True  # payloads are handed over as objects (copied), counted with encoded_size

    def __init__(self, keep_client_models: bool = False) -> None:
        if not isinstance(keep_client_models, bool):
            raise ConfigError(f"backend.options.keep_client_models={keep_client_models!r} must be true or false")
        self.keep_client_models = keep_client_models
        self.keeps_client_state = keep_client_models
        self._base: dict | None = None

    def start(self, runtime) -> None:
        super().start(runtime)
        # each simulated client's own store, kept between rounds (in memory); None: stateless clients
        # (a method that keeps its own state at the sites, MethodTraits.keeps_client_state — FedSA-LoRA's B — gets it always)
        needs = runtime.method.traits.keeps_client_state
        runtime.client_state = {} if self.keep_client_models or needs else None
        ops = per_client_downlink_ops(runtime.method)
        if self.keep_client_models and ops is not None:
            self._base = ops.downlink_base(runtime.model)  # W_0, public: what a client that kept nothing yet holds

    def client_versions(self, method, clients):
        ops = per_client_downlink_ops(method)
        if ops is None or self.runtime.client_state is None:
            return {c: None for c in clients}
        held = ops.held_version
        out = {}
        for c in clients:
            store = self.runtime.client_state.setdefault(c, {})
            if store.get("downlink") is None and self._base is not None:
                store["downlink"] = ClientCache(0, self._base)  # shared W_0; the client replaces it with its own copy
            out[c] = held(store)
        return out

    def run_clients(self, broadcast, jobs: list[ClientJob], progress: ProgressSink | None = None) -> list[ClientResult]:
        results = []
        for job in jobs:
            blob = broadcast[job.client] if isinstance(broadcast, dict) else broadcast
            gen, steps = self.runtime.batches(job.client, job.round)
            if progress is not None:
                progress.client_start(job.round, job.client, steps)
                on_step = lambda t, loss, j=job, s=steps: progress.client_step(j.round, j.client, t, s, loss)  # noqa: E731
            else:
                on_step = None
            t0 = time.perf_counter()
            res = self.runtime.execute(job, blob, on_step=on_step)
            res.time = time.perf_counter() - t0  # what the server itself waited (the client's own clock stays at the site)
            if progress is not None:
                view = self.runtime.view  # the console shows what the server may record (fedgalore.privacy.view)
                progress.client_end(job.round, job.client, {"time": res.time if view.client_time else None,
                                                            "error": view.error(res.error, res.origin) if res.error else None,
                                                            **res.stats})
            results.append(res)
        return results
