"""Data from files for the generic tasks, read through the ``datasets`` library (docs/data.md).

``task.options.data`` is one source, or a mapping ``{train: SRC, test: SRC, validation: SRC}``
(``train`` required) naming one source per split. A source is

* a file: ``.csv``, ``.tsv`` (``datasets``' csv reader; only an empty cell is missing — ``NA`` or
  ``None`` stay text; delimiter, encoding and quote character as ``task.options.csv`` says, else
  sniffed: :mod:`~fedgalore.tasks.generic.csvfiles`), ``.json`` (an array of records, or JSON
  lines), ``.jsonl``, ``.parquet``;
* a ``datasets`` ``save_to_disk`` folder: a ``Dataset``, or a ``DatasetDict`` whose ``train``,
  ``test`` and ``validation`` splits are used by name;
* an image folder: one sub-folder of images per class, or ``train/``, ``test/`` (and
  ``validation/``) folders laid out so; read as the columns ``image`` (the file's path) and
  ``label`` (its class folder's name);
* a hub data set id (``org/name``; ``task.options.data_config`` picks its configuration), through
  the same ``datasets.load_dataset`` call — not testable offline.

**Sites.** ``{sites: {NAME: DATA, ...}}`` names one site's data per entry, each ``DATA`` in either
form above (a source, or ``{train, test, validation}``): the data of a federation whose members
each hold their own files (docs/data.md, "Per-site files"). Every site is read, checked, split
(its own test split drawn from its own training rows when it has none) and limited on its own,
exactly as if it were the only data, and the sites' splits are then concatenated in the order
given, with a column ``site`` (:data:`SITE_COLUMN`) holding each row's site. So a site's rows are
the same whether one process reads all sites (``federation.partition.kind: files``) or the site
reads its own (a Flower SuperNode with ``data=...``, examples/flower/README.md).

Relative paths are relative to the working directory. Without a test split, the training rows
are split by :func:`split_rows` (seeded, stratified where the task has a label). Rows keep their
row number in their file, so every message names the file and the row (rows count from 1; a
CSV's header is not a row).
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from fedgalore.tasks.base import TaskError, stratified_split
from fedgalore.tasks.generic.csvfiles import CsvOptions, csv_reader_options, innermost_error

log = logging.getLogger(__name__)
__all__ = ["SPLITS", "SITE_COLUMN", "site_sources", "concat_rows", "FILE_EXTENSIONS", "IMAGE_EXTENSIONS", "Rows", "LabelSet", "load_sources", "data_fingerprint",
           "read_image_folder",
           "split_rows", "limit_rows", "is_missing", "check_filled", "drop_empty_rows", "CsvOptions"]

SPLITS = ("train", "test", "validation")
#: the column per-site data (``{sites: ...}``) adds: each row's site name
SITE_COLUMN = "site"
#: file extension -> (datasets builder, its reader options)
_READERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".csv": ("csv", {"keep_default_na": False, "na_values": [""]}),
    ".tsv": ("csv", {"sep": "\t", "keep_default_na": False, "na_values": [""]}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
}
FILE_EXTENSIONS = tuple(_READERS)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_FIX_EXT = f"use one of {', '.join(FILE_EXTENSIONS)}, a `datasets` save_to_disk folder or an image folder"


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or info lines from ``datasets`` while reading."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    # CRITICAL: a file it cannot parse is our one error line, not its logged traceback line first
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


@dataclass
class Rows:
    """One split's rows (a ``datasets.Dataset``), where they came from and their row numbers there.

    ``name`` is what messages call the source (``train.csv``; ``train.csv (held out)`` for a
    split drawn from it); ``folder`` is where relative paths in the rows point (a data file's
    folder); ``index[i]`` is row ``i``'s 0-based number in its source. Rows concatenated from
    several sources (:func:`concat_rows`, per-site data) have ``origins``: per source, the
    position its rows start at, its name, its rows' numbers there and its folder."""

    data: Any
    name: str
    folder: Path | None = None
    index: np.ndarray | None = None
    origins: tuple[tuple[int, str, np.ndarray, Path | None], ...] | None = None

    def __post_init__(self) -> None:
        if self.index is None:
            self.index = np.arange(len(self.data))

    def _origin(self, i: int) -> tuple[int, tuple[int, str, np.ndarray, Path | None]]:
        pos = int(self.index[i])
        starts = [o[0] for o in self.origins or ()]
        return pos, self.origins[int(np.searchsorted(starts, pos, side="right")) - 1]

    def folder_of(self, i: int) -> Path | None:
        """The folder relative paths in row ``i`` point to (its source's)."""
        return self.folder if self.origins is None else self._origin(i)[1][3]

    def __len__(self) -> int:
        return len(self.data)

    @property
    def columns(self) -> list[str]:
        return list(self.data.column_names)

    def row(self, i: int) -> int | str:
        """The 1-based row number of row ``i`` in its source (for messages); for concatenated rows
        ``"N of SOURCE"``."""
        if self.origins is None:
            return int(self.index[i]) + 1
        pos, (start, name, index, _) = self._origin(i)
        return f"{int(index[pos - start]) + 1} of {name}"

    def require(self, name: str, option: str, hint: str = "") -> None:
        """A missing column ``name`` is one line naming ``task.options.<option>`` and listing the
        columns the source has (then ``hint``, when given: what the columns look like)."""
        if name not in self.data.column_names:
            raise TaskError(f"{self.name} has no column {name!r} (task.options.{option}); "
                            f"its columns: {', '.join(self.data.column_names)}" + (f"; {hint}" if hint else ""))

    def column(self, name: str, option: str) -> list:
        """The values of column ``name`` as a list (:meth:`require` it first)."""
        self.require(name, option)
        return list(self.data[name])

    def select(self, idx: Sequence[int], name: str | None = None) -> "Rows":
        """The rows at ``idx`` (in that order), keeping their source row numbers."""
        idx = np.asarray(idx, dtype=np.int64)
        return Rows(self.data.select(idx.tolist()), name or self.name, self.folder, self.index[idx], self.origins)


def concat_rows(parts: Sequence[tuple[str, Rows]], name: str) -> Rows:
    """The rows of ``parts`` — ``(site, rows)`` pairs — one after the other, with a column
    :data:`SITE_COLUMN` holding each row's site; messages still name each row's own source."""
    data: list = []
    origins: list = []
    with _quiet_datasets():
        joined = _concat(parts, data, origins)
    return Rows(joined, name, None, np.arange(sum(len(r) for _, r in parts)), tuple(origins))


def _concat(parts: Sequence[tuple[str, Rows]], data: list, origins: list) -> Any:
    import datasets

    start = 0
    for site, rows in parts:
        if SITE_COLUMN in rows.columns:
            raise TaskError(f"{rows.name} (site {site!r}) has a column {SITE_COLUMN!r}, which per-site data adds; "
                            "rename or drop that column")
        data.append(rows.data.add_column(SITE_COLUMN, [site] * len(rows)))
        if rows.origins is not None:
            raise TaskError("per-site data cannot nest sites")
        # two sites' files are often both train.csv: messages name the site too ("row 5 of site 'b' train.csv")
        origins.append((start, f"site {site!r} {rows.name}", np.asarray(rows.index), rows.folder))
        start += len(rows)
    return datasets.concatenate_datasets(data) if len(data) > 1 else data[0]


def is_missing(value: Any) -> bool:
    """An empty value: ``None``, a float NaN, a string of only whitespace, or an empty list (a
    chat without turns)."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) == 0
    return isinstance(value, str) and not value.strip()


def check_filled(values: Sequence[Any], rows: Rows, column: str, what: str, droppable: bool = False) -> None:
    """One line naming the file, the column and the first row when any value is empty or NaN
    (``droppable``: the line also names ``task.options.drop_empty``)."""
    bad = [i for i, v in enumerate(values) if is_missing(v)]
    if bad:
        many = f"{len(bad)} rows have" if len(bad) > 1 else "a row has"
        raise TaskError(f"{rows.name}: {many} an empty or NaN {what} in column {column!r} (first: row {rows.row(bad[0])}); "
                        "fill or drop those rows" + (", or set task.options.drop_empty: true" if droppable else ""))


def drop_empty_rows(rows: Rows, columns: Sequence[str]) -> tuple[Rows, int]:
    """``(rows without those whose value in any of ``columns`` is empty or NaN, how many were
    dropped)``; the kept rows keep their row numbers. Dropping every row is one line."""
    values = [list(rows.data[c]) for c in columns]
    keep = [i for i in range(len(rows)) if not any(is_missing(v[i]) for v in values)]
    if not keep:
        raise TaskError(f"{rows.name}: every row has an empty or NaN value in column(s) {', '.join(map(repr, columns))}; "
                        "nothing is left after task.options.drop_empty")
    if len(keep) == len(rows):
        return rows, 0
    return rows.select(keep), len(rows) - len(keep)


# ============================================================================ reading
_SAID: set[tuple[str, str]] = set()


def _say_csv_choice(path: Path, choice: Any) -> None:
    """Log, once per file and choice, a sniffed delimiter or encoding other than the plain one."""
    plain = {"delimiter": "\t" if path.suffix.lower() == ".tsv" else ",", "encoding": "utf-8"}
    unusual = [k for k in choice.sniffed if getattr(choice, k) != plain[k]]
    key = (str(path.resolve()), choice.describe())
    if unusual and key not in _SAID:
        _SAID.add(key)
        log.warning("%s: read with %s (sniffed; task.options.csv: {delimiter, encoding} sets them)", path.name, choice.describe())


def _read_file(path: Path, csv_options: CsvOptions | None = None) -> Any:
    import datasets

    from fedgalore.tasks.assets import cache_dir

    builder, kwargs = _READERS[path.suffix.lower()]
    _check_not_empty(path, csv_options)
    choice = None
    if builder == "csv":
        choice = csv_reader_options(path, csv_options)
        kwargs = {**kwargs, "sep": choice.delimiter, "encoding": choice.encoding, "quotechar": choice.quotechar}
    try:
        with _quiet_datasets():
            rows = datasets.load_dataset(builder, data_files=str(path), split="train",
                                         cache_dir=str(cache_dir() / "datasets"), **kwargs)
    except Exception as exc:  # noqa: BLE001 - pyarrow / pandas parse errors of many types
        bad = _bad_json_line(path) if path.suffix.lower() in (".json", ".jsonl") else None
        if bad is not None:
            raise TaskError(f"could not read {path.name}: line {bad[0]} is not a JSON record ({bad[1]}); fix or drop that "
                            "line (.jsonl: one JSON object per line)") from None
        cause = innermost_error(exc)  # the parser's own line, not datasets' "An error occurred while generating the dataset"
        line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        how = "check the file's format" if choice is None else (
            f"read with {choice.describe(marked=True)}; "
            "set task.options.csv: {delimiter, encoding, quotechar} if that is not how the file is written")
        raise TaskError(f"could not read {path.name} as {path.suffix.lower()} ({type(cause).__name__}: {line}); {how}") from None
    if choice is not None:
        _say_csv_choice(path, choice)
    return rows


#: what a data file of each format holds, for the line that says a file is empty
_FILE_CONTENT = {
    ".csv": "a header line naming the columns, then one comma-separated row per example",
    ".tsv": "a header line naming the columns, then one tab-separated row per example",
    ".json": "an array of records ([{\"column\": value, ...}, ...]) or one JSON record per line",
    ".jsonl": "one JSON record per line ({\"column\": value, ...})",
    ".parquet": "a table with one row per example (e.g. pandas' DataFrame.to_parquet)",
}


def _check_not_empty(path: Path, csv_options: CsvOptions | None = None) -> None:
    """One line when the data file ``path`` is empty (0 bytes, or only whitespace in a text
    format): it names the file and what to put in it, instead of a parser's complaint (for a
    ``.csv`` with ``task.options.csv.delimiter`` set, rows separated by that delimiter)."""
    size = path.stat().st_size
    suffix = path.suffix.lower()
    if size == 0 or (suffix != ".parquet" and size <= 65536 and not path.read_bytes().strip()):
        what = _FILE_CONTENT[suffix]
        sep = getattr(csv_options, "delimiter", None)
        if suffix == ".csv" and sep not in (None, ","):
            what = what.replace("comma-separated", f"{sep!r}-separated")
        raise TaskError(f"{path} is empty; put {what} in it")


def _bad_json_line(path: Path) -> tuple[int, str] | None:
    """The first line of a JSON-lines file that is not a JSON object (1-based, the parser's
    reason), to name it when ``datasets`` could not read the file; None when every line is one
    (or the file is one JSON document, an array of records, whose error is the reader's)."""
    import json

    with open(path, encoding="utf-8", errors="replace") as fh:
        first = fh.read(1)
        while first and first.isspace():
            first = fh.read(1)
        if first == "[":
            return None
        fh.seek(0)
        for k, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                return k, f"{exc.msg} at column {exc.colno}"
            if not isinstance(record, dict):
                return k, f"a {type(record).__name__}, not an object"
    return None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _class_folders(path: Path) -> list[Path]:
    """Sub-folders of ``path`` holding at least one image file (sorted by name)."""
    return [d for d in sorted(path.iterdir()) if d.is_dir() and not d.name.startswith(".")
            and any(f.suffix.lower() in IMAGE_EXTENSIONS for f in d.iterdir() if f.is_file())]


def _read_image_folder(path: Path, name: str) -> Rows:
    import datasets

    classes = _class_folders(path)
    if not classes:
        raise TaskError(f"{name}: no sub-folder with images ({', '.join(IMAGE_EXTENSIONS)}); "
                        "an image folder holds one sub-folder of images per class")
    images, labels = [], []
    for d in classes:
        files = sorted(f for f in d.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        images += [str(f.resolve()) for f in files]
        labels += [d.name] * len(files)
    return Rows(datasets.Dataset.from_dict({"image": images, "label": labels}), name)


def read_image_folder(path: str | Path) -> Rows:
    """The images of a folder as rows to predict or evaluate on: one sub-folder of images per class
    (the columns ``image`` and ``label``, read as training reads an image folder), or the images
    directly in it (``image`` only: rows without labels). A folder of neither is one
    :class:`TaskError` line."""
    import datasets

    path = Path(path)
    if _class_folders(path):
        return _read_image_folder(path, path.name)
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise TaskError(f"{path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in it or in sub-folders of it; give a folder "
                        "of images, one with a sub-folder of images per class, or a file listing them")
    return Rows(datasets.Dataset.from_dict({"image": [str(f.resolve()) for f in files]}), path.name)


def _split_folders(path: Path) -> dict[str, Path]:
    """``train/``, ``test/``, ``validation/`` sub-folders that are image folders themselves."""
    subs = {d.name: d for d in path.iterdir() if d.is_dir()}
    found = {s: subs[s] for s in SPLITS if s in subs and _class_folders(subs[s])}
    return found if "train" in found else {}


def _from_dataset_dict(dd: Any, name: str) -> dict[str, Rows]:
    if "train" not in dd:
        raise TaskError(f"{name} has splits {', '.join(dd)} but no 'train' split; "
                        "name the files per split: task.options.data: {train: FILE, test: FILE}")
    return {s: Rows(dd[s], f"{name}[{s}]") for s in SPLITS if s in dd}


def _read_local(path: Path, given: str, csv_options: CsvOptions | None = None) -> dict[str, Rows]:
    """Every split one local source holds (a file holds one: ``train``)."""
    import datasets

    if path.is_file():
        if path.suffix.lower() not in _READERS:
            raise TaskError(f"task.options.data: {given!r} has an unsupported extension {path.suffix!r}; {_FIX_EXT}")
        rows = _read_file(path, csv_options)
        return {"train": Rows(rows, path.name, path.parent.resolve())}
    if _is_saved_dataset(path):
        with _quiet_datasets():
            loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            return _from_dataset_dict(loaded, path.name)
        return {"train": Rows(loaded, path.name, path.resolve())}
    splits = _split_folders(path)
    if splits:
        return {s: _read_image_folder(p, f"{path.name}/{s}") for s, p in splits.items()}
    if _class_folders(path):
        return {"train": _read_image_folder(path, path.name)}
    raise TaskError(f"task.options.data: folder {given!r} is neither a `datasets` save_to_disk folder nor an image folder "
                    f"(one sub-folder of images per class); for files, {_FIX_EXT}")


def _read_hub(source: str, config: str | None) -> dict[str, Rows]:
    import datasets

    try:
        with _quiet_datasets():
            dd = datasets.load_dataset(source, config) if config else datasets.load_dataset(source)
    except Exception as exc:  # noqa: BLE001 - network / hub errors of many types
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise TaskError(f"task.options.data={source!r} is no local file or folder, and loading it from the Hugging Face hub "
                        f"failed ({type(exc).__name__}: {line}); check the path (relative to the working directory)") from None
    return _from_dataset_dict(dd, f"hub:{source}")


def _read_source(source: str, config: str | None, csv_options: CsvOptions | None = None) -> dict[str, Rows]:
    path = Path(source).expanduser()
    if path.exists():
        return _read_local(path, source, csv_options)
    suffix = path.suffix.lower()
    if path.is_absolute() or source.startswith((".", "~")) or suffix in _READERS or (suffix and "/" not in source) \
            or not _HUB_ID.fullmatch(source):
        raise TaskError(f"task.options.data: no file or folder {source!r} (looked in {path.resolve().parent})")
    return _read_hub(source, config)


def load_sources(data: str | Mapping[str, str], data_config: str | None = None, need_train: bool = True,
                 csv_options: CsvOptions | None = None) -> dict[str, Rows]:
    """The rows of each split that ``data`` names (module doc): always ``train`` (unless
    ``need_train`` is False: a mapping of ``test`` / ``validation`` only); ``test`` and
    ``validation`` when a source has them. Every split has at least one row. ``csv_options``:
    how ``.csv`` / ``.tsv`` files are read (:mod:`~fedgalore.tasks.generic.csvfiles`; null
    fields sniffed)."""
    if data is None or (isinstance(data, str) and not data.strip()):
        raise TaskError("task.options.data is required: a file, a folder, or {train: FILE, test: FILE}")
    if isinstance(data, Mapping) and "sites" in data:
        raise TaskError("task.options.data: {sites: ...} is read site by site (site_sources)")
    if isinstance(data, Mapping):
        unknown = sorted(set(data) - set(SPLITS))
        if unknown or ("train" not in data and need_train):
            raise TaskError(f"task.options.data: a mapping has the keys train (required), test, validation; got {', '.join(map(str, data)) or 'none'}")
        out: dict[str, Rows] = {}
        for split, source in data.items():
            held = _read_source(str(source), data_config, csv_options)
            if len(held) > 1 and split not in held:
                raise TaskError(f"task.options.data.{split}: {source!r} holds the splits {', '.join(held)}, no {split!r}")
            out[split] = held[split] if len(held) > 1 else next(iter(held.values()))
    else:
        out = _read_source(str(data), data_config, csv_options)
    for split, rows in out.items():
        if len(rows) == 0:
            raise TaskError(f"{rows.name} has no rows")
    return out


def site_sources(data: Any) -> dict[str, Any] | None:
    """The sites of per-site data (``{sites: {NAME: DATA}}``, module doc), in the order given, or
    None for data that is not per site. A malformed ``sites`` mapping is one line."""
    if not (isinstance(data, Mapping) and "sites" in data):
        return None
    sites = data["sites"]
    if set(data) != {"sites"}:
        raise TaskError("task.options.data: {sites: {NAME: FILE, ...}} takes no other keys; give each site's test or "
                        "validation file inside its entry, {sites: {NAME: {train: FILE, test: FILE}}}")
    if not isinstance(sites, Mapping) or len(sites) == 0:
        raise TaskError("task.options.data.sites must map site names to their data, e.g. {sites: {site1: a.csv, site2: b.csv}}")
    for name, one in sites.items():
        if not str(name).strip():
            raise TaskError("task.options.data.sites: a site needs a non-empty name")
        if one is None or (isinstance(one, Mapping) and "sites" in one):
            raise TaskError(f"task.options.data.sites.{name}: give the site's data: a file, a folder or {{train: FILE, test: FILE}}")
    return {str(k): v for k, v in sites.items()}


def data_fingerprint(data: str | Mapping[str, str], data_config: str | None = None) -> str:
    """Identity of the data ``data`` names: names, sizes and modification times of every local file
    (folders: all files below), or the hub id and configuration; per site for per-site data."""
    from fedgalore.tasks.paper_text.base import fingerprint_files

    sites = site_sources(data)
    if sites is not None:
        return "|".join(f"{name}={data_fingerprint(one, data_config)}" for name, one in sites.items())
    sources = dict(data) if isinstance(data, Mapping) else {"data": data}
    parts = []
    for split, source in sorted(sources.items()):
        path = Path(str(source)).expanduser()
        if path.is_dir():
            parts.append(f"{split}:{fingerprint_files(sorted(p for p in path.rglob('*') if p.is_file()))}")
        elif path.is_file():
            parts.append(f"{split}:{fingerprint_files([path])}")
        else:
            parts.append(f"{split}:hub:{source}:{data_config}")
    return ";".join(parts)


# ============================================================================ splits
def split_rows(rows: Rows, test_fraction: float, seed: int, strata: Sequence[Any] | None = None) -> tuple[Rows, Rows]:
    """``(train, test)``: ``round(test_fraction · n_c)`` rows of every stratum ``c`` held out, drawn
    by :func:`fedgalore.tasks.base.stratified_split` from ``default_rng(seed)`` (one stratum when
    ``strata`` is None: a seeded random split). Deterministic for a seed."""
    keys = np.zeros(len(rows), dtype=np.int64) if strata is None else np.unique(np.asarray([str(s) for s in strata]), return_inverse=True)[1]
    kept, held = stratified_split(keys, test_fraction, np.random.default_rng(seed))
    if len(held) == 0 or len(kept) == 0:
        raise TaskError(f"task.options.test_fraction={test_fraction} leaves {len(kept)} training and {len(held)} test rows of "
                        f"the {len(rows)} in {rows.name}; give a test file (data: {{train: FILE, test: FILE}}) or change test_fraction")
    return rows.select(kept), rows.select(held, f"{rows.name} (held out)")


def limit_rows(rows: Rows, limit: int | None, seed: int) -> Rows:
    """All rows, or ``limit`` of them drawn by a seeded permutation (kept in file order)."""
    from fedgalore.tasks.paper_text.base import subset_indices

    if limit is None or limit >= len(rows):
        return rows
    return rows.select(subset_indices(len(rows), limit, seed))


# ============================================================================ labels
def _key(value: Any) -> str:
    """A label value as the string it is looked up by (``1``, ``1.0`` and ``"1"`` are one label)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and float(value).is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class LabelSet:
    """The classes of a classifier, fixed by the training rows: ``names`` in id order.

    ``kind`` says how: ``classlabel`` (a ``datasets`` ``ClassLabel`` column: its names in its
    order), ``integer`` (the sorted distinct integers), ``string`` (the sorted distinct strings)
    or ``given`` (``task.options.labels``, in that order: a federation whose server never sees a
    row, or whose sites may each lack some classes)."""

    names: tuple[str, ...]
    kind: str

    @classmethod
    def given(cls, labels: Sequence[Any]) -> "LabelSet":
        """The classes ``labels`` names, in that order (``task.options.labels``)."""
        names = tuple(_key(v) for v in labels)
        if len(set(names)) != len(names) or len(names) < 2:
            raise TaskError(f"task.options.labels={list(labels)!r} must name at least 2 distinct classes")
        return cls(names, "given")

    @classmethod
    def from_rows(cls, rows: Rows, column: str, option: str = "label_column") -> "LabelSet":
        values = rows.column(column, option)
        feature = rows.data.features.get(column)
        if type(feature).__name__ == "ClassLabel":
            return cls(tuple(feature.names), "classlabel")
        if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
            ints = sorted({int(float(v)) for v in values if float(v).is_integer()})
            if len(ints) == len({_key(v) for v in values}):
                return cls(tuple(str(i) for i in ints), "integer")
        return cls(tuple(sorted({str(v) for v in values})), "string")

    def encode(self, rows: Rows, column: str, train_name: str, option: str = "label_column") -> np.ndarray:
        """Class ids of ``rows``' labels; a label the training rows do not have is one line
        naming it, its file and row."""
        values = rows.column(column, option)
        feature = rows.data.features.get(column)
        if type(feature).__name__ == "ClassLabel":
            values = [feature.int2str(int(v)) for v in values]
        lookup = {n: i for i, n in enumerate(self.names)}
        out = np.empty(len(values), dtype=np.int64)
        for i, v in enumerate(values):
            k = _key(v)
            if k not in lookup:
                shown = ", ".join(self.names[:8]) + (", ..." if len(self.names) > 8 else "")
                if self.kind == "given":
                    raise TaskError(f"label {k!r} of {rows.name} (row {rows.row(i)}, column {column!r}) is not one of "
                                    f"task.options.labels ({shown}); fix that row or add the label there")
                raise TaskError(f"label {k!r} of {rows.name} (row {rows.row(i)}, column {column!r}) never occurs in the training data "
                                f"({train_name}: {shown}); fix that row or add training rows with it")
            out[i] = lookup[k]
        return out
