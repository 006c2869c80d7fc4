"""``fedgalore plan`` (issue 18): bytes per round from shapes and payload types, checked against
the ledger of real runs at a tiny size; component sizes against the live objects of those runs;
the Llama-2-7B plan without the hub; the per-phase memory formula; the peak tracker."""
import json
import math

import pytest
import torch

from fedgalore.job.config import FederatedConfig
from fedgalore.memory import PeakTracker, peak_tracking_available, tensor_bytes
from fedgalore.plan import PlanError, make_plan, phase_peaks

METHODS = ["fedgalore", "fedavg_full", "fedit", "ffa_lora", "flora", "fr_lora", "lora_fair",
           "fedex_lora", "fedsa_lora", "fed_sb", "flexlora", "hetlora"]


def _cfg(tmp_path, method, **over):
    data = {
        "name": "plan-tiny", "seed": 3,
        "task": {"name": "tiny_text", "options": {"n_train": 96, "n_test": 16}},
        "method": {"name": method, "rank": 4, "options": {"update_proj_gap": 2} if method.startswith("fedgalore") else {}},
        "federation": {"num_clients": 3, "clients_per_round": None, "rounds": 2, "eval_every": 2,
                       "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 4}},
        "train": {"lr": 1e-3, "batch_size": 8, "local_epochs": 1},
        "output": {"dir": str(tmp_path), "progress": "quiet"},
        "diagnostics": False,
    }
    data.update(over)
    return FederatedConfig.from_dict(data)


@pytest.mark.parametrize("method", METHODS)
def test_bytes_per_round_match_a_real_run(tmp_path, method):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from fedgalore.engine.loop import Federation

    cfg = _cfg(tmp_path, method)
    plan = make_plan(cfg, [method])["methods"][method]
    if method in ("fedgalore", "flora", "fr_lora", "fedex_lora"):  # the plan's downlink is dense: the most a client receives
        default = Federation(cfg, run_dir=tmp_path / "default")
        default.run()
        down = [r["bytes"] for r in default.ledger.records if r["direction"] == "down"]
        # at most the plan's dense message (+ the model version in the header), less when a chain travels
        assert down and max(down) <= plan["down_per_client"] + 32 and min(down) < plan["down_per_client"]
        cfg = _cfg(tmp_path, method)
        cfg.method.options["downlink"] = "dense"
    opt_peak = [0]
    handle = register_optimizer_step_post_hook(lambda opt, *a: opt_peak.__setitem__(0, max(opt_peak[0], tensor_bytes(dict(opt.state)))))
    try:
        fed = Federation(cfg, run_dir=tmp_path / "run")
        fed.run()
    finally:
        handle.remove()
    recs = fed.ledger.records
    probe = plan["probe"]
    for rnd, expect, tensors in ((1, plan["down_per_client_round0"], probe["down_first_tensor_bytes"]),
                                 (2, plan["down_per_client"], probe["down_tensor_bytes"])):
        down = [r for r in recs if r["round"] == rnd and r["direction"] == "down"]
        assert len(down) == 3
        assert all(r["bytes"] == expect for r in down)  # broadcasts: exact to the byte
        assert all(sum(r["tensor_bytes"].values()) == tensors for r in down)
    up = sorted((r for r in recs if r["round"] == 2 and r["direction"] == "up"), key=lambda r: r["client"])
    assert [sum(r["tensor_bytes"].values()) for r in up] == plan["up_tensor_bytes_by_client"]  # tensors: exact
    for r, predicted in zip(up, plan["up_by_client"]):
        assert abs(r["bytes"] - predicted) <= 96  # headers: only the digits of loss values differ
    # components: the plan's (from the shape miniature) equal the live objects'
    assert probe["server_state"] == tensor_bytes([fed.state.params, fed.state.extras, getattr(fed.state, "moments", {})])
    assert probe["trained"] == sum(p.numel() * p.element_size() for p in fed.runtime.model.parameters() if p.requires_grad)
    assert probe["model"] == tensor_bytes(list(fed.runtime.model.parameters()))
    assert plan["memory"]["components"]["optimizer_state"] == opt_peak[0]


def test_galore_refresh_terms_follow_the_step_count(tmp_path):
    """q = ⌈T/τ⌉ terms per client round: more local steps, more (seeded) terms in the upload."""
    short = make_plan(_cfg(tmp_path, "fedgalore", train={"lr": 1e-3, "batch_size": 8, "local_epochs": 1}), ["fedgalore"])
    long = make_plan(_cfg(tmp_path, "fedgalore", train={"lr": 1e-3, "batch_size": 2, "local_epochs": 1}), ["fedgalore"])
    qs, ql = short["methods"]["fedgalore"]["refreshes_per_round"], long["methods"]["fedgalore"]["refreshes_per_round"]
    assert max(ql) > max(qs)
    assert max(long["methods"]["fedgalore"]["up_by_client"]) > max(short["methods"]["fedgalore"]["up_by_client"])


def test_llama2_7b_plan_needs_no_hub():
    from fedgalore.cli import _load_config

    cfg, _ = _load_config("conf/pipeline/metamath_llama2.yaml", [])
    plan = make_plan(cfg, ["fedgalore", "fedavg_full"])
    assert plan["params"] == 6_738_415_616  # Llama-2-7B
    targets = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    g, f = plan["methods"]["fedgalore"], plan["methods"]["fedavg_full"]
    assert g["probe"]["down_first_tensor_bytes"] == f["probe"]["down_first_tensor_bytes"] == 4 * targets  # fp32 dense targets
    assert f["probe"]["up_tensor_bytes"] == 4 * targets
    # 395k examples / 4 clients, batch 2 × 32 = 64 per step: 1543–1544 steps; the epoch schedule (adaptive_epochs
    # 0.5) switches to R_k at step 772: RSVD refreshes at 0, 200, 400, 600 (τ = 200) and one on R_k → 5 terms
    assert g["refreshes_per_round"] == [5] and g["data_driven_terms_per_round"] == [4]
    mem = g["memory"]["components"]
    assert mem["model"] == 2 * 6_738_415_616 and mem["gradients"] == 2 * targets  # bf16
    assert f["memory"]["components"]["optimizer_state"] == 2 * 2 * targets + 224 * 4  # AdamW m, v in bf16; a float32 step per matrix
    assert g["up_per_client"] < f["up_per_client"] / 10
    # bf16 GaLore weights: the compensation of each step's rounding (2 bytes per adapted entry; an fp32
    # master copy would be 4) is part of the optimizer state (the fp32 miniature has none of it)
    from fedgalore.plan import Probe, low_precision_bytes, model_spec

    spec, _ = model_spec(cfg)
    probe = Probe(**g["probe"])
    assert low_precision_bytes(cfg, spec, probe) == 2 * targets
    assert mem["optimizer_state"] >= 2 * targets
    cfg.method.options["low_precision"] = "master"
    assert low_precision_bytes(cfg, spec, probe) == 4 * targets
    assert low_precision_bytes(cfg, spec, Probe(**f["probe"])) == 0  # FedAvg-Full: torch's AdamW


def test_a_site_with_two_devices_is_planned_per_rank():
    """Llama-2-7B, FedGaLore: data parallel holds a replica per rank (the training phase as one device,
    with the activations of half the rows); sharded holds half of W + G + O (+ T) plus the root (embeddings,
    lm_head, final norm) and two layers gathered with their gradients; the whole model waits on the host;
    the bytes and the probe do not change (the miniature runs in one process)."""
    from fedgalore.cli import _load_config
    from fedgalore.plan import activation_bytes, fsdp_units, model_spec

    def plan(*over):
        cfg, _ = _load_config("conf/pipeline/metamath_llama2.yaml", list(over))
        return cfg, make_plan(cfg, ["fedgalore"])["methods"]["fedgalore"]

    cfg, one = plan()
    _, dp = plan("train.devices_per_client=2")
    _, fs = plan("train.devices_per_client=2", "train.shard_params=true")
    spec, _ = model_spec(cfg)
    root, layer = fsdp_units(spec)
    assert root == 2 * (2 * 32000 * 4096 + 4096)  # embed_tokens, lm_head, final norm (bf16)
    assert layer == 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)  # one decoder layer
    assert one["probe"] == dp["probe"] == fs["probe"] and one["per_round"] == fs["per_round"]
    c = one["memory"]["components"]
    a = spec.arch
    half_rows = activation_bytes(a, -(-cfg.train.batch_size // 2), int(a["max_length"]), spec.dtype)
    W, G, O = c["model"], c["gradients"], c["optimizer_state"]
    assert dp["memory"]["site"]["rank"] == W + G + O + half_rows
    gathered = int((1 + G / W) * (root + 2 * layer))
    assert fs["memory"]["site"]["rank"] == -(-(W + G + O) // 2) + gathered + half_rows
    t1, t2 = one["memory"]["phases"]["client_training"], fs["memory"]["phases"]["client_training"]
    assert t2["accelerator"] == t1["accelerator"] - (W + G + O + c["activations"]) + fs["memory"]["site"]["rank"]
    assert t2["host"] == t1["host"] + W  # the client's whole model, on the host for the round
    assert fs["memory"]["phases"]["evaluation"] == one["memory"]["phases"]["evaluation"]  # evaluated whole on rank 0


def test_unknown_model_is_one_clear_error():
    cfg = FederatedConfig.from_dict({"task": {"name": "metamath", "options": {"model": "someone/unknown-7b"}}})
    with pytest.raises(PlanError, match="no config for model 'someone/unknown-7b'.*task.options.model"):
        make_plan(cfg, ["fedgalore"])


def test_cli_plan(tmp_path, capsys):
    from fedgalore.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--config", "conf/pipeline/metamath_llama2.yaml", "--methods", "fedgalore", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| fedgalore |" in text and "peak accelerator" in text and "(6.74 B params," in text
    assert json.loads(out.read_text())["methods"]["fedgalore"]["refreshes_per_round"] == [5]
    assert main(["plan", "--config", "conf/pipeline/metamath_llama2.yaml", "task.options.model=nowhere/x"]) == 2


def test_parameter_counts_read_sensibly(tmp_path):
    """A 0.2 M-parameter model is 0.2 M in the plan's title, not "0.00 B"."""
    from fedgalore.plan import format_plan
    from fedgalore.report.tables import format_count

    assert [format_count(n) for n in (950, 12_345, 200_000, 123_456_789, 1_100_000_000)] == \
        ["950", "12.3 k", "0.2 M", "123.5 M", "1.10 B"]
    plan = make_plan(_cfg(tmp_path, "fedgalore"), ["fedgalore"])
    title = format_plan(plan).splitlines()[0]
    assert f"({format_count(plan['params'])} params," in title and "0.00 B" not in title


def test_phase_formula():
    c = dict(model=10, gradients=5, optimizer_state=2, activations=1, server_state=20, broadcast_blob=21, upload_blob=3, eval_kv_cache=7)
    gpu = phase_peaks(c, clients=4, on_host=False, diagnostics=True, dense_uploads=False)
    # the server state lives on the host; in process: the client's copy of the broadcast and the
    # earlier uploads, nothing serialised
    assert gpu["client_training"] == {"accelerator": 10 + 5 + 2 + 1, "host": 20 + 21 + 3 * 3}
    assert gpu["upload"]["host"] == 20 + 21 + 3 * 3 + 2 * 3  # its tensors and the server's copy
    assert gpu["aggregation"] == {"accelerator": 10, "host": 20 + 4 * 3 + 20}
    assert gpu["diagnostics"]["host"] == 20 + 12 + 20 + 4 * 20 + 20
    assert gpu["evaluation"]["accelerator"] == 10 + 7
    assert gpu["checkpoint"] == {"accelerator": 10, "host": 20}  # streamed tensor by tensor: no blob
    cpu = phase_peaks(c, clients=4, on_host=True, diagnostics=False, dense_uploads=True)
    assert "diagnostics" not in cpu and cpu["checkpoint"] == {"accelerator": 0, "host": 30}


@pytest.mark.skipif(not peak_tracking_available(), reason="needs Linux /proc/self/clear_refs")
def test_peak_tracker_sees_a_freed_buffer():
    import ctypes

    # after a long test session the allocator may hold more free, still-resident memory than the
    # buffer below, which would then not raise the RSS: give it back to the OS first
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    tr = PeakTracker()
    with tr.phase("outer"):
        with tr.phase("inner"):
            x = torch.ones(64 * 2**20 // 4)  # 64 MiB
            x += 1
            del x
    inner, outer = tr.records
    assert inner["name"] == "inner" and outer["name"] == "outer"
    assert inner["peak"] - inner["rss_before"] >= 60 * 2**20
    assert outer["peak"] >= inner["peak"]


def test_sites_at_their_own_ranks_are_planned_per_tier(tmp_path):
    """federation.site_ranks: each site's uplink is its own rank's, to the tensor byte, against a real
    run of the mixed federation; the downlink is the largest rank's; a tier whose stated device is
    too small is named."""
    from fedgalore.engine.loop import Federation

    fed_over = {"num_clients": 3, "clients_per_round": None, "rounds": 2, "eval_every": 2,
                "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 4},
                "site_ranks": {"tiers": [{"rank": 2, "device_gb": 1e-3}, {"rank": 4}, {"rank": 8, "device_gb": 64}]}}
    cfg = _cfg(tmp_path, "fedgalore", federation=fed_over)
    cfg.method.options["downlink"] = "dense"
    plan = make_plan(cfg, ["fedgalore"])
    entry = plan["methods"]["fedgalore"]
    assert [t["rank"] for t in entry["sites"]] == [2, 4, 8] and [t["sites"] for t in entry["sites"]] == [[0], [1], [2]]
    assert plan["sites_not_fitting"] == {"fedgalore": [0]}
    assert entry["sites"][2]["fit"]["fits"] is True
    fed = Federation(cfg, run_dir=tmp_path / "run")
    fed.run()
    up = sorted((r for r in fed.ledger.records if r["round"] == 2 and r["direction"] == "up"), key=lambda r: r["client"])
    assert [sum(r["tensor_bytes"].values()) for r in up] == entry["up_tensor_bytes_by_client"]
    assert entry["up_tensor_bytes_by_client"][0] < entry["up_tensor_bytes_by_client"][1] < entry["up_tensor_bytes_by_client"][2]
    down = [r for r in fed.ledger.records if r["round"] == 2 and r["direction"] == "down"]
    assert all(abs(r["bytes"] - entry["down_per_client"]) <= 32 for r in down)  # the frame's broadcast (+ its header)
    text = __import__("fedgalore.plan", fromlist=["format_plan"]).format_plan(plan)
    assert "## Sites at their own ranks" in text and "Sites that do not fit their device: fedgalore: 0." in text
    with pytest.raises(PlanError, match="site_ranks: method 'fedit'"):
        make_plan(cfg, ["fedit"])


@pytest.mark.parametrize("method", ["fedgalore", "fedit"])
def test_plan_says_the_noise_against_the_signal_under_client_dp(tmp_path, capsys, method):
    """Client-level DP: the plan gives d from its miniature's upload (FedGaLore: coefficient blocks
    over ⌈T/τ⌉ refreshes), equal to what the run counts (Method.released_coordinates), and prints
    noise_vs_signal's line — the run says the same before round 1."""
    import yaml

    from fedgalore.cli import main
    from fedgalore.engine.loop import Federation
    from fedgalore.federated.client import optimizer_steps
    from fedgalore.privacy.signal import noise_vs_signal

    opts = {"update_proj_gap": 2, "projector": "random", "view_basis": "seeded"} if method == "fedgalore" else {}
    # FedGaLore under client DP runs a fixed train.local_steps (its upload's size follows the steps)
    length = {"local_steps": 3} if method == "fedgalore" else {"local_epochs": 1}
    data = _cfg(tmp_path, method, train={"lr": 1e-3, "batch_size": 8, **length, "weight_decay": 0.0},
                privacy={"client": {"clip": 0.5, "noise_multiplier": 1.0}}).to_dict()
    data["method"]["options"] = opts
    data["federation"]["clients_per_round"] = 2
    cfg = FederatedConfig.from_dict(data)
    plan = make_plan(cfg, [method])["methods"][method]
    fed = Federation(cfg)
    rt = fed.runtime
    steps = 3 if method == "fedgalore" else max(optimizer_steps(rt.micro_batches(len(p)), 1) for p in rt.parts)
    d = rt.method.released_coordinates(rt.model, steps)
    assert plan["client_dp_signal"]["dim"] == d
    expected = noise_vs_signal(1.0, 0.5, d, 2)
    assert plan["client_dp_signal"]["noise_norm"] == pytest.approx(1.0 * 0.5 * math.sqrt(d) / 2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    capsys.readouterr()
    assert main(["plan", "--config", str(path)]) == 0
    assert expected.line() in capsys.readouterr().out
