"""A real federation (issue 32): one ``flower-superlink`` and three ``flower-supernode`` processes
on 127.0.0.1, each node with its own CSV files (or image folders: the image sites' test), started with the commands of
examples/flower/README.md ("A federation of three sites on one machine") — read from the README
itself, with free ports for 8000 and 9094–9096, the test's tiny model and data for
``make_sites.py``'s, and the README's own "without certificates" rules for the insecure variant.

Checked against the sequential simulation of the same per-site files (``partition.kind: files``):
train loss and every site's evaluation, every round, to 1e-5; the ledger against the payload
bytes of every message (what the ServerApp put in, what each node says it received, what came
back: ``flower_messages.jsonl``), byte for byte. Faults: a SuperNode SIGKILLed in the middle of a
round and restarted (the round completes with the others, the node's site moves to its new node
id and trains again), a SuperNode that never answers (SIGSTOP: dropped after ``timeout``), and a
killed ServerApp (``resume=true`` ends with the uninterrupted run's metrics). Every process the
test starts — and every process those start (SuperExec, ServerApp, ClientApp) — is stopped, and
the test asserts that none is left.

Slow by nature: Flower 1.41 starts a fresh ``flwr-clientapp`` process (torch, transformers, the
model) for every message a node receives, so a round costs each node two process start-ups.
"""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
psutil = pytest.importorskip("psutil")
pytest.importorskip("cryptography")

from fedgalore.engine.backends.sequential import SequentialBackend  # noqa: E402
from fedgalore.job.config import FederatedConfig  # noqa: E402
from fedgalore.engine.loop import Federation  # noqa: E402
from fedgalore.engine.runtime import ClientResult  # noqa: E402
from fedgalore.jsonl import read_jsonl  # noqa: E402
from fedgalore_testing.assets import TOPICS, news_rows, write  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "examples" / "flower"
SECTION = "## A federation of three sites on one machine"
SECAGG_SECTION = "## Secure aggregation (SecAgg+)"
SITES = ("site0", "site1", "site2")
BIN = Path(sys.executable).parent
LINK_PORT, NODE_PORTS = "8000", ("9094", "9095", "9096")


# ============================================================================ the README's commands
def readme_commands(section: str = SECTION) -> list[str]:
    """The commands of a README section (default: the three sites'), in order: its ``bash`` blocks,
    one command per line (backslash continuations joined, comments dropped)."""
    text = (APP / "README.md").read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    section = text[start:end if end >= 0 else None]
    out = []
    for body in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()) if not line.startswith("printf ") else line)
    return out


def step(cmd: str) -> str:
    """What a README command is (each must be one of these: a new command needs a rule here)."""
    rules = [("cd", r"^cd examples/flower$"), ("env", r"^export "), ("data", r"^python make_sites\.py data$"),
             ("certs", r"^python -m fedgalore\.flower\.certs "), ("superlink", r"^flower-superlink .*&$"),
             ("config", r"^flwr config ls$|^printf .*config\.toml\"$"), ("register", r"^flwr supernode register "),
             ("supernode", r"^flower-supernode .*&$"), ("run", r"^python -m fedgalore\.flower \. sites "),
             ("stop", r"^kill \$\(jobs -p\)$")]
    for name, pattern in rules:
        if re.search(pattern, cmd):
            return name
    raise AssertionError(f"README command the test does not know how to run: {cmd!r}")


def insecure(cmd: str) -> str:
    """The README's "without certificates" rules: ``--insecure`` in place of the certificate and key
    options, ``insecure = true`` in place of the ``root-certificates`` entry."""
    cmd = re.sub(r" --(ssl-ca-certfile|ssl-certfile|ssl-keyfile|root-certificates|auth-supernode-private-key) \S+", "", cmd)
    cmd = cmd.replace(" --enable-supernode-auth", "")
    if cmd.startswith(("flower-superlink", "flower-supernode")):
        head, rest = cmd.split(" ", 1)
        cmd = f"{head} --insecure {rest}"
    if cmd.startswith("printf "):
        cmd = cmd.replace('root-certificates = \\"%s\\"', "insecure = true").replace('root-certificates = "%s"', "insecure = true")
        cmd = cmd.replace(' "$PWD/certs/ca.crt"', "")
    return cmd


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port *below* the kernel's ephemeral range: the processes start seconds after the port is
    chosen, and a port the kernel hands out for another test's outgoing connection or port-0 listener
    (Ray, gloo stores on the other test worker) is never one of these."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, max(low, 10001))
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # no luck below the range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ============================================================================ data and pipeline
def site_files(root: Path) -> dict[str, dict[str, str]]:
    """Each site's train/test CSV at the README's paths (data/SITE/{train,test}.csv)."""
    df = news_rows(90)
    out = {}
    for i, s in enumerate(SITES):
        d = df[df.site == f"s{i}"].drop(columns=["site"]).rename(columns={"body": "text"}).reset_index(drop=True)
        (root / "data" / s).mkdir(parents=True, exist_ok=True)
        out[s] = {"train": str(write(d.iloc[:-6], root / "data" / s / "train.csv")),
                  "test": str(write(d.iloc[-6:], root / "data" / s / "test.csv"))}
    return out


#: the image sites' classes; each class's images are its colour plus noise (:func:`image_site_folders`)
COLOURS = {"cat": (200, 40, 40), "dog": (40, 180, 40), "owl": (40, 40, 200)}


def image_site_folders(root: Path) -> dict[str, dict[str, str]]:
    """Each site's train/test image folders (one sub-folder per class) where the README has its
    CSV files (data/SITE/{train,test}): 5, 4, 3 training images per class, 2 test images."""
    import numpy as np
    from PIL import Image

    out = {}
    for k, s in enumerate(SITES):
        g = np.random.default_rng(k)
        for split, n in (("train", 5 - k), ("test", 2)):
            for c, colour in COLOURS.items():
                (root / "data" / s / split / c).mkdir(parents=True)
                for i in range(n):
                    pixels = np.clip(np.array(colour)[None, None] + g.normal(0, 70, (12, 12, 3)), 0, 255).astype(np.uint8)
                    Image.fromarray(pixels).save(root / "data" / s / split / c / f"{c}{i}.png")
        out[s] = {split: str(root / "data" / s / split) for split in ("train", "test")}
    return out


def image_pipeline(vit_dir, method: str, kind: str, data=None, rounds: int = 2, **fed) -> dict:
    """:func:`pipeline` on images: the tiny ViT on the sites' image folders (the classes given:
    the server reads no image)."""
    cfg = pipeline(vit_dir, method, kind, data, rounds, **fed)
    cfg["task"] = {"name": "image_classification", "options": {"model": str(vit_dir), "labels": list(COLOURS), "new_head": True,
                                                               **({"data": data} if data is not None else {})}}
    cfg["train"] = {"lr": 1e-2, "batch_size": 4, "local_steps": 4}
    return cfg


def pipeline(bert_dir, method: str, kind: str, data=None, rounds: int = 2, **fed) -> dict:
    """The tiny pipeline: sites.yaml's shape (text/topic columns, labels, kind nodes) on the tiny BERT."""
    opts = {"model": str(bert_dir), "text_column": "text", "label_column": "topic", "max_length": 16, "labels": TOPICS}
    if data is not None:
        opts["data"] = data
    return {
        "name": "sites", "seed": 0,
        "task": {"name": "text_classification", "options": opts},
        "method": {"name": method, "rank": 4},
        "federation": {"clients_per_round": None, "rounds": rounds, "eval_every": 1, "partition": {"kind": kind}, **fed},
        # a budget at which the tiny model learns (accuracy leaves 1/3; losses move by ~1e-2 a round),
        # so 1e-5 agreement says something; it costs little next to Flower's process start-ups
        "train": {"lr": 2e-2, "batch_size": 8, "local_steps": 20},
        "output": {"dir": "runs", "progress": "plain", "checkpoint_every": 1},
    }


def simulate(tmp: Path, bert_dir, method: str, data: dict, missing: set[tuple[int, int]] = frozenset(), make=None, **kw):
    """The same federation in one process (``partition.kind: files``); ``missing``: (round index,
    client) pairs whose client sends nothing, as a SuperNode that died or hung; ``make``: the
    pipeline (default :func:`pipeline`)."""
    cfg = FederatedConfig.from_dict({**(make or pipeline)(bert_dir, method, "files", {"sites": data}, **kw),
                                     "output": {"dir": str(tmp), "progress": "quiet"}})
    return Federation(cfg, backend=MissingClients(set(missing))).run()


class MissingClients(SequentialBackend):
    """The sequential backend whose client ``c`` does not reply in round ``k`` for (k, c) in ``missing``."""

    def __init__(self, missing: set[tuple[int, int]]) -> None:
        super().__init__()
        self.missing = missing

    def run_clients(self, broadcast, jobs, progress=None):
        got = iter(super().run_clients(broadcast, [j for j in jobs if (j.round, j.client) not in self.missing], progress))
        return [ClientResult(j.client, None, "no reply") if (j.round, j.client) in self.missing else next(got) for j in jobs]


# ============================================================================ the deployment
class Deployment:
    """The README's federation, started process by process; every process is tracked to its end."""

    def __init__(self, root: Path, bert_dir: Path, secure: bool, images: bool = False) -> None:
        """``images``: the sites hold image folders (``bert_dir`` is then the tiny ViT)."""
        self.root, self.secure = root, secure
        self.pipeline = image_pipeline if images else pipeline
        self.app = root / "app"  # the README's "this folder": a copy of examples/flower with the test's data and pipeline
        self.app.mkdir(parents=True)
        for f in ("pyproject.toml", "fedgalore_app.py"):
            (self.app / f).write_text((APP / f).read_text())
        self.bert_dir = bert_dir
        self.data = (image_site_folders if images else site_files)(self.app)
        self.logs = root / "logs"
        self.logs.mkdir()
        self.link_port = free_port()
        ports = [free_port() for _ in SITES]
        self.subst = [(f"127.0.0.1:{LINK_PORT}", f"127.0.0.1:{self.link_port}"), (f"--port {LINK_PORT}", f"--port {self.link_port}"),
                      *[(f"--port {a}", f"--port {b}") for a, b in zip(NODE_PORTS, ports)]]
        if images:  # the README's data/SITE/train.csv, test.csv are the image folders data/SITE/train, test
            self.subst += [("/train.csv'", "/train'"), ("/test.csv'", "/test'")]
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "FLWR_HOME": str(root / "flwr-home"),
                    "FEDGALORE_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("FLWR_TELEMETRY_ENABLED", None)
        self.env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)  # the README's export sets them
        self.procs: list[subprocess.Popen] = []  # what the test started (the README's `&` lines, the runs)
        self.seen: dict[int, psutil.Process] = {}  # every process of their trees ever seen
        self.link: subprocess.Popen | None = None
        self.nodes: dict[str, subprocess.Popen] = {}
        self.node_cmd: dict[str, str] = {}
        self.run_cmd = ""
        self.stop_cmd = ""

    # --------------------------------------------------------------- processes
    def _cmd(self, cmd: str) -> str:
        for a, b in self.subst:
            cmd = cmd.replace(a, b)
        return insecure(cmd) if not self.secure else cmd

    def sh(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run(["bash", "-c", cmd], cwd=self.app, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
        return r

    def background(self, cmd: str, log: str) -> subprocess.Popen:
        assert cmd.endswith("&")
        with open(self.logs / log, "ab") as fh:
            p = subprocess.Popen(["bash", "-c", "exec " + cmd[:-1].strip()], cwd=self.app, env=self.env, stdout=fh,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        self.track()
        return p

    def track(self) -> None:
        """Remember every process of the started processes' trees (they may detach: new sessions)."""
        for p in self.procs:
            try:
                top = psutil.Process(p.pid)
                for q in [top, *top.children(recursive=True)]:
                    self.seen.setdefault(q.pid, q)
            except psutil.NoSuchProcess:
                pass
        for q in list(self.seen.values()):  # children of known ones that were reparented meanwhile
            try:
                for c in q.children(recursive=True):
                    self.seen.setdefault(c.pid, c)
            except psutil.NoSuchProcess:
                pass

    def alive(self) -> list[psutil.Process]:
        out = []
        for q in self.seen.values():
            try:
                if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
            except psutil.NoSuchProcess:
                pass
        return out

    def tree(self, p: subprocess.Popen) -> list[psutil.Process]:
        self.track()
        try:
            top = psutil.Process(p.pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, p: subprocess.Popen, sig: int) -> None:
        for q in self.tree(p):
            try:
                q.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def log(self, name: str) -> str:
        f = self.logs / name
        return f.read_text(errors="replace") if f.exists() else ""

    # --------------------------------------------------------------- the README, step by step
    def start(self) -> None:
        """Steps 0-5 of the README section; then wait until the three nodes have joined."""
        seen_steps = []
        for raw in readme_commands():
            kind = step(raw)
            seen_steps.append(kind)
            cmd = self._cmd(raw)
            if kind == "cd":
                continue  # the test runs everything in its copy of examples/flower
            if kind == "env":
                for kv in shlex.split(cmd)[1:]:
                    k, v = kv.split("=", 1)
                    self.env[k] = v
            elif kind == "data":
                continue  # the test's tiny files are already at the README's data/SITE/{train,test}.csv
            elif kind in ("certs", "register"):
                if self.secure:
                    self.sh(cmd)
            elif kind == "config":
                self.sh(cmd)
            elif kind == "superlink":
                self.link = self.background(cmd, "superlink.log")
                self.wait_for(lambda: f"Uvicorn running on https://127.0.0.1:{self.link_port}" in self.log("superlink.log")
                              or f"Uvicorn running on http://127.0.0.1:{self.link_port}" in self.log("superlink.log"),
                              60, "the SuperLink to listen", self.link)
            elif kind == "supernode":
                site = re.search(r"site='(\w+)'", cmd).group(1)
                self.node_cmd[site] = cmd
                self.nodes[site] = self.background(cmd, f"{site}.log")
            elif kind == "run":
                self.run_cmd = cmd
            elif kind == "stop":
                self.stop_cmd = cmd
        assert seen_steps.count("supernode") == 3 and seen_steps[-2:] == ["run", "stop"], seen_steps
        assert self.env.get("FLWR_TELEMETRY_ENABLED") == "0" and self.env.get("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION") == "1"
        for site in SITES:
            self.node_id(site)

    def node_id(self, site: str, after: int = 0, timeout: float = 120) -> int:
        """The node id the site's SuperNode got (the ``after``-th one in its log, for a restart)."""
        found = []

        def joined():
            found[:] = re.findall(r"SuperNode ID: (\d+)", self.log(f"{site}.log"))
            return len(found) > after

        self.wait_for(joined, timeout, f"SuperNode {site} to join", self.nodes[site])
        return int(found[after])

    def wait_for(self, cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.track()
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"waiting for {what}: the process exited ({proc.returncode}):\n{self._tail(proc)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: timed out after {timeout:g}s")
            time.sleep(0.2)

    def _tail(self, proc) -> str:
        name = next((n for n, p in self.nodes.items() if p is proc), None)
        return self.log(f"{name}.log" if name else "superlink.log")[-3000:]

    def run_async(self, method: str, run_dir: Path, *, rounds: int = 2, timeout: float = 600, resume: bool = False,
                  log: str = "run.log", run_cmd: str | None = None, **fed) -> subprocess.Popen:
        """Step 6: the README's run command (or ``run_cmd``, another README run command), on the tiny
        pipeline, with the test's run directory and timeout."""
        (self.app / "sites.yaml").write_text(json.dumps(self.pipeline(self.bert_dir, method, "nodes", rounds=rounds, **fed)))
        extra = f'run-dir="{run_dir}" timeout={timeout:g}' + (" resume=true" if resume else "")
        cmd = f"{self._cmd(run_cmd) if run_cmd else self.run_cmd} --run-config {shlex.quote(extra)} &"
        return self.background(cmd, log)

    def run(self, method: str, run_dir: Path, limit: float = 900, **kw) -> tuple[int, str]:
        log = kw.pop("log", f"run-{run_dir.name}.log")
        p = self.run_async(method, run_dir, log=log, **kw)
        self.wait_for(lambda: p.poll() is not None, limit, f"the run {run_dir.name}")
        return p.returncode, self.log(log)

    def kill_node(self, site: str, sig: int = signal.SIGKILL) -> None:
        self.signal_tree(self.nodes[site], sig)

    def restart_node(self, site: str) -> subprocess.Popen:
        self.nodes[site] = self.background(self.node_cmd[site], f"{site}.log")
        return self.nodes[site]

    def stop(self, timeout: float = 60) -> list[psutil.Process]:
        """Step 7, ``kill $(jobs -p)``: SIGTERM to the SuperLink and the SuperNodes (and any run
        launcher still going); the processes of their trees still alive after ``timeout`` seconds."""
        assert self.stop_cmd == "kill $(jobs -p)"
        self.track()
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            for p in self.procs:  # reap, as the shell does: a SuperExec waits for its parent's pid to disappear
                p.poll()
            time.sleep(0.3)
        return self.alive()

    def close(self) -> list[str]:
        """Stop everything (SIGKILL whatever SIGTERM left), reap; what is still alive (must be nothing)."""
        self.stop(timeout=30)
        for q in self.alive():
            try:
                q.send_signal(signal.SIGCONT)
                q.kill()
            except psutil.NoSuchProcess:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return describe(self.alive())


def describe(procs: list) -> list[str]:
    out = []
    for q in procs:
        try:
            out.append(f"{q.pid} {q.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def deploy(tmp_path, bert_dir, request):
    """A started Deployment (``secure`` from the test's parameter, default insecure); torn down
    — and checked to leave no process behind — whatever the test did."""
    made: list[Deployment] = []

    def make(secure: bool = False, vit_dir: Path | None = None) -> Deployment:
        """``vit_dir``: the sites hold image folders, trained on this tiny ViT."""
        d = Deployment(tmp_path / ("tls" if secure else "insecure"), vit_dir or bert_dir, secure, images=vit_dir is not None)
        made.append(d)
        d.start()
        return d

    yield make
    leftovers = [x for d in made for x in d.close()]
    assert not leftovers, f"processes left behind: {leftovers}"


# ============================================================================ checks
def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def assert_same_metrics(sim: list[dict], dep: list[dict], sites=SITES) -> None:
    """Train loss and every site's evaluation, every round, to 1e-5 (accuracy exactly)."""
    assert len(sim) == len(dep) and dep, (len(sim), len(dep))
    for a, b in zip(sim, dep):
        assert b["clients"] == a["clients"] and b["dropped"] == a["dropped"], (a["round"], b["clients"], b["dropped"])
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5), a["round"]
        per_a, per_b = a["client_eval"]["clients"], b["client_eval"]["clients"]
        assert set(per_b) == set(sites) and set(sites) <= set(per_a), (a["round"], sorted(per_b))
        for s in sites:
            assert per_b[s]["n"] == per_a[s]["n"] == 6
            assert per_b[s]["loss"] == pytest.approx(per_a[s]["loss"], abs=1e-5), (a["round"], s)
            assert per_b[s]["accuracy"] == pytest.approx(per_a[s]["accuracy"], abs=1e-9), (a["round"], s)


def assert_ledger_is_the_wire(run_dir: Path) -> list[dict]:
    """The ledger's bytes are the payload bytes of the messages: each (round, client) download is
    what the ServerApp put into that client's ``train`` message and what its node says it
    received; each upload what came back; ``bytes_eval`` the evaluation messages' model bytes; the
    summary's totals their sums. Returns the message records."""
    run_dir = Path(run_dir)
    wire = read_jsonl(run_dir / "flower_messages.jsonl")
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    train = {(w["round"], w["client"]): w for w in wire if w["type"] == "train"}
    down = {(r["round"], r["client"]): r["bytes"] for r in ledger if r["direction"] == "down"}
    up = {(r["round"], r["client"]): r["bytes"] for r in ledger if r["direction"] == "up"}
    assert train and set(down) == set(train), (sorted(down), sorted(train))
    for key, w in train.items():
        assert down[key] == w["sent"] > 0, (key, down[key], w)
        if w["node_received"] is not None:  # None: the node never replied (killed, hung)
            assert w["node_received"] == w["sent"], (key, w)
        if w["upload"] is None:
            assert key not in up, key
        else:
            assert up[key] == w["upload"] > 0, (key, up.get(key), w)
    assert set(up) <= set(train)
    evals = [w for w in wire if w["type"] == "evaluate"]
    for m in metrics(run_dir):
        mine = [w for w in evals if w["round"] == m["round"]]
        assert m["bytes_eval"] == sum(w["sent"] for w in mine) > 0, m["round"]
        assert all(w["node_received"] in (None, w["sent"]) for w in mine)
        assert m["bytes_down"] == sum(v for (r, _), v in down.items() if r == m["round"])
        assert m["bytes_up"] == sum(v for (r, _), v in up.items() if r == m["round"])
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["bytes_down_total"] == sum(w["sent"] for w in train.values())
    assert s["bytes_up_total"] == sum(w["upload"] or 0 for w in train.values())
    return wire


# ============================================================================ tests
def test_certificates_and_node_keys_are_what_flower_reads(tmp_path, capsys):
    """fedgalore.flower.certs: a CA-signed SuperLink certificate valid for the given name and for
    127.0.0.1/localhost (its SuperExec's address), node keys flower-supernode and `flwr supernode
    register` accept, private files readable by the owner only, nothing overwritten (one line)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    from fedgalore.flower.certs import main

    assert main([str(tmp_path), "--host", "superlink.example.org", "--node", "clinic-a"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for f in ("ca.key", "server.key", "clinic-a.key"):
        assert (tmp_path / f).stat().st_mode & 0o077 == 0, f
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    key = load_ssh_private_key((tmp_path / "clinic-a.key").read_bytes(), None)  # as flower-supernode loads it
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert try_load_public_key(tmp_path / "clinic-a.pub") == public_key_to_bytes(key.public_key())  # as `flwr supernode register`
    capsys.readouterr()
    assert main([str(tmp_path), "--node", "clinic-a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedgalore: error: ") and "clinic-a.key" in err[0] and "already exist" in err[0]


def test_run_config_resume_flag():
    from fedgalore.job.config import ConfigError
    from fedgalore.flower.server_app import run_config_flag

    assert run_config_flag({"resume": True}, "resume") and not run_config_flag({}, "resume")
    assert run_config_flag({"resume": "true"}, "resume") and not run_config_flag({"resume": "false"}, "resume")
    with pytest.raises(ConfigError, match="run config resume='maybe': expected true or false"):
        run_config_flag({"resume": "maybe"}, "resume")


@pytest.mark.timeout(900)
def test_three_sites_deployment_equals_simulation(deploy, tmp_path, bert_dir):
    """The README's commands as written: SuperLink, three SuperNodes with their own files, TLS and
    SuperNode authentication, FedIT, two rounds; a node with another CA and a node whose key is not
    registered cannot join (one line each); the metrics are the files simulation's, the ledger is
    the wire, `kill $(jobs -p)` leaves no process. (The README's "without certificates" variant,
    FedGaLore, and a node without data: test_killed_server_app_resumes_with_the_same_metrics.)"""
    method = "fedit"
    d = deploy(True)
    bad = tmp_path / "other-ca"
    subprocess.run([sys.executable, "-m", "fedgalore.flower.certs", str(bad), "--local", "--node", "x"], check=True,
                   capture_output=True)
    for name, cmd, line in (
        ("wrong-ca", d.node_cmd["site0"].replace("certs/ca.crt", f"{bad}/ca.crt"), "CERTIFICATE_VERIFY_FAILED"),
        ("unregistered", d.node_cmd["site0"].replace("certs/site0.key", f"{bad}/x.key"), "Failed to activate SuperNode"),
    ):
        cmd = cmd.replace(" &", " --max-retries 0 &").replace(f"--port {d.node_cmd['site0'].split('--port ')[1].split()[0]}",
                                                               f"--port {free_port()}")
        p = d.background(cmd, f"{name}.log")
        d.wait_for(lambda: p.poll() is not None, 120, f"the {name} SuperNode to give up")
        assert p.returncode != 0 and line in d.log(f"{name}.log"), d.log(f"{name}.log")[-2000:]

    run_dir = tmp_path / "run"
    rc, out = d.run(method, run_dir, timeout=600)
    assert rc == 0, out[-4000:]
    assert "finished:completed" in out and f"round 2/2 | sites {', '.join(SITES)} |" in out  # the sites by name
    sim = simulate(tmp_path / "sim", bert_dir, method, d.data)
    dep = metrics(run_dir)
    assert_same_metrics(sim.history, dep)
    for a, b in zip(sim.history, dep):  # the nodes kept their model: the factored downlink's bytes, not dense
        assert b["bytes_up"] == a["bytes_up"] and b["bytes_down"] == a["bytes_down"], (b["round"], a["bytes_down"], b["bytes_down"])
    wire = assert_ledger_is_the_wire(run_dir)
    nodes = {w["client"]: w["node"] for w in wire}
    assert sorted(nodes) == [0, 1, 2] and len(set(nodes.values())) == 3
    assert {nodes[i]: s for i, s in enumerate(SITES)} == {d.node_id(s): s for s in SITES}  # client j = j-th site, on its node
    assert json.loads((run_dir / "partition.json").read_text())["client_names"] == list(SITES)
    assert describe(d.stop()) == [], "kill $(jobs -p) left processes"


@pytest.mark.timeout(900)
def test_image_sites_deployment_equals_simulation(deploy, tmp_path, vit_dir):
    """The README's commands without certificates, each SuperNode holding image folders (train/ and
    test/, a sub-folder per class) where the README has CSV files; the server holds no image (the
    classes given): FedIT, two rounds, the metrics those of the files simulation, the ledger the wire."""
    d = deploy(False, vit_dir=vit_dir)
    assert all("data/site" in c and ".csv" not in c for c in d.node_cmd.values()), d.node_cmd
    run_dir = tmp_path / "run"
    rc, out = d.run("fedit", run_dir, timeout=600)
    assert rc == 0, out[-4000:]
    assert "finished:completed" in out and f"round 2/2 | sites {', '.join(SITES)} |" in out
    sim = simulate(tmp_path / "sim", vit_dir, "fedit", d.data, make=image_pipeline)
    assert_same_metrics(sim.history, metrics(run_dir))
    assert_ledger_is_the_wire(run_dir)
    assert describe(d.stop()) == [], "kill $(jobs -p) left processes"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killed_node_rejoins_and_a_node_that_never_answers_is_dropped(deploy, tmp_path, bert_dir):
    """One 3-round FedGaLore deployment (federation.min_clients=2), two faults:

    * SIGKILL site1's SuperNode (and its SuperExec and ClientApp) after it received round 2's job:
      round 2 completes with the two others; the node restarted with the same files gets a new node
      id, the server moves site1 to it and sends it the model from W_0 (all a new node holds), and
      it trains in round 3.
    * SIGSTOP site2's SuperNode after round 2: round 3 waits ``timeout`` seconds for it (or until
      the SuperLink reports the node gone, whichever comes first), then goes on with the two
      others; its evaluation is missing.

    The metrics are exactly those of a simulation in which site1 missed round 2 and site2 round 3.
    (One deployment for what were two tests: CI time, issue 43.)"""
    d = deploy(False)
    killed, stopped = ("site1", 1), ("site2", 2)
    first = d.node_id(killed[0])
    run_dir = tmp_path / "run"
    # timeout 90 s: a round of the healthy nodes took over 45 s beside another deployment test on a 2-core CI
    # machine (every attempt of the next round then missed it); the SuperLink's heartbeat check may drop a killed
    # or stopped node first (seen 42-61 s after the signal): either drop is accepted below. Round 1 (every node's
    # cold start of training) waits join-timeout (300 s), not this
    timeout = 90
    p = d.run_async("fedgalore", run_dir, rounds=3, timeout=timeout, min_clients=2, log="run.log")
    d.wait_for(lambda: re.search(r"ROUND 2\]\s*\n.*Receiving: train message", d.log(f"{killed[0]}.log")) is not None, 600,
               "site1 to receive round 2's job", p)
    d.kill_node(killed[0])
    d.restart_node(killed[0])
    second = d.node_id(killed[0], after=1)
    assert second != first  # without SuperNode authentication a restarted node has a new id
    d.wait_for(lambda: len(metrics(run_dir)) >= 2, 600, "round 2", p)
    d.kill_node(stopped[0], signal.SIGSTOP)
    d.wait_for(lambda: p.poll() is not None, 600, "the run")
    out = d.log("run.log")
    assert p.returncode == 0, out[-4000:]
    assert f"client {killed[1]} (site {killed[0]}) is now on node {second} (was {first})" in out
    dep = metrics(run_dir)
    assert [m["dropped"] for m in dep] == [[], [killed[1]], [stopped[1]]]
    assert stopped[0] not in dep[2]["client_eval"]["clients"]
    errors = [r for r in read_jsonl(run_dir / "clients.jsonl") if r.get("error")]
    assert [(r["round"], r["client"]) for r in errors] == [(2, killed[1]), (3, stopped[1])]
    assert "no reply from the SuperNode" in errors[0]["error"] or "Node Unavailable" in errors[0]["error"], errors
    waited = dep[2]["time_clients"]
    if "Node Unavailable" in errors[1]["error"]:
        # the SuperLink noticed the stopped node first: its heartbeat is missed for 2 × its interval (seen
        # 42–61 s after SIGSTOP on a loaded 2-core machine); the round still did not wait past the timeout
        assert "heartbeat" in errors[1]["error"] and 20 <= waited < timeout + 30, (waited, errors[1])
    else:
        assert "no reply from the SuperNode" in errors[1]["error"], errors[1]
        assert timeout <= waited < timeout + 30, waited  # dropped after the timeout, not before
    wire = assert_ledger_is_the_wire(run_dir)
    r3 = {w["client"]: w for w in wire if w["type"] == "train" and w["round"] == 3}
    assert r3[killed[1]]["node"] == second and r3[killed[1]]["upload"] > 0
    assert r3[killed[1]]["node_received"] == r3[killed[1]]["sent"]
    # the messages were built for what each node holds: the rejoined node W_0 (it is new to the run), the others W_1
    assert [r3[c]["held"] for c in range(3)] == [1, 0, 1]
    assert [w["held"] for w in wire if w["type"] == "train" and w["round"] == 2] == [0, 0, 0]
    sim = simulate(tmp_path / "sim", bert_dir, "fedgalore", d.data, missing={(1, killed[1]), (2, stopped[1])}, rounds=3,
                   min_clients=2)
    assert_same_metrics(sim.history[:2], dep[:2])
    assert_same_metrics(sim.history[2:], dep[2:], sites=("site0", "site1"))
    d.kill_node(stopped[0], signal.SIGCONT)
    assert describe(d.stop()) == []


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killed_server_app_resumes_with_the_same_metrics(deploy, tmp_path, bert_dir):
    """The README's commands by its "without certificates" rules (--insecure), FedGaLore, and a
    fourth SuperNode without data (left out with one line; the others go on). Kill the
    flwr-serverapp process after round 1's checkpoint of a 2-round run; the same command with
    resume=true continues from the checkpoint and ends with the metrics of an uninterrupted
    simulation, with its bytes (the nodes kept their model: the factored downlink, not dense), each
    site on its own node. (One deployment for what were two tests: CI time, issue 43.)"""
    d = deploy(False)
    nodata = d.background(re.sub(r' --node-config ".*"', "", d.node_cmd["site0"]).replace(
        f"--port {d.node_cmd['site0'].split('--port ')[1].split()[0]}", f"--port {free_port()}"), "nodata.log")
    d.wait_for(lambda: "SuperNode ID:" in d.log("nodata.log"), 120, "the node without data to join", nodata)
    run_dir = tmp_path / "run"
    p = d.run_async("fedgalore", run_dir, rounds=2, timeout=300, log="run.log")
    latest = run_dir / "checkpoints" / "LATEST"
    d.wait_for(lambda: latest.exists() and "round_0001" in latest.read_text(), 600, "round 1's checkpoint", p)
    server = [q for q in d.tree(d.link) if q.name() == "flwr-serverapp"]
    assert len(server) == 1
    server[0].kill()
    d.wait_for(lambda: p.poll() is not None, 300, "the launcher to report the failed run")
    assert p.returncode != 0
    out = d.log("run.log")
    assert re.search(r"fedgalore: node \d+ left out: this SuperNode has no data: start it with "
                     r"--node-config \"data='FILE' site='NAME'\"", out), out[-3000:]
    assert "this SuperNode has no data" in d.log("nodata.log")
    assert len(metrics(run_dir)) < 2 and json.loads((run_dir / "summary.json").read_text())["status"] == "running"
    p2 = d.run_async("fedgalore", run_dir, rounds=2, timeout=300, resume=True, log="resume.log")
    d.wait_for(lambda: p2.poll() is not None, 900, "the resumed run")
    out = d.log("resume.log")
    assert p2.returncode == 0, out[-4000:]
    assert f"resuming {run_dir} after round 1" in out and f"round 2/2 | sites {', '.join(SITES)} |" in out
    sim = simulate(tmp_path / "sim", bert_dir, "fedgalore", d.data, rounds=2)
    dep = metrics(run_dir)
    assert_same_metrics(sim.history, dep)
    for a, b in zip(sim.history, dep):
        assert b["bytes_up"] == a["bytes_up"] and b["bytes_down"] == a["bytes_down"], (b["round"], a["bytes_down"], b["bytes_down"])
    wire = read_jsonl(run_dir / "flower_messages.jsonl")
    nodes = {w["client"]: w["node"] for w in wire}
    assert {nodes[i]: s for i, s in enumerate(SITES)} == {d.node_id(s): s for s in SITES}  # client j = j-th site, on its node
    assert json.loads((run_dir / "partition.json").read_text())["client_names"] == list(SITES)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    # resume=true on a run that never started is one line
    rc, out = d.run("fedgalore", tmp_path / "never", rounds=2, timeout=300, resume=True)
    assert rc != 0 and f"fedgalore: error: resume=true: {tmp_path / 'never'} holds no run (no config.yaml)" in out
    # Flower 1.41: a SuperNode that picks up a message of the killed run while the SuperLink ends
    # that run logs "Ignoring message", but the flwr-clientapp it started for it waits for its input
    # forever (and outlives the SuperNode, retrying its runtime API without limit). Only such
    # processes may survive SIGTERM; the fixture SIGKILLs them and checks that nothing is left.
    left = d.stop()
    ignored = sum(d.log(f"{s}.log").count("is not in `RUNNING` status. Ignoring message") for s in SITES)
    assert all(q.name() == "flwr-clientapp" for q in left) and len(left) <= ignored, (describe(left), ignored)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_secagg_deployment_masks_the_uploads_and_survives_a_lost_node(deploy, tmp_path, bert_dir):
    """examples/flower/README.md "Secure aggregation (SecAgg+)": the README's command on the three
    SuperNodes, FedGaLore on seeded bases with the sync from the aggregate, 2 rounds. site1's
    SuperNode is SIGKILLed once it has received round 2's training stage (after sharing its keys):
    Flower's unmask stage removes its masks and round 2 sums the two others. Round 1's model is the
    simulation's (no SecAgg+) within the quantisation error (3.8e-6 per value: the sites' losses on
    it agree to 1e-4); what the server received from each node is masked (values beyond the 2^22
    quantisation range). (A restarted node rejoining is test_node_killed_mid_round_rejoins_and_trains';
    two rounds keep this test's Flower process start-ups — four per node per round — within CI's time.)"""
    (cmd,) = readme_commands(SECAGG_SECTION)
    assert step(cmd) == "run" and "federation.secure_aggregation.num_shares=3" in cmd
    d = deploy(False)
    victim, client = "site1", 1
    run_dir = tmp_path / "run"
    p = d.run_async("fedgalore", run_dir, rounds=2, timeout=90, min_clients=2, log="run.log", run_cmd=cmd)
    # round 2's third train message is the SecAgg+ collect stage (setup, share keys, collect, unmask)
    d.wait_for(lambda: len(re.findall(r"ROUND 2\]\s*\n.*Receiving: train message", d.log(f"{victim}.log"))) >= 3, 900,
               "site1 to receive round 2's training stage", p)
    d.kill_node(victim)
    d.wait_for(lambda: p.poll() is not None, 900, "the run")
    out = d.log("run.log")
    assert p.returncode == 0, out[-4000:]
    dep = metrics(run_dir)
    assert [m["dropped"] for m in dep] == [[], [client]]
    errors = [r for r in read_jsonl(run_dir / "clients.jsonl") if r.get("error")]
    assert [(r["round"], r["client"]) for r in errors] == [(2, client)] and "secure aggregation" in errors[0]["error"]
    wire = [w for w in read_jsonl(run_dir / "flower_messages.jsonl") if w["type"] == "train_secagg"]
    assert [(w["round"], w["client"]) for w in wire if not w["summed"]] == [(2, client)]
    assert all(max(w["masked_head"]) >= 2**22 for w in wire if w["summed"])  # masked: no quantised value reaches 2^22
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert all(r["bytes"] > 0 for r in ledger) and {(r["round"], r["client"]) for r in ledger if r["direction"] == "up"} == {
        (w["round"], w["client"]) for w in wire if w["server_received"]}
    # the same federation without SecAgg+, in one process: round 1's model agrees to the quantisation error
    # (2 rounds, site1 missing round 2, as deployed: the learning-rate schedule spans the run's rounds)
    sim_cfg = pipeline(bert_dir, "fedgalore", "files", {"sites": d.data}, rounds=2, min_clients=2)
    sim_cfg["method"]["options"] = {"projector": "random", "sync": "aggregate"}
    sim = Federation(FederatedConfig.from_dict({**sim_cfg, "output": {"dir": str(tmp_path / "sim"), "progress": "quiet"}}),
                     backend=MissingClients({(1, client)})).run()
    assert [m["dropped"] for m in sim.history] == [m["dropped"] for m in dep]
    a, b = sim.history[0], dep[0]
    assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6)  # computed before any aggregation
    for s in SITES:
        assert b["client_eval"]["clients"][s]["loss"] == pytest.approx(a["client_eval"]["clients"][s]["loss"], abs=1e-4), s
    assert describe(d.stop()) == []
