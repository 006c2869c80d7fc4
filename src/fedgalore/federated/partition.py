"""Client data partitioning: IID shards and Dirichlet label skew (paper Appendix I).

The paper models non-IID clients by drawing label proportions from a Dirichlet distribution,
``p ~ Dir(alpha · 1)``: the smaller ``alpha``, the more skewed each client's label distribution
(paper Appendix "Dirichlet Distribution for Modeling Non-IID Data"; the experiments use
``alpha = 0.5``).

:func:`dirichlet_partition` follows the NIID-Bench / FedLab ``hetero_dir_partition`` algorithm
(the de-facto standard in FL papers, also used by FederatedGPT-Shepherd; see
``reference/algorithms.md`` §5.2 and §5.4), with these documented differences:

* randomness comes from a local ``numpy.random.Generator`` built from ``seed`` (the reference
  code reads the global ``np.random`` state); nothing global is touched;
* labels may be any sortable values (ints, strings, ...): classes are the sorted unique labels;
* the balancing cap is optional (``balance=True`` by default, as in NIID-Bench);
* the retry loop is capped (``max_retries``) and ends in a :class:`PartitionError` that says how
  to fix the setting, instead of looping forever.

Every partition is a list of 1-D ``int64`` index arrays, one per client, that are disjoint and
together cover ``range(N)``. :func:`label_histograms` records the realised per-client label
counts. :func:`encode_partition` / :func:`decode_partition` carry a partition to other processes
(Ray actors, Flower SuperNodes) as one safetensors blob, so every process trains on the server's
exact index arrays.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = [
    "PartitionError",
    "PartitionConfig",
    "iid_partition",
    "dirichlet_partition",
    "label_histograms",
    "make_partition",
    "parse_setting",
    "encode_partition",
    "decode_partition",
]


class PartitionError(ValueError):
    """A partition was requested with invalid arguments or could not be drawn."""


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise PartitionError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def _check_clients(num_clients: Any, n: int) -> int:
    m = _check_int("num_clients", num_clients, 1)
    if m > n:
        raise PartitionError(
            f"num_clients={m} exceeds the number of examples N={n}; every client needs at "
            "least one example"
        )
    return m


def _as_labels(labels: Any) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise PartitionError(f"labels must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise PartitionError("labels is empty; nothing to partition")
    return arr


def _classes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique labels and the class code (index into them) of every example."""
    try:
        classes, codes = np.unique(labels, return_inverse=True)
    except TypeError as exc:  # e.g. an object array mixing str and int
        raise PartitionError(
            f"labels must be mutually comparable (one type, e.g. all int or all str): {exc}"
        ) from exc
    return classes, codes.reshape(-1)


def iid_partition(n: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n)`` and cut it into ``num_clients`` near-equal shards.

    With ``π`` a uniform random permutation of ``{0..n-1}`` and ``M = num_clients``, client
    ``j`` gets ``π[s_j : s_{j+1}]`` where the shard sizes are ``⌈n/M⌉`` for the first
    ``n mod M`` clients and ``⌊n/M⌋`` for the rest (sizes differ by at most one). This is the
    IID setting of the paper's tables (✓ columns). Deterministic given ``seed``.
    """
    n = _check_int("n", n, 1)
    m = _check_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n).astype(np.int64)
    return [part.copy() for part in np.array_split(perm, m)]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    balance: bool = True,
    min_size: int = 10,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Dirichlet label-skew partition (paper Appendix I; NIID-Bench/FedLab semantics).

    For ``M = num_clients`` clients, ``N`` examples and classes ``k`` in sorted order of the
    unique labels, one attempt does::

        for each class k:
            I_k   = shuffle({i : y_i = k})                      # local Generator
            q     ~ Dir(alpha · 1_M)
            q_j  <- q_j · [n_j < N/M],  q <- q / sum(q)          # only if balance
            cuts  = floor(cumsum(q) · |I_k|)[:-1]
            client j gets I_k[cuts_{j-1} : cuts_j];  n_j += that many

    where ``n_j`` is client ``j``'s running size. The attempt is repeated (same generator,
    continuing its stream) while ``min_j n_j < min_size``, at most ``max_retries`` times; then
    :class:`PartitionError` is raised. Finally each client's index list is shuffled.

    The balancing cap (strict ``<``) stops a client that already holds its fair share ``N/M``
    from receiving more; it never empties ``q``, because some client is always below the
    average while examples remain unassigned. Should every eligible ``q_j`` underflow to zero
    (possible only for extreme ``alpha``), the class is split uniformly over the eligible
    clients instead.

    Args:
        labels: 1-D array of per-example labels of any sortable type.
        num_clients: ``M``, with ``1 <= M <= N``.
        alpha: Dirichlet concentration, finite and ``> 0``; small = skewed, large → IID.
        seed: seed of the local ``numpy.random.Generator``; the result is a pure function of
            the arguments.
        balance: apply the NIID-Bench balancing cap.
        min_size: smallest acceptable client size (``min_size · M <= N``).
        max_retries: number of attempts before giving up.

    Returns:
        ``M`` disjoint ``int64`` index arrays covering ``range(N)``.
    """
    arr = _as_labels(labels)
    n = arr.size
    m = _check_clients(num_clients, n)
    try:
        alpha_f = float(alpha)
    except (TypeError, ValueError) as exc:
        raise PartitionError(f"alpha must be a positive number, got {alpha!r}") from exc
    if not math.isfinite(alpha_f) or alpha_f <= 0:
        raise PartitionError(f"alpha must be finite and > 0, got {alpha!r}")
    min_size = _check_int("min_size", min_size, 0)
    max_retries = _check_int("max_retries", max_retries, 1)
    if min_size * m > n:
        raise PartitionError(
            f"min_size={min_size} x num_clients={m} = {min_size * m} exceeds N={n}; "
            "lower min_size or use fewer clients"
        )

    _, codes = _classes(arr)
    order = np.argsort(codes, kind="stable")
    class_sizes = np.bincount(codes)
    class_index = np.split(order.astype(np.int64), np.cumsum(class_sizes)[:-1])
    rng = np.random.default_rng(seed)
    avg = n / m
    conc = np.full(m, alpha_f)

    smallest = 0
    for _attempt in range(max_retries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(m)]
        sizes = np.zeros(m, dtype=np.int64)
        for idx in class_index:
            idx = idx.copy()
            rng.shuffle(idx)
            q = rng.dirichlet(conc)
            if balance:
                eligible = sizes < avg
                q = q * eligible
                total = q.sum()
                q = q / total if total > 0 else eligible / eligible.sum()
            cuts = (np.cumsum(q) * idx.size).astype(int)[:-1]
            for j, piece in enumerate(np.split(idx, cuts)):
                chunks[j].append(piece)
                sizes[j] += piece.size
        smallest = int(sizes.min())
        if smallest >= min_size:
            parts = [np.concatenate(c) if c else np.empty(0, np.int64) for c in chunks]
            for part in parts:
                rng.shuffle(part)
            return parts
    raise PartitionError(
        f"could not draw a Dirichlet partition with every client holding >= {min_size} "
        f"examples in {max_retries} attempts (N={n}, num_clients={m}, alpha={alpha_f:g}; "
        f"smallest client in the last attempt: {smallest}). Lower min_size, use fewer "
        "clients, use a larger alpha, or raise max_retries"
    )


def label_histograms(
    labels: np.ndarray, parts: Sequence[np.ndarray]
) -> tuple[np.ndarray, list[Any]]:
    """Per-client label counts ``H[j, k] = |{i in parts[j] : y_i = class_k}|``.

    Classes are the sorted unique values of ``labels`` (all of them, also those absent from the
    parts). Returns ``(H, classes)`` with ``H`` of shape ``[clients, classes]`` (``int64``) and
    ``classes`` a list of the class values (Python scalars).
    """
    arr = _as_labels(labels)
    classes, codes = _classes(arr)
    hist = np.zeros((len(parts), classes.size), dtype=np.int64)
    for j, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        hist[j] = np.bincount(codes[part], minlength=classes.size)
    return hist, classes.tolist()


@dataclass(frozen=True)
class PartitionConfig:
    """How clients' data are split.

    ``kind="iid"``: :func:`iid_partition` (``alpha``, ``min_size``, ``max_retries`` and
    ``balance`` are ignored). ``kind="dirichlet"``: :func:`dirichlet_partition` with these
    fields.
    """

    kind: Literal["iid", "dirichlet"] = "iid"
    alpha: float = 0.5
    min_size: int = 10
    max_retries: int = 100
    balance: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("iid", "dirichlet"):
            raise PartitionError(f"kind must be 'iid' or 'dirichlet', got {self.kind!r}")
        try:
            a = float(self.alpha)
        except (TypeError, ValueError):
            a = float("nan")
        if not math.isfinite(a) or a <= 0:
            raise PartitionError(f"alpha must be finite and > 0, got {self.alpha!r}")
        _check_int("min_size", self.min_size, 0)
        _check_int("max_retries", self.max_retries, 1)

    def label(self) -> str:
        """Canonical setting string, the inverse of :func:`parse_setting`."""
        return "iid" if self.kind == "iid" else f"dirichlet:{self.alpha:g}"


def make_partition(
    labels: np.ndarray, num_clients: int, cfg: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """Partition ``range(len(labels))`` over ``num_clients`` clients as ``cfg`` says.

    IID: :func:`iid_partition`; Dirichlet: :func:`dirichlet_partition` (Appendix I,
    ``p ~ Dir(alpha · 1)`` per class).
    """
    arr = _as_labels(labels)
    if cfg.kind == "iid":
        return iid_partition(arr.size, num_clients, seed)
    return dirichlet_partition(
        arr,
        num_clients,
        cfg.alpha,
        seed,
        balance=cfg.balance,
        min_size=cfg.min_size,
        max_retries=cfg.max_retries,
    )


_SETTING = re.compile(r"^(?:dirichlet|dir)\s*[:=]?\s*(.+)$")


def parse_setting(s: str) -> PartitionConfig:
    """Parse a setting string: ``"iid"``, ``"dirichlet:0.5"`` or ``"dir0.5"`` (case-insensitive).

    Other fields keep their :class:`PartitionConfig` defaults.
    """
    if not isinstance(s, str):
        raise PartitionError(f"partition setting must be a string, got {s!r}")
    text = s.strip().lower()
    if text == "iid":
        return PartitionConfig(kind="iid")
    match = _SETTING.match(text)
    if match:
        try:
            alpha = float(match.group(1))
        except ValueError:
            alpha = None
        if alpha is not None:
            if not math.isfinite(alpha) or alpha <= 0:
                raise PartitionError(
                    f"partition setting {s!r}: alpha must be finite and > 0, got {alpha:g}"
                )
            return PartitionConfig(kind="dirichlet", alpha=alpha)
    raise PartitionError(
        f"unknown partition setting {s!r}; expected 'iid', 'dirichlet:<alpha>' or "
        "'dir<alpha>' (e.g. 'dirichlet:0.5', 'dir0.1')"
    )


def encode_partition(parts: Sequence[np.ndarray]) -> bytes:
    """Client index arrays as one safetensors blob (int64, key = client id)."""
    tensors = {str(i): torch.from_numpy(np.ascontiguousarray(p, dtype=np.int64)) for i, p in enumerate(parts)}
    return st_save(tensors, metadata={"num_clients": str(len(parts))})


def decode_partition(blob: bytes) -> list[np.ndarray]:
    """Inverse of :func:`encode_partition`."""
    tensors = st_load(blob)
    return [tensors[str(i)].numpy() for i in range(len(tensors))]
