"""Device check for issue 33 B: re-run cells that ran on a GPU on this CPU, into a scratch root.

    .venv/bin/python benchmarks/results/horizon/device_check/rerun_on_cpu.py a0.1/fedgalore_minus_lr3e-3-s2 ...

Each argument names a committed cell (``<alpha dir>/<label>-s<seed>``). It runs under
``/tmp/devcheck/runs`` (resumable; its JSON first goes to ``/tmp/devcheck/results/cells/``) and its
CPU twin lands beside this script as ``<alpha dir>-<label>-s<seed>-cpu.json``, where ``compare.py``
reads it. Two single-threaded workers, as the study's.
"""
import dataclasses
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # benchmarks/
import horizon as h  # noqa: E402

b = dataclasses.replace(h.FULL, runs=Path("/tmp/devcheck/runs"), results=Path("/tmp/devcheck/results"))
cells = []
for key in sys.argv[1:]:
    adir, rest = key.split("/")
    label, seed = rest.rsplit("-s", 1)
    row, tag = label.rsplit("_lr", 1)
    cells.append(h.CellSpec(h._alphas(adir.removeprefix("a"))[0], row, float(tag), int(seed)))
failed = h.run_cells(b, cells, 2)
for c in cells:
    if c.key not in failed:
        shutil.copy(h.cell_json(b, c), HERE / f"{c.key.replace('/', '-')}-cpu.json")
print("failed:", failed or "none")
