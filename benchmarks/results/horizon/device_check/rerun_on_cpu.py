"""Device check for issue 33 B: re-run cells that ran on a GPU on this CPU, into a scratch root.

    .venv/bin/python benchmarks/results/horizon/device_check/rerun_on_cpu.py a0.1/fedgalore_minus_lr3e-3-s2 ...

Each argument names a committed cell (``<alpha dir>/<label>-s<seed>``); its CPU twin is written to
``/tmp/devcheck/results/cells/`` (runs under ``/tmp/devcheck/runs``) and copied here by hand as
``<alpha dir>-<label>-s<seed>-cpu.json``. Two single-threaded workers, as the study's.
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
import horizon as h  # noqa: E402

b = dataclasses.replace(h.FULL, runs=Path("/tmp/devcheck/runs"), results=Path("/tmp/devcheck/results"))
cells = []
for key in sys.argv[1:]:
    adir, rest = key.split("/")
    label, seed = rest.rsplit("-s", 1)
    row, tag = label.rsplit("_lr", 1)
    alpha = {"a0.1": h.ALPHA_01, "a0.3": "dirichlet:0.3"}[adir]
    cells.append(h.CellSpec(alpha, row, float(tag), int(seed)))
print(h.run_cells(b, cells, 2))
