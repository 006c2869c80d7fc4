"""Which round features combine with which method, and with each other: one place, from declarations.

Every round feature (a stage of :mod:`fedgalore.engine.stages` that a config section turns on:
``privacy.record``, ``privacy.client``, ``federation.secure_aggregation``, ``federation.robust``,
``train.scaffold``, ...) is a :class:`Feature` in :data:`FEATURES`: its name, a one-line
description, the config overrides that turn it on, what it needs of a method (:class:`Need`:
a predicate on the method's declared :class:`~fedgalore.methods.traits.MethodTraits`, its resolved
options or its ``supports_scaffold``, with the reason in one line and, where one exists, the
settings under which the method runs the feature anyway) and which other features it excludes
(:class:`Conflict`, the reason in one line). Every verdict is derived from these declarations:

* :func:`method_verdict` — (method × feature): ✓, ✓ with settings, or ✗ with the reasons;
* :func:`pair_verdict` — (feature × feature): ✓, ✓ with settings, or ✗;
* :func:`render_markdown` — both tables with a footnote per reason (``fedgalore methods
  --compat``; docs/compat.md is this text, regenerated with ``python -m fedgalore.compat``).

The declarations repeat what the library's checks decide (``FederatedConfig.validate``, the
stages' ``build``, the runtime, the round); tests/project/test_compat.py runs one round of every
combination on a tiny run (one with secure aggregation is built, not run: its rounds need Flower)
and fails on each pair where the declaration and the code disagree, and on a registered stage or
method that declares nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping

from fedgalore.methods.base import method_class, parse_options
from fedgalore.methods.traits import MethodTraits

__all__ = ["Feature", "Need", "Conflict", "Verdict", "MethodFacts", "FEATURES", "NOT_FEATURES", "feature",
           "method_verdict", "pair_verdict", "render_markdown", "DOC_PAGE", "REGENERATE"]

#: the generated page, and the command that writes it
DOC_PAGE = Path(__file__).resolve().parents[2] / "docs" / "compat.md"
REGENERATE = "python -m fedgalore.compat"


@dataclass(frozen=True)
class MethodFacts:
    """What a feature's needs may read of a registered method: its declared traits for its
    default options (resolved at ``rank``), those options, and its class's ``supports_scaffold``."""

    name: str
    rank: int = 4

    @cached_property
    def cls(self) -> type:
        return method_class(self.name)

    @cached_property
    def options(self) -> Any:
        return parse_options(self.name, {}, self.rank)

    @cached_property
    def traits(self) -> MethodTraits:
        return self.cls.traits_for(self.options)

    @property
    def supports_scaffold(self) -> bool:
        return bool(self.cls.supports_scaffold)


@dataclass(frozen=True)
class Need:
    """What a feature needs of a method: ``holds(facts)``; when it does not, ``reason`` (one line)
    says why, and ``fix`` (config overrides, dotted keys) — when not None — makes the method run
    the feature anyway."""

    holds: Callable[[MethodFacts], bool]
    reason: str
    fix: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Conflict:
    """A feature excludes ``other`` (one line: ``reason``); with ``fix`` (overrides) both run."""

    other: str
    reason: str
    fix: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Feature:
    """One round feature (module doc). ``enable``: the dotted config overrides that turn it on
    (on any base config); ``stages``: the names of the :data:`fedgalore.engine.stages.REGISTRY`
    stages it turns on; ``where``: where it runs, when not everywhere."""

    name: str
    description: str
    enable: Mapping[str, Any]
    stages: tuple[str, ...]
    needs: tuple[Need, ...] = ()
    conflicts: tuple[Conflict, ...] = ()
    where: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A combination's verdict: ``ok`` with ``fix`` ({}: as it is), or not ``ok``; ``reasons``:
    one line each (why not; or why a setting of ``fix`` is needed, and the setting)."""

    ok: bool
    reasons: tuple[str, ...] = ()
    fix: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``yes``, ``with`` (settings needed) or ``no``."""
        return "no" if not self.ok else "with" if self.fix else "yes"


_PUBLIC = "client-level DP needs public (seeded) bases"
_CLIENT_DP = {"privacy.client": {"noise_multiplier": 1.0, "clip": 0.5}}

#: every round feature, in the order of the tables
FEATURES: tuple[Feature, ...] = (
    Feature("record_dp", "DP-SGD at each site: each example's gradient clipped and noised (privacy.record)",
            {"privacy.record": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}, ("record_dp", "privacy")),
    Feature("client_dp", "DP-FedAvg: each client's update clipped, the sum noised (privacy.client)",
            _CLIENT_DP, ("client_dp", "privacy"),
            needs=(Need(lambda m: getattr(m.options, "projector", "random") == "random",
                        f"{_PUBLIC}; the default projector fits the bases to each client's gradient",
                        {"method.options.projector": "random"}),
                   Need(lambda m: m.traits.moments != "uploaded" or getattr(m.options, "view_basis", None) in (None, "seeded"),
                        f"{_PUBLIC}; the moment views' basis is fitted to the clients' data",
                        {"method.options.view_basis": "seeded"}),
                   Need(lambda m: not m.traits.decay_in_upload,
                        "the upload carries the weight decay outside the clipped change", {"train.weight_decay": 0.0}),
                   Need(lambda m: not m.traits.upload_follows_steps,
                        "the upload's structure follows the site's step count, which would reveal its size",
                        {"train.local_steps": 1})),  # any fixed number of local steps
            conflicts=(Conflict("scaffold", "SCAFFOLD's control variates are a second, unclipped release of each update"),
                       Conflict("max_update_norm", "the server would measure each raw upload; privacy.client.clip bounds it"),
                       Conflict("clip_update_norm", "two clippings of the same upload"),
                       Conflict("site_ranks", "the noised sum needs uploads of one shape"),
                       Conflict("robust", "a robust rule changes the noised sum's sensitivity"),
                       Conflict("robust_coordinate", "a robust rule changes the noised sum's sensitivity"))),
    Feature("secure_aggregation", "Flower SecAgg+: the server sees only the sum of the uploads "
            "(federation.secure_aggregation)", {"federation.secure_aggregation": {}}, ("secure_aggregation",),
            needs=(Need(lambda m: m.traits.secure_aggregation,
                        "the aggregation uses each upload on its own, not only their weighted sum"),
                   Need(lambda m: getattr(m.options, "projector", "random") == "random",
                        "the update records add up only on public seeded bases; the default projector is data-driven",
                        {"method.options.projector": "random"}),
                   Need(lambda m: getattr(m.options, "sync", None) not in ("ajive", "mean_svd"),
                        "the moment sync fits a subspace to each client's view, which SecAgg+ hides",
                        {"method.options.sync": "aggregate"}),
                   Need(lambda m: not (getattr(m.options, "sync", None) == "mean"
                                       and getattr(m.options, "moment_protocol", "paper") != "paper"),
                        "the aligned moment protocol pools the views by each client's evidence (a ratio of sums)",
                        {"method.options.moment_protocol": "paper"})),
            conflicts=(Conflict("scaffold", "SCAFFOLD's control variates are per-client state the server must read"),
                       Conflict("max_update_norm", "the server cannot see each update to measure it"),
                       Conflict("clip_update_norm", "the server cannot see each update to clip it"),
                       Conflict("site_ranks", "SecAgg+ sums uploads of one shape"),
                       Conflict("robust", "robust rules compare individual uploads, which SecAgg+ hides"),
                       Conflict("robust_coordinate", "robust rules compare individual uploads, which SecAgg+ hides"),
                       Conflict("client_dp", "central noise has the server clip each upload",
                                {"privacy.client.noise": "distributed"})),
            where="Flower deployments only (a SecAgg+ backend)"),
    Feature("robust", "drop uploads far from the others before A: norm filter or Krum (federation.robust)",
            {"federation.robust": {"kind": "norm_filter", "norm_factor": 3.0}}, ("robust",)),
    Feature("robust_coordinate", "coordinate-wise trimmed mean / median of the uploads (federation.robust)",
            {"federation.robust": {"kind": "median"}}, ("robust",),
            needs=(Need(lambda m: "median" in m.traits.robust_rules,
                        "the uploads are factors, not dense updates in shared coordinates"),),
            conflicts=(Conflict("robust", "one federation.robust section: its norm_factor runs the norm filter before the "
                                "coordinate-wise rule", {"federation.robust": {"kind": "median", "norm_factor": 3.0}}),)),
    Feature("max_update_norm", "reject uploads whose ‖ΔW‖ exceeds a bound (federation.max_update_norm)",
            {"federation.max_update_norm": 100.0}, ("norm_guard",)),
    Feature("clip_update_norm", "scale uploads down to a ‖ΔW‖ bound (federation.clip_update_norm)",
            {"federation.clip_update_norm": 100.0}, ("norm_guard",)),
    Feature("attack", "a simulated hostile site's scaled upload, to measure a defence (federation.attack)",
            {"federation.attack": {"clients": [0]}}, ("attack",), where="simulations only (not a Flower deployment)"),
    Feature("scaffold", "SCAFFOLD control variates (train.scaffold)", {"train.scaffold": True}, ("scaffold",),
            needs=(Need(lambda m: m.supports_scaffold, "the method has no dense trainable server parameters"),)),
    Feature("prox_mu", "FedProx's proximal term μ (train.prox_mu)", {"train.prox_mu": 0.01}, ()),
    Feature("server_optimizer", "a server optimizer on A's change, e.g. FedAdam (federation.server_optimizer)",
            {"federation.server_optimizer": {"name": "fedadam", "lr": 0.01}}, ("server_optimizer",)),
    Feature("site_ranks", "sites train at their own ranks (federation.site_ranks)",
            {"federation.site_ranks": {"ranks": {0: 2}}}, (),
            needs=(Need(lambda m: m.traits.site_ranks,
                        "one shape at every site, combined coordinate by coordinate"),),
            conflicts=(Conflict("scaffold", "SCAFFOLD's control variates need one parameter shape at every site"),)),
    Feature("export_every_round", "each round's LoRA adapter kept (export.every_round)", {"export.every_round": True}, (),
            needs=(Need(lambda m: m.traits.explicit_adapters,
                        "the global model is not the base plus LoRA adapters (the weights themselves change)"),)),
)

#: the registered stages that are no feature of their own, and why
NOT_FEATURES: dict[str, str] = {
    "site_state": "a method's own per-site state (MethodTraits.keeps_client_state), on with such a method",
}

_BY_NAME = {f.name: f for f in FEATURES}


def feature(name: str) -> Feature:
    """The feature called ``name``."""
    if name not in _BY_NAME:
        raise KeyError(f"unknown feature {name!r}; features: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def method_verdict(method: str, name: str, rank: int = 4) -> Verdict:
    """Whether ``method`` (its default options at ``rank``) runs feature ``name``: every need
    that does not hold is a reason; the method is refused when one of them has no fix."""
    facts = MethodFacts(method, rank)
    return _verdict([n for n in feature(name).needs if not n.holds(facts)])


def pair_verdict(a: str, b: str) -> Verdict:
    """Whether features ``a`` and ``b`` run together (a conflict declared on either side)."""
    return _verdict([c for x, y in ((a, b), (b, a)) for c in feature(x).conflicts if c.other == y])


def _verdict(failed: list[Need] | list[Conflict]) -> Verdict:
    """Refused when a failed need (or a conflict) has no fix; else ✓ with every fix's settings."""
    if any(n.fix is None for n in failed):
        return Verdict(False, tuple(n.reason for n in failed if n.fix is None))
    return Verdict(True, tuple(f"{n.reason} — set {_settings(n.fix or {})}" for n in failed),
                   {k: v for n in failed for k, v in (n.fix or {}).items()})


def _value(v: Any) -> str:
    import json

    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, float):
        return f"{v:g}"
    return v if isinstance(v, str) else json.dumps(v)


def _settings(fix: Mapping[str, Any]) -> str:
    return ", ".join(f"`{k}={_value(v)}`" for k, v in fix.items())


def render_markdown(methods: list[str] | None = None) -> str:
    """docs/compat.md: the (method × feature) and (feature × feature) tables with a numbered note
    per reason, and the features' list. ``methods``: the rows (default: the built-in methods)."""
    if methods is None:
        from fedgalore.methods.listing import builtin_names

        methods = builtin_names()
    notes: dict[str, int] = {}

    def cell(v: Verdict) -> str:
        if v.kind == "yes":
            return "✓"
        refs = ", ".join(str(notes.setdefault(r, len(notes) + 1)) for r in v.reasons)
        return f"{'✓' if v.ok else '✗'} [{refs}]"

    names = [f.name for f in FEATURES]
    lines = [
        "# Compatibility: methods × features",
        "",
        "<!-- generated by `python -m fedgalore.compat` from fedgalore.compat's declarations; "
        "tests/project/test_compat.py checks every cell against the library's own checks -->",
        "",
        "Which round feature runs with which method (each at its default options), and which features run",
        "together. ✓: yes; ✓ [n]: yes, with the settings the notes name; ✗ [n]: refused, for the reasons of",
        "the notes; —: no method listed here runs both. `fedgalore methods --compat` prints these tables;",
        "each cell is derived from the declarations in `fedgalore.compat` (what a feature needs of a",
        "method's declared traits and options, which features exclude each other), and a test runs one",
        "round of every combination on a tiny run to keep them true (a pair of features runs on the first",
        "method that runs both; secure aggregation is built, not run, as its rounds need Flower; a",
        "refused pair no method runs is declared, not tried).",
        "",
        "## Features",
        "",
        "| feature | what it does | turned on by |",
        "|---|---|---|",
    ]
    for f in FEATURES:
        where = f"; {f.where}" if f.where else ""
        on = ", ".join(f"`{k}`" for k in f.enable)
        lines.append(f"| `{f.name}` | {f.description}{where} | {on} |")
    lines += ["", "## Methods × features", "", "| method | " + " | ".join(f"`{n}`" for n in names) + " |",
              "|---|" + "---|" * len(names)]
    for m in methods:
        lines.append(f"| `{m}` | " + " | ".join(cell(method_verdict(m, n)) for n in names) + " |")
    lines += ["", "## Features × features", "", "| | " + " | ".join(f"`{n}`" for n in names) + " |",
              "|---|" + "---|" * len(names)]
    def pair(a: str, b: str) -> str:
        v = pair_verdict(a, b)
        if v.ok and not any(method_verdict(m, a).ok and method_verdict(m, b).ok for m in methods):
            return "—"
        return cell(v)

    for a in names:
        lines.append(f"| `{a}` | " + " | ".join("·" if a == b else pair(a, b) for b in names) + " |")
    lines += ["", "## Notes", ""]
    lines += [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write docs/compat.md (``python -m fedgalore.compat``)."""
    DOC_PAGE.write_text(render_markdown(), encoding="utf-8")
    print(f"wrote {DOC_PAGE}")


if __name__ == "__main__":
    main()
