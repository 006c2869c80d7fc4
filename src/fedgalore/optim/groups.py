"""GaLoreAdamW's parameter groups: the keys of a GaLore group, their defaults and their checks
(split out of :mod:`fedgalore.optim.galore_adamw`; the keys' meaning is in that module's
docstring)."""
from __future__ import annotations

from typing import Any, Sequence

from fedgalore.optim.low_precision import MODES as _LOW_PRECISION_MODES
from fedgalore.optim.projector import PROJ_TYPES

__all__ = ["PROJECTORS", "MOMENT_TRANSFERS", "BIAS_CORRECTIONS", "ADAPTIVE_SCOPES", "NONFINITE_POLICIES", "LOW_PRECISION",
           "BUCKET_GEMMS", "STACK_AUTO_MAX_NUMEL", "WARM_SCALES", "GALORE_DEFAULTS", "fill_galore_group", "is_int"]


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


PROJECTORS = ("identity", "svd", "rsvd", "random", "svd_then_random", "rsvd_then_random")
MOMENT_TRANSFERS = ("linear", "squared", "keep", "reset")
BIAS_CORRECTIONS = ("steps", "weight")
ADAPTIVE_SCOPES = ("round", "global")
NONFINITE_POLICIES = ("raise", "skip")
LOW_PRECISION = _LOW_PRECISION_MODES
#: group key ``bucket_gemm``: where a bucket's projection and back-projection run as one ``bmm`` each
BUCKET_GEMMS = ("auto", "stacked", "per_matrix")
#: ``bucket_gemm: auto`` stacks CUDA matrices below this many entries. A stacked bucket copies its
#: gradients into the stack and writes its updates to a temporary before adding them: two more
#: passes over ``B·m·n`` entries, against ``B − 1`` fewer launches of each GEMM. Small matrices
#: (RoBERTa's 768², 3072×768) are launch-bound on a GPU, large ones (Llama-7B's 4096×11008) are
#: bandwidth-bound; the bound is this design argument's, not a measurement (no GPU was lent yet;
#: on the CPU the stacked form measured 1.4-4.4x slower, benchmarks/RESULTS.md §1.2)
STACK_AUTO_MAX_NUMEL = 1 << 22
#: group key ``warm_scale``: a warm prior taken as it is, or its shape at the client's gradient scale
WARM_SCALES = ("absolute", "gradient")

#: Defaults filled into every group that has ``rank`` (the official package's keys first).
GALORE_DEFAULTS: dict[str, Any] = {
    "update_proj_gap": 200,
    "scale": 1.0,
    "proj_type": "std",
    "projector": "svd",
    "adaptive_proj_steps": 1,
    "adaptive_scope": "round",
    # Provisional default: non-negative by construction (reference §2.6(d)); DESIGN §3.1 leaves the
    # final choice to the reproduction measurement.
    "moment_transfer": "squared",
    "bias_correction": "steps",
    "cap_to_cold": False,
    "track_cold": False,
    "rsvd_oversample": 8,
    "rsvd_niter": 2,
    # the epoch schedule (paper §4 "SVD-to-random projectors", App. E): -1 = off (refreshes every tau
    # steps, the first adaptive_proj_steps data-driven); s >= 0 = data-driven before local step s,
    # the round's view basis R_k from step s to the end of the round
    "seeded_from_step": -1,
    # NOT the paper's schedule (FedGaLore's first_basis: synced): with seeded_from_step >= 0, a matrix
    # that holds a pending warm start runs its data-driven phase on the warm start's own basis (the
    # one v̄ is expressed on) instead of data-driven refreshes, so the warm start moves nothing; it
    # keeps that basis, unrefreshed, until the switch to R_k. A matrix without a warm start: as off
    "hold_warm_basis": False,
    # bf16 / fp16 GaLore weights: how the update reaches them (module doc, "Low-precision weights")
    "low_precision": "compensated",
    # a warm start's scale: absolute (the synchronised estimate as it is) | gradient (its shape at
    # the client's own scale: rescaled at the first step so its mean is that of R∘R; FedGaLore's
    # sync: aggregate, whose state carries no gradient scale)
    "warm_scale": "absolute",
    # the GEMMs of a bucket (matrices of one shape): auto = one stacked bmm each on CUDA (kernel
    # launches), per matrix elsewhere (the CPU's AVX2/oneDNN kernels); stacked | per_matrix force it
    "bucket_gemm": "auto",
    # sites at different ranks (docs/design.md "A rank per site"): seeded bases are the leading `rank`
    # vectors of the seed's rank-`frame_rank` frame (nested), so every site's seeded terms and views add
    # up on one frame; None: the seed's own rank-`rank` draw
    "frame_rank": None,
}


def fill_galore_group(group: dict[str, Any], gi: int, names: Sequence[str]) -> None:
    """Fill :data:`GALORE_DEFAULTS` into a group with ``rank`` and check every key (one
    ``ValueError`` naming the key, the value and what to use instead); ``names`` are the group's
    parameter names, in order."""
    for k, v in GALORE_DEFAULTS.items():
        group.setdefault(k, v)
    rank = group["rank"]
    if not is_int(rank) or rank <= 0:
        raise ValueError(f"GaLore group {gi}: rank must be a positive int, got {rank!r}")
    frame = group["frame_rank"]
    if frame is not None and (not is_int(frame) or frame < rank):
        raise ValueError(f"GaLore group {gi}: frame_rank must be an int >= rank={rank} (or None), got {frame!r}")
    if group["projector"] not in PROJECTORS:
        raise ValueError(f"unknown projector {group['projector']!r}; expected one of {PROJECTORS}")
    if group["proj_type"] not in PROJ_TYPES:
        raise ValueError(f"unknown proj_type {group['proj_type']!r}; expected one of {PROJ_TYPES}")
    if group["moment_transfer"] not in MOMENT_TRANSFERS:
        raise ValueError(
            f"unknown moment_transfer {group['moment_transfer']!r}; expected one of {MOMENT_TRANSFERS}"
        )
    if group["bias_correction"] not in BIAS_CORRECTIONS:
        raise ValueError(
            f"unknown bias_correction {group['bias_correction']!r}; expected one of {BIAS_CORRECTIONS}"
        )
    if group["galore_torch_compat"] and (group["bias_correction"] != "steps" or group["track_cold"] or group["cap_to_cold"]):
        raise ValueError("galore_torch_compat reproduces the official rule: use bias_correction='steps', "
                         "track_cold=False and cap_to_cold=False")
    if group["bias_correction"] == "weight" and group["moment_transfer"] == "linear":
        raise ValueError("moment_transfer='linear' cannot move per-coordinate evidence (bias_correction='weight'): "
                         "V C / c is no longer an average of old estimates; use moment_transfer='squared'")
    if group["cap_to_cold"] and group["bias_correction"] != "weight":
        raise ValueError("cap_to_cold caps a warm prior's steps at the cold start's: it needs bias_correction='weight'")
    if group["adaptive_scope"] not in ADAPTIVE_SCOPES:
        raise ValueError(f"unknown adaptive_scope {group['adaptive_scope']!r}; expected one of {ADAPTIVE_SCOPES}")
    if not is_int(group["update_proj_gap"]) or group["update_proj_gap"] < 1:
        raise ValueError(f"update_proj_gap must be an int >= 1, got {group['update_proj_gap']!r}")
    if not is_int(group["adaptive_proj_steps"]) or group["adaptive_proj_steps"] < 0:
        raise ValueError(f"adaptive_proj_steps must be an int >= 0, got {group['adaptive_proj_steps']!r}")
    if group["low_precision"] not in LOW_PRECISION:
        raise ValueError(f"unknown low_precision {group['low_precision']!r}; expected one of {LOW_PRECISION}")
    if group["warm_scale"] not in WARM_SCALES:
        raise ValueError(f"unknown warm_scale {group['warm_scale']!r}; expected one of {WARM_SCALES}")
    if group["warm_scale"] == "gradient" and group["bias_correction"] != "weight":
        raise ValueError("warm_scale='gradient' rescales a warm prior's estimate V/c: it needs bias_correction='weight'")
    if group["bucket_gemm"] not in BUCKET_GEMMS:
        raise ValueError(f"unknown bucket_gemm {group['bucket_gemm']!r}; expected one of {BUCKET_GEMMS}")
    switch = group["seeded_from_step"]
    if not is_int(switch) or switch < -1:
        raise ValueError(f"seeded_from_step must be an int >= 0 (or -1: off), got {switch!r}")
    if switch >= 0 and not group["projector"].endswith("_then_random"):
        raise ValueError(f"seeded_from_step switches a *_then_random projector to the round's seeded basis; "
                         f"projector {group['projector']!r} has no such phase (use rsvd_then_random, or seeded_from_step=-1)")
    if not isinstance(group["hold_warm_basis"], bool):
        raise ValueError(f"hold_warm_basis must be a bool, got {group['hold_warm_basis']!r}")
    if group["hold_warm_basis"] and switch < 0:
        raise ValueError("hold_warm_basis holds a warm start's basis through the epoch schedule's data-driven phase; "
                         "it needs seeded_from_step >= 0 (the steps schedule has no such phase)")
    if switch >= 0 and group["adaptive_scope"] == "global":
        raise ValueError("seeded_from_step is a per-round schedule; adaptive_scope='global' counts data-driven refreshes "
                         "across rounds: use one of them (seeded_from_step=-1 for the global count)")
    for i, p in enumerate(group["params"]):
        if p.dim() != 2:
            raise ValueError(
                f"GaLore parameter {names[i]!r} must be 2-D (a weight matrix), got shape {tuple(p.shape)}"
            )

