"""Per-site settings name sites by the names the data gives them (fedgalore.federated.sites):
``federation.site_ranks.ranks`` and ``federation.attack.clients`` under a natural partition,
resolved to client ids once the data is split, and one line listing the sites where a name is wrong."""
from __future__ import annotations

import numpy as np
import pytest

from fedgalore.federated.sites import site_index
from fedgalore.job.clients import resolve_clients, site_ids, split_clients
from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.tasks.synthetic import TinyTextTask

N_TRAIN = 120


class ClinicTask(TinyTextTask):
    """tiny_text with a ``site`` column: three clinics (sorted: clinic_blur, clinic_clean, clinic_noisy)."""

    name = "clinic_text"

    def partition_values(self, column=None):
        if column == "site":
            n = len(self.train_set())
            return np.array(["clinic_clean", "clinic_noisy", "clinic_blur"])[np.arange(n) % 3]
        return super().partition_values(column)


def _cfg(**federation) -> FederatedConfig:
    fed = {"clients_per_round": None, "rounds": 1, "partition": {"kind": "natural", "column": "site"}, **federation}
    return FederatedConfig.from_dict({
        "task": {"name": "tiny_text", "options": {"n_train": N_TRAIN, "n_test": 16}},
        "method": {"name": "fedgalore", "rank": 4}, "federation": fed,
        "train": {"batch_size": 8}, "output": {"progress": "quiet"}})


def _resolved(cfg: FederatedConfig) -> FederatedConfig:
    """The config the round runs with (the recorded one keeps the names: checked by resolve_clients)."""
    clients = split_clients(cfg, ClinicTask(n_train=N_TRAIN, n_test=16))
    recorded = resolve_clients(cfg, clients)
    assert recorded.to_dict()["federation"]["site_ranks"] == cfg.to_dict()["federation"]["site_ranks"]
    return site_ids(recorded, clients)


def test_site_ranks_and_attack_name_sites_by_their_names():
    cfg = _cfg(site_ranks={"ranks": {"clinic_noisy": 2, "clinic_clean": 8, 0: 4}})
    got = _resolved(cfg)
    assert got.federation.site_ranks.ranks == {2: 2, 1: 8, 0: 4}  # sorted by name: blur 0, clean 1, noisy 2
    assert cfg.federation.site_ranks.ranks == {"clinic_noisy": 2, "clinic_clean": 8, 0: 4}  # the given config is kept
    assert got.to_dict()["federation"]["site_ranks"]["ranks"] == {2: 2, 1: 8, 0: 4}  # what Ray actors and Flower nodes get
    attacked = _resolved(_cfg(attack={"clients": ["clinic_blur", 2]}))
    assert attacked.federation.attack.clients == [0, 2]


@pytest.mark.parametrize("federation", [{"site_ranks": {"ranks": {"clinic_dirty": 2}}},
                                        {"attack": {"clients": ["clinic_dirty"]}}])
def test_a_wrong_site_name_lists_the_sites_and_their_ids(federation):
    with pytest.raises(ConfigError) as err:
        _resolved(_cfg(**federation))
    msg = str(err.value)
    assert "no site named 'clinic_dirty'" in msg and "clinic_blur=0, clinic_clean=1, clinic_noisy=2" in msg
    assert "\n" not in msg


def test_names_need_a_partition_that_names_sites():
    with pytest.raises(ConfigError, match="kind=dirichlet names no sites"):
        _cfg(num_clients=3, partition={"kind": "dirichlet", "alpha": 0.5}, site_ranks={"ranks": {"clinic_noisy": 2}})
    with pytest.raises(ConfigError, match="kind=iid names no sites"):
        _cfg(num_clients=3, partition={"kind": "iid"}, attack={"clients": ["clinic_noisy"]})
    with pytest.raises(ConfigError, match=r"site 5 does not exist \(the partition has 3 clients\); use ids 0..2"):
        site_index(5, None, 3, "federation.site_ranks.ranks")
    assert site_index("1", ["a", "b"], 2, "x") == 1  # digits from a command-line override are an id


def test_a_run_with_named_sites_trains_them_at_their_ranks_and_is_found_again(tmp_path, monkeypatch):
    """The run records the names as given (config.yaml, identity), so the same config is the same
    run; the method trains each site at its named rank."""
    import sys
    import types

    import fedgalore
    from fedgalore.engine.runtime import Runtime
    from fedgalore.tasks import TASKS

    mod = types.ModuleType("fg_clinic_tasks")
    mod.ClinicTask = ClinicTask
    monkeypatch.setitem(sys.modules, "fg_clinic_tasks", mod)
    monkeypatch.setitem(TASKS, "clinic_text", "fg_clinic_tasks:ClinicTask")
    d = _cfg(site_ranks={"ranks": {"clinic_noisy": 2, "clinic_clean": 8}}).to_dict()
    d["task"]["name"], d["output"]["dir"] = "clinic_text", str(tmp_path / "runs")
    cfg = FederatedConfig.from_dict(d)
    assert Runtime(cfg).site_ranks == [4, 8, 2]  # blur at method.rank
    first = fedgalore.run(cfg)
    assert "clinic_noisy: 2" in (first.run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="already holds this run"):  # not a new "-2" directory
        fedgalore.run(FederatedConfig.from_dict(d))
