"""The documentation's code blocks, and how each documented command is tested (tests/project/test_docs_examples.py)."""
from __future__ import annotations

import re
from pathlib import Path

from fedgalore_testing import REPO, TINY_PAPER, TINY_TEXT


def blocks(doc: str, lang: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", (REPO / doc).read_text(), re.S) if m.group(1) == lang]


def commands(doc: str) -> list[str]:
    """The shell commands of ``doc``'s bash blocks (continuations joined, comments dropped)."""
    out = []
    for body in blocks(doc, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()))
    return out


def kind(cmd: str) -> str:
    """How a documented command is tested (see the module docstring)."""
    rules = [
        (r"^make demo$", "demo"),  # tests/project/test_demo.py runs the Makefile's demo recipe at a tiny budget
        (r"^make test$", "suite"),  # this test suite
        (r"^source \.venv/bin/activate$", "venv"),
        (r"^pip install 'fedgalore\[(\w+)\]'$", "extra"),
        (r"^export ", "env"),
        (r"^cd examples/flower$", "cd"),
        (r"(^|&& )python -m fedgalore\.flower \. local ", "flower"),
        (r"^pgrep -af flower-superlink$|^kill \$\(pgrep -f ", "flower"),
        (r"^python -m fedgalore\.flower \. myfed$|^flower-super(link|node) ", "deployment"),
        # examples/flower/README.md, the three-site federation: run as written by tests/flower/test_flower_deploy.py
        (r"^python make_sites\.py |^python -m fedgalore\.flower\.certs |^flwr config ls$|^printf .*config\.toml\"$"
         r"|^flwr supernode register |^python -m fedgalore\.flower \. (sites|myfed) --run-config |^kill \$\(jobs -p\)$", "deploy"),
        (r"^torchrun --standalone --nproc-per-node 2 examples/fsdp_galore\.py ", "fsdp"),  # test_fsdp_example_as_written
        (r"^fedgalore (repro|bench) (?!--list)\S+", "long"),
        (r"news\.yaml|runs/news-|exported/news", "own-data"),  # README "Your own data": test_readme_own_data_as_written
        (r"^fedgalore ", "cli"),
    ]
    for pattern, name in rules:
        if re.search(pattern, cmd):
            return name
    return "uncovered"


def _tiny(argv: list[str], tmp: Path) -> list[str]:
    """The command at a tiny budget (see the module docstring)."""
    argv = [str(tmp / "one-run") if a == "/tmp/one-run" else a for a in argv]
    if "--seeds" in argv:
        argv[argv.index("--seeds") + 1] = "0"
    if argv[0] == "run" and "--resume" in argv:  # extending: one round beyond the 3 it ran
        argv = [("federation.rounds=4" if a.startswith("federation.rounds=") else a) for a in argv]
    if argv[0] == "tune":  # two trials a row, one held-out seed, one worker, ranks the tiny model has
        for flag, value in (("--trials", "2"), ("--heldout-seeds", "1"), ("--workers", "1"), ("--confirm-rounds", "1,2")):
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            elif flag == "--heldout-seeds":
                argv += [flag, value]
        argv = [a.replace("method.rank=choice:8,16,32", "method.rank=choice:2,4") for a in argv]
        argv += [*TINY_PAPER, "federation.partition.kind=iid", "federation.partition.by=null"]  # tiny_text has no domains
    if argv[0] in ("run", "compare") and "--resume" not in argv:
        config = argv[argv.index("--config") + 1]
        if config.endswith("offline_text.yaml"):
            given = [int(a.split("=", 1)[1]) for a in argv if a.startswith("federation.rounds=")]
            # runs keep their rounds distinct (two documented runs share a default directory)
            rounds = 2 if argv[0] == "compare" else min(given[-1], 5) if given else 3
            argv += [*TINY_TEXT, f"federation.rounds={rounds}"]
        elif "conf/pipeline/" in config:
            argv += TINY_PAPER
    return argv
