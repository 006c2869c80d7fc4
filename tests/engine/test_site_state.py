"""A method's own state at simulated sites (FedSA-LoRA's local B) is kept with the run
(fedgalore.engine.stages.site_state): a killed and resumed run ends as the uninterrupted one."""
from __future__ import annotations


import fedgalore
from fedgalore_testing.runs import killed_and_resumed, tiny_cfg


def _cfg(tmp_path, rounds=4):
    fed = {"num_clients": 4, "clients_per_round": 2, "rounds": rounds, "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}}
    return tiny_cfg(tmp_path, "fedsa_lora", rounds=rounds, federation=fed, output={"dir": str(tmp_path), "progress": "quiet",
                                                                                      "checkpoint_every": 1, "keep_checkpoints": 1})


def test_fedsa_lora_resumes_with_each_sites_b(tmp_path):
    full, resumed = killed_and_resumed(_cfg(tmp_path / "full"), _cfg(tmp_path / "killed"), at_round=2)
    sites = sorted(p.name for p in (resumed.run_dir / "sites").iterdir())
    assert sites and all(s.startswith("site-") for s in sites)
    # only what a kept checkpoint can need (pruned when a round is written, before that round's own checkpoint):
    # per site its file at or before the previous checkpoint and the newer ones
    counts = [len(list((resumed.run_dir / "sites" / s).glob("round-*.safetensors"))) for s in sites]
    assert max(counts) <= 2, counts


def test_a_method_without_site_state_writes_none(tmp_path):
    res = fedgalore.run(tiny_cfg(tmp_path, "fedit", rounds=1))
    assert not (res.run_dir / "sites").exists()
