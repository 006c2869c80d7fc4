"""Secure aggregation in a Flower deployment: Flower's SecAgg+ carrying fedgalore's uploads.

``federation.secure_aggregation`` (fedgalore.federated.guards) runs each round's training through
Flower's own SecAgg+ (Bell et al. 2020): :class:`flwr.server.workflow.SecAggPlusWorkflow` on the
server (:func:`secure_round`) and :func:`flwr.client.mod.secaggplus_mod` on every ClientApp
(:func:`secagg_mod`, which hands every other message to the app unchanged). Nothing of the protocol
is ours: the four stages (setup, share keys, collect masked vectors, unmask), the quantisation,
the masks and the recovery of a node lost after it shared its keys are Flower's.

What we add is the carriage:

* **client** (:func:`summable`): the method's upload ``x_i`` (a :class:`~fedgalore.protocol.payload.
  Payload`) becomes a list of float arrays — every tensor it holds, plus each GaLore record's
  decay as a 0-d array — and a *layout* (JSON: entry kinds, shapes, public seeds, tensor order;
  no values), which travels in the clear. Flower's mod uploads ``[w_i, w_i·x_i]`` quantised and
  masked, with ``w_i`` the client's example count (1 under client-level DP's uniform weights).
* **server** (:func:`from_summed`): the workflow's result is ``x̄ = Σ w_i x_i / Σ w_i``
  (up to quantisation); with the layout (every client must send the same one) it becomes one
  Payload, which the round loop hands to A with weight 1. For the methods that allow secure
  aggregation (``Method.secure_aggregation_problem``), ``A(x̄; 1) = A(x_1..x_K; p)``.

Quantisation (Flower's): each value ``w_i x_i / max_weight`` is clipped to ``±clipping_range`` and
stochastically rounded to ``quantization_range`` levels, so each client's value carries an error
below one step ``2·clipping_range / quantization_range`` (unbiased), and the mean's error is at most
that step (:meth:`~fedgalore.federated.guards.SecureAggregationConfig.quantization_error`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from fedgalore.protocol.payload import Payload, PayloadError, flatten_entries, unflatten_entries

__all__ = ["summable", "from_summed", "secagg_mod", "secure_round", "SecureRound", "PAYLOAD_TYPE", "is_secagg"]

#: upload meta that is summed with the arrays (its mean is what the server uses): client-level DP's
#: noised clip bit (adaptive clipping counts the noised share of clients within C). Every other meta
#: field (a client's own statistics) stays on the site; its result record carries what it reports.
SUMMED_META = ("dp_clip_bit",)
#: the ``tensor_type`` of the broadcast inside a SecAgg+ FitIns (one tensor: fedgalore's encoded payload)
PAYLOAD_TYPE = "fedgalore.payload"
_DTYPES = {"torch.float32": torch.float32, "torch.float64": torch.float64, "torch.bfloat16": torch.bfloat16,
           "torch.float16": torch.float16}


# ---------------------------------------------------------------------- the summed vector
def summable(payload: Payload) -> tuple[list[np.ndarray], str]:
    """``(arrays, layout)``: every tensor of ``payload`` as a float64 array, in the layout's order,
    then each GaLore record's ``decay`` and each :data:`SUMMED_META` value as a one-element array;
    the layout (JSON) holds the entries' structure and public values (kinds, shapes, seeds, sides)
    and the names of those summed fields — no value. Inverse on the sum: :func:`from_summed`."""
    specs, tensors = flatten_entries(payload.entries)
    keys = sorted(tensors)
    arrays = [tensors[k].detach().to(torch.float64).numpy() for k in keys]
    decays: list[str] = []

    def lift(spec: Any, path: str) -> None:
        if isinstance(spec, dict):
            if spec.get("kind") == "galore_update":
                key = f"{path}/decay"
                # shape (1,), not 0-d: Flower's dequantisation turns a 0-d array into a numpy scalar, and its
                # in-place offset and weight correction then never reach it (the decay came back ≈ 2·clipping_range)
                arrays.append(np.asarray([float(spec["decay"])], dtype=np.float64))
                spec["decay"] = key
                decays.append(key)
            for k, v in spec.items():
                lift(v, f"{path}/{k}")
        elif isinstance(spec, list):
            for i, v in enumerate(spec):
                lift(v, f"{path}/{i}")

    for name in sorted(specs):
        lift(specs[name], name)
    summed_meta = [k for k in SUMMED_META if isinstance(payload.meta.get(k), (int, float))]
    arrays += [np.asarray([float(payload.meta[k])], dtype=np.float64) for k in summed_meta]
    layout = {
        "entries": specs,
        "tensors": keys,
        "dtypes": {k: str(tensors[k].dtype) for k in keys},
        "shapes": {k: list(tensors[k].shape) for k in keys},
        "decays": decays,
        "meta": summed_meta,
    }
    return arrays, json.dumps(layout, sort_keys=True)


def from_summed(layout: str, arrays: Sequence[np.ndarray]) -> Payload:
    """The Payload of layout ``layout`` holding ``arrays`` (the workflow's weighted mean):
    tensors back in their dtypes and shapes, each GaLore record's decay back in its record."""
    lay = json.loads(layout)
    keys, decays, metas = list(lay["tensors"]), list(lay["decays"]), list(lay["meta"])
    if len(arrays) != len(keys) + len(decays) + len(metas):
        raise PayloadError(f"secure aggregate: {len(arrays)} arrays for a layout of {len(keys) + len(decays) + len(metas)}")
    tensors = {}
    for k, a in zip(keys, arrays):
        t = torch.from_numpy(np.array(a, dtype=np.float64)).reshape(lay["shapes"][k])
        tensors[k] = t.to(_DTYPES.get(lay["dtypes"][k], torch.float32))
    decay = {k: float(np.asarray(a).reshape(-1)[0]) for k, a in zip(decays, arrays[len(keys):len(keys) + len(decays)])}
    meta = {k: float(np.asarray(a).reshape(-1)[0]) for k, a in zip(metas, arrays[len(keys) + len(decays):])}

    def restore(spec: Any) -> None:
        if isinstance(spec, dict):
            if spec.get("kind") == "galore_update":
                spec["decay"] = decay[spec["decay"]]
            for v in spec.values():
                restore(v)
        elif isinstance(spec, list):
            for v in spec:
                restore(v)

    specs = lay["entries"]
    restore(specs)
    return Payload(unflatten_entries(specs, tensors), meta)


# ---------------------------------------------------------------------- client side
def is_secagg(msg) -> bool:
    """Whether ``msg`` is a stage of Flower's SecAgg+ protocol (it carries the protocol's config record)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return msg.metadata.message_type.startswith("train") and RECORD_KEY_CONFIGS in msg.content.config_records


def secagg_mod(msg, ctxt, call_next):
    """The ClientApp's mod: a SecAgg+ stage goes through Flower's ``secaggplus_mod`` (which calls
    the app's ``train`` in its collect stage and masks what it returns); any other message goes to
    the app unchanged, so one ClientApp serves runs with and without secure aggregation."""
    from flwr.client.mod import secaggplus_mod

    if is_secagg(msg):
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


# ---------------------------------------------------------------------- server side
@dataclass
class SecureRound:
    """One SecAgg+ round's outcome: ``mean`` (the weighted mean arrays; None when the protocol
    halted), ``results`` (node → the client's result record, in the clear: client, error, time,
    stats, layout), ``failures`` (the protocol's failure count), ``halted`` (why, or None)."""

    mean: list[np.ndarray] | None = None
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: int = 0
    halted: str | None = None


def secure_round(grid, sa, instructions: dict[int, tuple[bytes, dict[str, Any]]], *, server_round: int,
                 max_weight: float, timeout: float | None) -> SecureRound:
    """Run one round of Flower's ``SecAggPlusWorkflow`` on ``grid``: node → ``(broadcast blob, job)``
    in ``instructions``; ``sa``: the run's :class:`~fedgalore.federated.guards.SecureAggregationConfig`.
    The workflow asks a legacy strategy for its FitIns and hands it the unmasked aggregate; ours
    (:class:`_Collect`) gives it fedgalore's jobs and keeps what it returns."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    out = SecureRound()
    fit = [(GridClientProxy(int(node), grid, 0), FitIns(Parameters([blob], PAYLOAD_TYPE), dict(job)))
           for node, (blob, job) in sorted(instructions.items())]
    strategy = _collect_strategy(fit, out, parameters_to_ndarrays)
    ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), strategy=strategy)
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: int(server_round)})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = SecAggPlusWorkflow(
        num_shares=sa.flower_value(sa.num_shares), reconstruction_threshold=sa.flower_value(sa.reconstruction_threshold),
        max_weight=float(max_weight), clipping_range=float(sa.clipping_range), quantization_range=int(sa.quantization_range),
        modulus_range=int(sa.modulus_range), timeout=timeout)
    workflow(grid, ctx)
    if out.mean is None and out.halted is None:
        out.halted = "Flower's SecAgg+ halted (too few nodes answered a stage to reach reconstruction_threshold)"
    return out


def _collect_strategy(fit, out: SecureRound, to_ndarrays):
    """A legacy Flower strategy that only serves the SecAgg+ workflow: ``configure_fit`` returns
    fedgalore's per-node FitIns, ``aggregate_fit`` keeps the unmasked weighted mean and each
    node's result record (its metrics, in the clear)."""
    from flwr.server.strategy import Strategy as LegacyStrategy

    class _Collect(LegacyStrategy):
        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            return fit

        def aggregate_fit(self, server_round, results, failures):
            out.failures = len(failures)
            for proxy, res in results:
                out.results[int(proxy.node_id)] = dict(res.metrics)
            if results:
                out.mean = to_ndarrays(results[0][1].parameters)
            return None, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return _Collect()
