"""What ``fedgalore tune`` searches: one parameter per dotted config key, per row.

A row's space maps dotted config keys (``train.lr``, ``method.rank``, ``train.prox_mu``,
``method.options.scale``, ``federation.partition.alpha`` — any key of the config) to a
:class:`Param`. It is written ``KEY=SPEC`` (``--space``), optionally for some rows only,
``LABELS:KEY=SPEC`` with comma-separated row labels::

    train.lr=log:1e-4:1e-1          a float, log-uniform on [1e-4, 1e-1]
    train.prox_mu=float:0:0.1       a float, uniform
    train.local_epochs=int:1:4      an integer, uniform
    fedit,flexlora:method.rank=choice:8,16,32   one of these values (YAML scalars), for two rows

The default space is the learning rate alone, log-uniform over two decades centred on the row's
default rate (:func:`default_rate`): the row's own ``train.lr`` when its ``--method-options`` entry
gives one, else the method's rate of :data:`METHOD_RATES` (the rates our studies chose, RESULTS
§4 and §12), else the config's ``train.lr``.

A float or integer chosen in the outer tenth of its range (on the log scale for ``log``) sits at
the edge of the range (:func:`at_edge`); :func:`widened` gives the range extended past that edge
(×10 for ``log``, by the range's width otherwise), which the search then tries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from fedgalore.job.config import ConfigError

__all__ = ["Param", "parse_param", "parse_space", "default_rate", "row_space", "apply_params", "at_edge", "widened",
           "METHOD_RATES", "KINDS"]

KINDS = ("log", "float", "int", "choice")

#: centre of the default learning-rate range per registered method: the rates our studies chose on
#: validation data (benchmarks/RESULTS.md §4 label skew, §12 feature skew); a method not listed
#: centres on the config's train.lr
METHOD_RATES: dict[str, float] = {
    "fedavg_full": 1e-3,
    "fedit": 3e-3,
    "flexlora": 3e-3,
    "fedex_lora": 3e-3,
    "fedsa_lora": 3e-3,
    "ffa_lora": 3e-3,
    "flora": 3e-3,
    "fr_lora": 3e-3,
    "hetlora": 3e-3,
    "lora_fair": 3e-3,
    "fedgalore": 1e-2,
    "fedgalore_minus": 1e-2,
    "fed_sb": 1e-2,
}


@dataclass(frozen=True)
class Param:
    """One searched key: ``kind`` in :data:`KINDS`; ``low``/``high`` for log/float/int, ``choices``
    for choice."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = field(default_factory=tuple)

    def spec(self) -> str:
        """The ``KEY=SPEC`` text that gives this parameter."""
        if self.kind == "choice":
            return f"{self.key}=choice:" + ",".join(str(c) for c in self.choices)
        return f"{self.key}={self.kind}:{self.low:g}:{self.high:g}"

    def suggest(self, trial: Any) -> Any:
        """Ask an Optuna trial for this parameter's value."""
        if self.kind == "log":
            return trial.suggest_float(self.key, self.low, self.high, log=True)
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high))
        return trial.suggest_categorical(self.key, list(self.choices))


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a number") from None


def _scalar(text: str) -> Any:
    """A choice's value: an int, a float (``3e-2`` too, which YAML 1.1 reads as text), true /
    false / null, else the text."""
    text = text.strip()
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def parse_param(key: str, spec: str) -> Param:
    """``Param`` of ``KEY=SPEC`` (module doc); a malformed spec is a :class:`ConfigError` that
    shows the forms."""
    forms = "log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or choice:A,B,C (e.g. train.lr=log:1e-4:1e-1)"
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--space {key}={spec}: the key must be a dotted config key such as train.lr")
    kind, _, rest = spec.strip().partition(":")
    if kind not in KINDS or not rest:
        raise ConfigError(f"--space {key}={spec}: the value must be {forms}")
    if kind == "choice":
        choices = tuple(_scalar(v) for v in rest.split(",") if v.strip())
        if not choices:
            raise ConfigError(f"--space {key}={spec}: choice needs at least one value, e.g. choice:8,16,32")
        if len(set(map(repr, choices))) != len(choices):
            raise ConfigError(f"--space {key}={spec}: choice lists a value twice")
        return Param(key, "choice", choices=choices)
    bounds = rest.split(":")
    if len(bounds) != 2:
        raise ConfigError(f"--space {key}={spec}: the value must be {forms}")
    low, high = (_number(b, f"--space {key}={spec}") for b in bounds)
    if not low < high:
        raise ConfigError(f"--space {key}={spec}: LOW must be below HIGH")
    if kind == "log" and low <= 0:
        raise ConfigError(f"--space {key}={spec}: a log range needs LOW > 0 (e.g. log:1e-4:1e-1)")
    if kind == "int" and (low != int(low) or high != int(high)):
        raise ConfigError(f"--space {key}={spec}: int bounds must be integers")
    return Param(key, kind, low, high)


def parse_space(items: Sequence[str], labels: Sequence[str]) -> dict[str, dict[str, Param]]:
    """``--space`` items → ``{label: {key: Param}}`` (rows not named by an item get it all)."""
    out: dict[str, dict[str, Param]] = {label: {} for label in labels}
    for item in items:
        head, eq, spec = item.partition("=")
        if not eq:
            raise ConfigError(f"--space {item!r}: write KEY=SPEC, e.g. train.lr=log:1e-4:1e-1 or fedit:method.rank=choice:8,16")
        rows: Sequence[str] = labels
        if ":" in head:
            names, head = head.rsplit(":", 1)
            rows = [n.strip() for n in names.split(",")]
            unknown = [n for n in rows if n not in labels]
            if unknown:
                raise ConfigError(f"--space {item!r}: {unknown[0]!r} is not a row of this search ({', '.join(labels)})")
        param = parse_param(head, spec)
        for label in rows:
            out[label][param.key] = param
    return out


def default_rate(method: str, row_lr: float | None, config_lr: float) -> float:
    """The centre of a row's default learning-rate range (module doc)."""
    if row_lr is not None:
        return float(row_lr)
    return float(METHOD_RATES.get(method, config_lr))


def row_space(given: Mapping[str, Param], centre: float, decades: float = 1.0) -> dict[str, Param]:
    """The row's space: ``given`` plus, when it does not search ``train.lr``, the learning rate
    log-uniform on [centre / 10^decades, centre · 10^decades]."""
    out = dict(given)
    if "train.lr" not in out:
        out = {"train.lr": Param("train.lr", "log", centre / 10 ** decades, centre * 10 ** decades), **out}
    return out


def apply_params(config: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a plain dict, changed in place and returned) with each dotted key set to its
    value. A key whose parents do not exist in the config is a :class:`ConfigError` (a typo);
    keys under ``method.options`` and ``task.options`` may be new."""
    for key, value in params.items():
        parts = key.split(".")
        node: Any = config
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or (part not in node and ".".join(parts[: i + 1]) not in ("method.options", "task.options")):
                raise ConfigError(f"--space {key}: the config has no section {'.'.join(parts[: i + 1])!r}; "
                                  "search a dotted key of the config (e.g. train.lr, method.rank, method.options.scale)")
            node = node.setdefault(part, {})
        free = ".".join(parts[:-1]) in ("method.options", "task.options")
        if not isinstance(node, dict) or (parts[-1] not in node and not free):
            raise ConfigError(f"--space {key}: the config has no key {key!r}; search a dotted key of the config "
                              "(e.g. train.lr, method.rank, train.prox_mu)")
        node[parts[-1]] = value
    return config


def _position(param: Param, value: float) -> float:
    if param.kind == "log":
        return (math.log(value) - math.log(param.low)) / (math.log(param.high) - math.log(param.low))
    return (value - param.low) / (param.high - param.low)


def at_edge(param: Param, value: Any, share: float = 0.1) -> str | None:
    """``"low"`` / ``"high"`` when a numeric ``value`` lies in the outer ``share`` of ``param``'s
    range (log scale for ``log``), or is the smallest / largest of three or more numeric
    choices; else ``None``."""
    if value is None or isinstance(value, bool):
        return None
    if param.kind == "choice":
        nums = [c for c in param.choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
        if len(nums) < 3 or len(nums) != len(param.choices) or not isinstance(value, (int, float)):
            return None
        return "low" if value <= min(nums) else "high" if value >= max(nums) else None
    if param.kind == "int" and param.high - param.low < 1 / share:  # a short integer range: only its ends
        return "low" if value <= param.low else "high" if value >= param.high else None
    pos = _position(param, float(value))
    return "low" if pos <= share else "high" if pos >= 1 - share else None


def widened(param: Param, side: str) -> Param:
    """``param`` with its range extended past ``side``: ×10 on a log range; by the range's width
    otherwise, a range that starts at or above 0 (1 for integers) not below that (a choice is
    returned as it is: the report flags it, the user adds a value)."""
    if param.kind == "choice":
        return param
    if param.kind == "log":
        return Param(param.key, "log", param.low / 10 if side == "low" else param.low, param.high * 10 if side == "high" else param.high)
    width = param.high - param.low
    low, high = (param.low - width, param.high) if side == "low" else (param.low, param.high + width)
    if param.kind == "int":
        floor = 1 if param.low >= 1 else 0 if param.low >= 0 else low
        return Param(param.key, "int", int(max(low, floor)), int(high))
    floor = 0.0 if param.low >= 0 else low
    return Param(param.key, "float", max(low, floor), high)
