"""What simulated sites keep between rounds, kept on disk with the run so a resume continues them.

A method that keeps state of its own at each site (:attr:`~fedgalore.methods.base.Method.
needs_client_state`: FedSA-LoRA's local ``B``) holds it in the client's store
(:attr:`~fedgalore.protocol.state.ClientContext.state`). A real site keeps it on its own disk; the
sequential backend simulates every site in one process and keeps the stores in memory, so without
this stage a resumed run would restart every site from its initial state and end elsewhere than
the uninterrupted run. After every round this stage writes the stores that changed
(:func:`~fedgalore.protocol.state.own_entries`, one safetensors file per site and round:
``<run dir>/sites/site-NNNNN/round-NNNNNN.safetensors``, the number the rounds done); on a resume
from the checkpoint after round ``S`` it loads, per site, the newest file of at most ``S`` rounds
(the site as it was at that checkpoint). Files no kept checkpoint can need are removed. Flower
nodes keep their own (``Context.state``, fedgalore.flower.client_app); the server writes nothing
for them. Under client-level DP the server view (fedgalore.privacy.view, ``site_state``) keeps a site's raw
local state out of the server's run directory: the stores stay in memory and a resume restarts them.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from fedgalore.engine.stages.base import RoundStage, RunView
from fedgalore.federated.checkpoint import kept_rounds
from fedgalore.protocol.state import own_entries

__all__ = ["SiteState"]

_FILE = re.compile(r"^round-(\d+)\.safetensors$")


class SiteState(RoundStage):
    """The sites' own stores on disk (module doc)."""

    name = "site_state"
    server_only = True

    def __init__(self, root: Path, runtime: Any) -> None:
        self.root, self.runtime = root, runtime
        #: the entries last written per site (the objects themselves: a site that trains replaces them)
        self._written: dict[int, dict[str, Any]] = {}

    @classmethod
    def build(cls, cfg: Any, runtime: Any, run: RunView | None) -> "SiteState | None":
        if run is None or not run.method.traits.keeps_client_state or getattr(runtime, "client_state", None) is None:
            return None
        if not runtime.view.site_state:  # client-level DP: a site's raw local state never enters the server's files
            run.say(f"privacy ({runtime.view.level}): the sites' own state stays in the simulated sites' memory, not in "
                    "the run directory; a resumed run restarts it from its initial value")
            return None
        return cls(Path(run.run_dir) / "sites", runtime)

    def start(self, state, resumed: bool, start_round: int, rounds: int) -> None:
        if not resumed:
            shutil.rmtree(self.root, ignore_errors=True)  # an earlier attempt's sites, never checkpointed
            return
        from safetensors.torch import load_file

        for site_dir in sorted(self.root.glob("site-*")):
            done = [(int(m.group(1)), f) for f in site_dir.iterdir() if (m := _FILE.match(f.name)) and int(m.group(1)) <= start_round]
            if not done:
                continue
            client = int(site_dir.name.split("-", 1)[1])
            flat = load_file(str(max(done)[1]))
            entries: dict[str, dict[str, Any]] = {}
            for key, t in flat.items():
                entry, name = key.split("/", 1)
                entries.setdefault(entry, {})[name] = t
            self.runtime.client_state.setdefault(client, {}).update(entries)
            self._written[client] = dict(entries)

    def round_record(self, state, round_idx: int, uploads: list) -> dict[str, float]:
        from safetensors.torch import save_file

        done = round_idx + 1
        for client, store in (self.runtime.client_state or {}).items():
            own = own_entries(store)
            last = self._written.get(client, {})
            if not own or (own.keys() == last.keys() and all(own[k] is last[k] for k in own)):
                continue  # did not train since it was written
            site_dir = self.root / f"site-{int(client):05d}"
            site_dir.mkdir(parents=True, exist_ok=True)
            flat = {f"{entry}/{name}": t.detach().cpu().contiguous() for entry, tensors in own.items() for name, t in tensors.items()}
            tmp = site_dir / f".round-{done:06d}.tmp"
            save_file(flat, str(tmp), metadata={"rounds_done": str(done)})
            tmp.replace(site_dir / f"round-{done:06d}.safetensors")
            self._written[client] = dict(own)
        self._prune()
        return {}

    def _prune(self) -> None:
        """Drop the files no kept checkpoint can need: per site, everything older than its newest
        file at or before the oldest kept checkpoint (no checkpoint yet: keep all)."""
        kept = kept_rounds(self.root.parent)
        if not kept:
            return
        oldest = kept[0]
        for site_dir in self.root.glob("site-*"):
            files = sorted((int(m.group(1)), f) for f in site_dir.iterdir() if (m := _FILE.match(f.name)))
            base = [r for r, _ in files if r <= oldest]
            if base:
                for r, f in files:
                    if r < max(base):
                        f.unlink(missing_ok=True)
