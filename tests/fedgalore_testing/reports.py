"""Run directories written by hand in the exact format the engine writes, and markdown table rows."""
from __future__ import annotations

import json
from pathlib import Path


LABELS = ["business", "sport", "tech"]


def write_run(
    root: Path,
    method: str,
    setting: str,
    seed: int,
    final: float,
    *,
    task: str = "tiny_text",
    rounds: int = 3,
    status: str = "complete",
    up: int = 1000,
    down: int = 2000,
    tpr: float = 0.5,
    metric: str = "accuracy",
    higher_is_better: bool = True,
    name: str | None = None,
    lr: float = 1e-3,
) -> Path:
    """A run directory in the engine's format; the metric climbs linearly to ``final``."""
    d = root / (name or f"{method}-{setting.replace(':', '')}-s{seed}")
    d.mkdir(parents=True)
    hist, cum_up, cum_down = [], 0, 0
    clients = [0, 1]
    for k in range(1, rounds + 1):
        cum_up += up * len(clients)
        cum_down += down * len(clients)
        v = final - 0.1 * (rounds - k)
        hist.append({
            "round": k, "clients": clients, "train_loss": 1.0 / k, f"eval/{metric}": v, "eval/loss": 2.0 / k,
            "bytes_up": up * 2, "bytes_down": down * 2, "cum_bytes_up": cum_up, "cum_bytes_down": cum_down,
            "time_round": tpr, "time_clients": tpr * 0.8, "time_server": 0.05, "time_eval": 0.05,
        })
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    diags = [{"round": k, "tail_energy_mean": 0.1 / k, "tail_energy_max": 0.2 / k, "drift_mean": 1.0 + k,
              "mismatch_before": 0.5, "mismatch_after": 0.1, "ajive_rank": 2.0} for k in range(1, rounds + 1)]
    (d / "diagnostics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in diags))
    hists = [[10, 0, 5], [1, 12, 2]] if setting != "iid" else [[5, 5, 5], [5, 5, 5]]
    (d / "partition.json").write_text(json.dumps({"setting": setting, "label_names": LABELS, "histograms": hists,
                                                  "sizes": [sum(h) for h in hists]}))
    (d / "config.yaml").write_text(
        f"name: test\nseed: {seed}\ntask: {{name: {task}, options: {{}}}}\nmethod: {{name: {method}, rank: 4, options: {{}}}}\n"
        f"federation: {{num_clients: 4, clients_per_round: 2, rounds: {rounds}}}\n"
        f"train: {{lr: {lr}, batch_size: 8, local_epochs: 1.0, local_steps: 2, sgd_lr: null}}\n")
    summary = {
        "name": d.name, "task": task, "method": method, "setting": setting, "seed": seed,
        "rounds_completed": rounds if status == "complete" else rounds - 1, "rounds": rounds, "status": status,
        "primary_metric": metric, "higher_is_better": higher_is_better,
        "final": {metric: final, "loss": 0.5}, "best": {metric: final + 0.01, "loss": 0.4},
        "bytes_up_total": up * 2 * rounds, "bytes_down_total": down * 2 * rounds,
        "bytes_up_per_client_round": up, "bytes_down_per_client_round": down,
        "wall_time": tpr * rounds, "time_per_round": tpr,
    }
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _md_row(md: str, name: str) -> list[str]:
    row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
    return [c.strip() for c in row.strip("|").split("|")]
