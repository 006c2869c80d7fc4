"""JSON-lines records (metrics, clients, ledger, diagnostics): one JSON object per line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "append_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of ``path`` ([] if absent); an undecodable line (e.g. torn by a killed writer) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_jsonl(path: Path, rec: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(rec, sort_keys=True) + "\n")
