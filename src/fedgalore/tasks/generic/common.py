"""What the three generic tasks share: the options every one has (:class:`FileTaskOptions`) and
the rows behind their examples (:class:`FileTask`: splits, ``partition_values``, the validation
split, the data's part of ``describe``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedgalore.tasks.base import TaskError, TaskOptions, task_option
from fedgalore.tasks.generic.adapter import AdapterSource, StartAdapter, is_adapter_folder, read_adapter, load_adapter
from fedgalore.tasks.generic.csvfiles import CsvOptions
from fedgalore.tasks.generic.data import (SITE_COLUMN, Rows, check_filled, concat_rows, data_fingerprint, drop_empty_rows,
                                          limit_rows, load_sources, site_sources, split_rows)

__all__ = ["FileTaskOptions", "FileTask"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileTaskOptions(TaskOptions):
    """Options every generic task has (each task adds its own; docs/data.md lists them all)."""

    model: str | None = task_option(None, "local model folder or hub id (null: the task's offline model); or a PEFT "
                                          "LoRA adapter folder (adapter_config.json): its base is loaded and the adapter applied")
    data: dict[str, str] | str | None = task_option(
        None, "a file (.csv .tsv .json .jsonl .parquet), a `datasets` save_to_disk folder, an image folder or a hub id; "
              "or {train: FILE, test: FILE, validation: FILE}")
    data_config: str | None = task_option(None, "configuration (subset) of a hub data set")
    test_fraction: float = task_option(0.2, "share of the rows held out as the test set when data has no test split")
    seed: int = task_option(0, "seed of the train/test split, of the limit subsets and of a new head's weights")
    limit: int | None = task_option(None, "at most this many rows of each split (a seeded subset; null: all)")
    target_modules: tuple[str, ...] | None = task_option(
        None, "linear layers every method adapts (names or regexes); null: chosen per architecture")
    csv: CsvOptions | None = task_option(
        None, "how .csv/.tsv files are written: {delimiter, encoding, quotechar}; a field left out is sniffed from the file")
    drop_empty: bool = task_option(
        False, "drop rows whose used columns (text, label, prompt, ...) are empty or NaN, counted once; false: such a row is an error")
    base_model: str | None = task_option(None, "the base model of a PEFT adapter given as model (a local folder or hub id); "
                                               "null: the adapter's base_model_name_or_path")

    def __post_init__(self) -> None:
        if not 0 < self.test_fraction < 1:
            raise TaskError(f"task.options.test_fraction={self.test_fraction} must be in (0, 1)")
        if self.limit is not None and self.limit < 1:
            raise TaskError(f"task.options.limit={self.limit} must be >= 1 (or null for all rows)")
        if self.target_modules is not None and not self.target_modules:
            raise TaskError("task.options.target_modules must name at least one layer (or be null)")


class FileTask:
    """Mixin of the generic tasks: the rows behind each split's examples (``_rows``, in example
    order) and what depends on them only."""

    name: str
    _rows: dict[str, Rows]
    #: the site names of per-site data (``task.options.data: {sites: ...}``) in the order given, else None
    sites: list[str] | None = None
    #: True when the task reads no training rows (``data`` null or only a test file: a Flower server
    #: whose nodes hold the data, ``federation.partition.kind: nodes``)
    no_train: bool = False

    @staticmethod
    def default_model() -> Path:
        """The task's offline model folder, read when ``task.options.model`` is null."""
        raise NotImplementedError

    @classmethod
    def input_paths(cls, options: FileTaskOptions | None) -> dict[str, Path]:
        """The default model folder (:meth:`default_model`) when ``task.options.model`` is null, and
        the local base folder of a PEFT adapter given as ``model``; the model and data paths the
        options name are fingerprinted from the options themselves (:mod:`fedgalore.records.identity`)."""
        model = getattr(options, "model", None)
        if not model:
            return {"model": cls.default_model()}
        if is_adapter_folder(model):
            try:
                base = read_adapter(model, getattr(options, "base_model", None)).base
            except TaskError:
                return {}  # building the task says why
            return {"base_model": Path(base)} if Path(base).is_dir() else {}
        return {}

    # ------------------------------------------------------------------ the model (or an adapter of it)
    #: the PEFT adapter given as ``task.options.model`` (None: a model folder or hub id)
    adapter: AdapterSource | None = None
    #: the adapter's LoRA factors, set aside by :meth:`_apply_adapter` (None: no adapter)
    start_adapter: StartAdapter | None = None

    def _model_to_load(self, opts: FileTaskOptions) -> str:
        """The checkpoint the task loads: ``task.options.model``, its base when it is a PEFT adapter
        folder (:mod:`fedgalore.tasks.generic.adapter`; ``self.adapter`` set), else the offline model."""
        if is_adapter_folder(opts.model):
            self.adapter = read_adapter(str(opts.model), opts.base_model)
            return self.adapter.base
        if opts.base_model:
            raise TaskError("task.options.base_model names the base of a PEFT adapter given as task.options.model, and "
                            f"{opts.model or 'the default model'!r} is not an adapter folder (no adapter_config.json); leave base_model out")
        return opts.model or str(self.default_model())

    def _adapter_targets(self, opts: FileTaskOptions) -> tuple[str, ...] | None:
        """``task.options.target_modules``, else the adapter's own target modules (None: the architecture's)."""
        if opts.target_modules or self.adapter is None:
            return opts.target_modules
        return self.adapter.target_modules()

    def _apply_adapter(self, model: Any) -> Any:
        """``model`` (the built base) with the adapter loaded and taken apart (its LoRA factors in
        ``self.start_adapter``; :func:`~fedgalore.tasks.generic.adapter.load_adapter`); as it is
        without an adapter."""
        if self.adapter is None:
            return model
        model, self.start_adapter = load_adapter(model, self.adapter)
        self._say_once("adapter", "%s: starting from the PEFT adapter %s (rank %d, %d layers) on its base %s",
                       self.name, self.adapter.folder, self.start_adapter.rank, len(self.start_adapter.factors),
                       self.adapter.base)
        return model

    def _adapter_has_head(self) -> bool:
        """Whether the starting adapter carries the head (its ``modules_to_save`` hold every head module)."""
        saved = set((self.adapter.config.get("modules_to_save") or []) if self.adapter is not None else [])
        heads = set(getattr(self, "head_modules", ()) or ())
        return bool(heads) and heads <= saved

    def _read_rows(self, opts: FileTaskOptions, required: Sequence[tuple[str, str, str]],
                   present: Sequence[tuple[str, str]] = ()) -> dict[str, Rows]:
        """Every split's rows as read (:func:`~fedgalore.tasks.generic.data.load_sources`), the
        ``required`` columns — ``(column, the option naming it, what it holds)`` — checked present
        and filled in every split, the ``present`` ones — ``(column, the option naming it)``, whose
        values the task checks itself (images: decoding them here would read every file) — checked
        present. Per-site data: each site read and checked on its own, then the sites' splits
        concatenated (:func:`~fedgalore.tasks.generic.data.concat_rows`)."""
        if opts.data is None or (isinstance(opts.data, Mapping) and "sites" not in opts.data and "train" not in opts.data
                                 and set(opts.data) <= {"test", "validation"}):
            return self._read_no_train(opts, required, present)
        self._data_fingerprint = data_fingerprint(opts.data, opts.data_config)
        sites = site_sources(opts.data)
        if sites is None:
            return self._check_required(load_sources(opts.data, opts.data_config, csv_options=opts.csv), required, opts,
                                        present=present)
        per: dict[str, dict[str, Rows]] = {}
        for name, one in sites.items():
            per[name] = self._check_required(load_sources(one, opts.data_config, csv_options=opts.csv), required, opts,
                                             site=name, present=present)
        with_validation = [n for n in per if "validation" in per[n]]
        if with_validation and len(with_validation) < len(per):
            raise TaskError(f"task.options.data.sites: sites {', '.join(with_validation)} have a validation split and the "
                            "others none; give every site one, or none")
        self.sites, self._site_raw = list(per), per
        return {split: concat_rows([(n, per[n][split]) for n in per if split in per[n]], f"{split} rows of {len(per)} sites")
                for split in ("train", "test", "validation") if any(split in per[n] for n in per)}

    def _read_no_train(self, opts: FileTaskOptions, required: Sequence[tuple[str, str, str]],
                       present: Sequence[tuple[str, str]] = ()) -> dict[str, Rows]:
        """No training rows: the server of a Flower deployment whose nodes bring the data
        (``federation.partition.kind: nodes``) reads at most a test (and validation) file of its
        own, ``data: {test: FILE}``, or nothing (``data`` null). The training split is empty, with
        the ``required`` and ``present`` columns (every column the task reads: an image task's
        image column too); the engine refuses to *train* on such a task anywhere else."""
        import datasets

        raw = {} if opts.data is None else load_sources(opts.data, opts.data_config, need_train=False, csv_options=opts.csv)
        raw = self._check_required(raw, required, opts, present=present)
        self._data_fingerprint = "none" if opts.data is None else data_fingerprint(opts.data, opts.data_config)
        columns = sorted({c for c, _, _ in required} | {c for c, _ in present}
                         | set(next(iter(raw.values())).columns if raw else ()))
        raw["train"] = Rows(datasets.Dataset.from_dict({c: [] for c in columns}), "no training rows (data stays on the nodes)")
        self.no_train = True
        return raw

    def _require_labels_without_rows(self, opts: FileTaskOptions) -> None:
        """A task that reads no training rows (:meth:`_read_no_train`) cannot learn its classes from
        them: ``task.options.labels`` must name them. Without ``data`` at all the likelier mistake
        is a forgotten ``data``, so that is what the one line says first."""
        if not self.no_train or getattr(opts, "labels", None):
            return
        if opts.data is None:
            raise TaskError("task.options.data is required: a file, a folder, or {train: FILE, test: FILE}; only the server "
                            "of a Flower deployment with federation.partition.kind=nodes (the nodes hold the data) leaves it "
                            "out, and then task.options.labels lists the classes in id order")
        raise TaskError("task.options.labels is required when the task reads no training rows (the server of a Flower "
                        "deployment whose nodes bring the data): list the classes in id order")

    def _column_hint(self, rows: Rows) -> str:
        """What to say after "has no column X; its columns: ..." (a task that knows data formats
        names the one ``rows`` looks like); '' by default."""
        return ""

    def _check_required(self, raw: dict[str, Rows], required: Sequence[tuple[str, str, str]],
                        opts: FileTaskOptions | None = None, site: str | None = None,
                        present: Sequence[tuple[str, str]] = ()) -> dict[str, Rows]:
        """``raw`` with the ``required`` columns checked present in every split, and filled: an
        empty or NaN value is one line — or, with ``task.options.drop_empty``, its row is dropped
        (counted in one line per source; ``site`` names the source's site in that line); the
        ``present`` columns checked present only."""
        drop = bool(getattr(opts, "drop_empty", False))
        out = {}
        for split, rows in raw.items():
            for column, option in [(c, o) for c, o, _ in required] + list(present):
                rows.require(column, option, self._column_hint(rows))
            if drop and len(rows):
                columns = list(dict.fromkeys(c for c, _, _ in required))
                rows, dropped = drop_empty_rows(rows, columns)
                if dropped:
                    where = f"site {site!r} {rows.name}" if site is not None else rows.name
                    self._say_once(f"dropped:{where}", "%s: dropped %d of %d rows with an empty or NaN value in column(s) %s "
                                   "(task.options.drop_empty)", where, dropped, len(rows) + dropped, ", ".join(columns))
            else:
                for column, option, what in required:
                    check_filled(rows.column(column, option), rows, column, what, droppable=True)
            out[split] = rows
        return out

    def _split_rows(self, opts: FileTaskOptions, raw: dict[str, Rows], strata: str | None) -> dict[str, Rows]:
        """The splits: a test split drawn from the training rows when there is none (seeded,
        stratified by the ``strata`` column), then ``limit`` applied per split. Per-site data: each
        site's splits drawn and limited as if it were the only data, then concatenated."""
        if self.sites is None:
            return self._split_one(opts, raw, strata)
        per = {n: self._split_one(opts, self._site_raw[n], strata) for n in self.sites}
        return {split: concat_rows([(n, per[n][split]) for n in self.sites], f"{split} rows of {len(self.sites)} sites")
                for split in per[self.sites[0]]}

    @staticmethod
    def _split_one(opts: FileTaskOptions, raw: dict[str, Rows], strata: str | None) -> dict[str, Rows]:
        raw = dict(raw)
        if "test" not in raw and len(raw["train"]) == 0:  # no rows at all (a nodes deployment's server)
            raw["test"] = raw["train"].select([], "no test rows")
        if "test" not in raw:
            values = raw["train"].column(strata, "columns") if strata else None
            raw["train"], raw["test"] = split_rows(raw["train"], opts.test_fraction, opts.seed, values)
        return {split: limit_rows(rows, opts.limit, opts.seed + i) for i, (split, rows) in enumerate(sorted(raw.items()))}

    def partition_values(self, column: str | None = None, split: str = "train") -> np.ndarray:
        """The values of the ``split`` rows' ``column`` (a site, a user, a category), in example
        order; ``None``: the task's category (:meth:`partition_labels`, training rows only)."""
        if column is None:
            return np.asarray(self.partition_labels())  # type: ignore[attr-defined]
        rows = self._rows[split]
        if column not in rows.columns:
            raise TaskError(f"task {self.name!r}: {rows.name} has no column {column!r} to partition by; "
                            f"its columns: {', '.join(rows.columns)}")
        values = rows.column(column, "columns")
        check_filled(values, rows, column, "value")
        return np.asarray(values)

    def data_description(self) -> dict[str, Any]:
        """The data's part of ``describe()``: where each split came from, its size and columns."""
        return {
            "data": {split: rows.name for split, rows in sorted(self._rows.items())},
            "data_fingerprint": self._data_fingerprint,
            "columns": self._rows["train"].columns,
            "n_validation": len(self._rows["validation"]) if "validation" in self._rows else 0,
            **({"sites": {n: int(np.sum(np.asarray(self._rows["train"].column(SITE_COLUMN, "columns")) == n))
                          for n in self.sites}} if self.sites is not None else {}),
        }

    def _say_once(self, key: str, message: str, *args: Any) -> None:
        """Log ``message`` once per task object (``build_model`` runs more than once)."""
        said = self.__dict__.setdefault("_said", set())
        if key not in said:
            said.add(key)
            log.warning(message, *args)
