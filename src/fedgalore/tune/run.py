"""``tune``: search, confirm, report — in this process and ``workers - 1`` others.

Workers: ``spec.workers`` processes (this one and ``workers - 1`` started with multiprocessing's
*spawn*) search the rows on one storage, then share the confirmation cells (claimed in
``<out>/confirm/.claims``); this process writes the report once all have ended. Run them
single-threaded (``OMP_NUM_THREADS=1``): N workers on N cores.

Privacy: under ``privacy.record`` or ``privacy.client`` every trial is another release on the
same sites. A tune is therefore refused unless every site keeps a ledger that counts it
(``privacy.sites_dir``, or per-site data with the site's own ``fedgalore-policy.yaml``): then the
sites' policies admit or refuse each trial's releases as they would any run's, and the report
shows what the ledgers recorded during the tune (:func:`privacy_ledgers`).
"""
from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any, Callable

from fedgalore.job.config import ConfigError
from fedgalore.tune.search import TuneSpec, build_rows, open_study, search, storage_url

__all__ = ["tune", "privacy_ledgers", "check_privacy"]


def _ledger_files(spec: TuneSpec) -> list[Path]:
    from fedgalore.privacy.site import LEDGER_FILE

    p = spec.base.privacy
    if p.sites_dir:
        return sorted(Path(p.sites_dir).glob(f"*/{LEDGER_FILE}"))
    part = spec.base.federation.partition
    files = getattr(part, "files", None) or {}
    return [Path(f).parent / LEDGER_FILE for f in (files.values() if isinstance(files, dict) else files)]


def check_privacy(spec: TuneSpec) -> None:
    """Refuse, in one line, a tune under privacy whose sites keep no ledger (module doc)."""
    p = spec.base.privacy
    if not p.enabled:
        return
    if p.sites_dir or spec.base.federation.partition.kind == "files":
        return
    raise ConfigError("tuning under privacy.* spends privacy budget on every trial and confirmation run (each is "
                      "another release on the same sites) and this config keeps no site ledger to count it: set "
                      "privacy.sites_dir (each site's policy and ledger, docs/privacy.md) so every trial is accounted "
                      "and capped by the sites' budgets, or tune on a public or proxy split without privacy.* and "
                      "run the chosen configuration privately once")


def _ledger_state(spec: TuneSpec) -> dict[str, int]:
    out = {}
    for path in _ledger_files(spec):
        try:
            out[str(path)] = len(path.read_text(encoding="utf-8").splitlines())
        except OSError:
            out[str(path)] = 0
    return out


def _ledger_start(spec: TuneSpec) -> dict[str, int]:
    """The ledgers' lengths when this tune first started (kept in ``<out>/ledgers_at_start.json``,
    so a resumed tune still counts what its killed part released)."""
    import json

    path = spec.out / "ledgers_at_start.json"
    if path.is_file():
        return json.loads(path.read_text())
    state = _ledger_state(spec)
    spec.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=1) + "\n")
    return state


def privacy_ledgers(spec: TuneSpec, before: dict[str, int]) -> dict[str, Any] | None:
    """What the sites' ledgers recorded since ``before`` (lines per file): ε per site of those
    releases at the policies' δ (1e-5 without a policy)."""
    if not spec.base.privacy.enabled:
        return None
    from fedgalore.privacy.site import POLICY_FILE, SiteLedger, epsilons, load_policy

    sites: dict[str, dict[str, float]] = {}
    releases, delta = 0, 1e-5
    for path in _ledger_files(spec):
        lines = SiteLedger(path).lines()
        skip = before.get(str(path), 0)
        new = lines[skip:] if skip <= len(lines) else []
        policy = path.parent / POLICY_FILE
        d = load_policy(policy).delta if policy.is_file() else 1e-5
        delta = d
        if new:
            releases += len(new)
            sites[path.parent.name] = epsilons(new, d)
    return {"where": str(spec.base.privacy.sites_dir or "beside each site's data"), "releases": releases, "delta": delta,
            "sites": sites}


def _say_worker(i: int) -> Callable[[str], None]:
    return lambda text: print(f"[worker {i}] {text}", flush=True)


def _search_worker(spec: TuneSpec, i: int, ready: Any = None) -> None:
    import dataclasses

    spec = dataclasses.replace(spec, worker=i)
    rows = build_rows(spec)
    if ready is not None:
        ready.set()
    search(spec, rows, _say_worker(i))


def _confirm_worker(spec: TuneSpec, i: int, ready: Any = None) -> None:
    from fedgalore.tune.confirm import candidates, confirm_cells, run_cells

    rows = build_rows(spec)
    cells = confirm_cells(spec, candidates(spec, rows))
    if ready is not None:
        ready.set()
    run_cells(spec, cells, _say_worker(i))


def _with_workers(spec: TuneSpec, target: Callable[..., None], mine: Callable[[], None], patience_s: float = 300.0) -> None:
    """Run ``target`` in ``spec.workers - 1`` spawned processes beside ``mine`` here; this process
    starts its own share once the others are ready (a spawned process imports torch first: without
    the wait, this one would take the first trials alone) or ``patience_s`` has passed, or one of
    them died; wait for all; a worker that failed is a ConfigError naming its exit code."""
    import time

    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(1, spec.workers)]
    procs = [ctx.Process(target=target, args=(spec, i, ev), daemon=False) for i, ev in zip(range(1, spec.workers), ready)]
    for p in procs:
        p.start()
    try:
        t0 = time.monotonic()
        while not all(ev.is_set() for ev in ready) and time.monotonic() - t0 < patience_s:
            if any(p.exitcode is not None and not ev.is_set() for p, ev in zip(procs, ready)):
                break
            time.sleep(0.2)
        mine()
    finally:
        for p in procs:
            p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise ConfigError(f"{len(bad)} tune worker(s) failed (exit {bad[0]}); run the same command again: finished "
                          "trials and cells are kept, the rest resume")


def tune(spec: TuneSpec, say: Callable[[str], None] | None = None, *, confirm: bool = True) -> Path:
    """Search every row, confirm the choices on the held-out seeds, write the report; returns the
    report's path (``<out>/tune_report.md``). Everything is kept in ``spec.out``: running it again
    continues where it stopped."""
    say = say or (lambda text: print(text, flush=True))
    if spec.trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {spec.trials}")
    if spec.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {spec.workers}")
    if spec.last < 1:
        raise ConfigError(f"--last must be at least 1, got {spec.last}")
    check_privacy(spec)
    rows = build_rows(spec)
    url = storage_url(spec)
    for row in rows:  # create (or check) every study here, before workers race to
        open_study(spec, row, url)
    before = _ledger_start(spec)
    say(f"tune: {len(rows)} row(s) x {spec.trials} trial(s) on {url} ({spec.workers} worker(s)); output {spec.out}")
    _with_workers(spec, _search_worker, lambda: search(spec, rows, say))
    from fedgalore.tune.confirm import candidates, confirm_cells, load_cells, run_cells

    cands = candidates(spec, rows)
    cells = confirm_cells(spec, cands)
    if confirm:
        say(f"tune: confirming {len(cands)} configuration(s) on seeds {','.join(map(str, spec.heldout_seeds))}: {len(cells)} run(s)")
        _with_workers(spec, _confirm_worker, lambda: run_cells(spec, cells, say))
    from fedgalore.tune.report import build_report

    path = build_report(spec, rows, cands, load_cells(spec, cells), privacy_ledgers(spec, before),
                        confirm_wall_s=None)
    say(f"tune: report {path} (and tune_report.json, tune_search.png, tune_history.png, tune_heldout.png)")
    return path
