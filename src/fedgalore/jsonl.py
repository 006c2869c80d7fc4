"""JSON-lines records (metrics, clients, ledger, diagnostics): one JSON object per line; and the
run directory's single JSON files read the same forgiving way (:func:`read_json`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "append_jsonl", "read_json"]


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


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` (a run's summary.json, privacy.json, lock): None when the file
    is absent, unreadable, torn (a killed writer) or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None
