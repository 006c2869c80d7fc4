"""CSV and TSV files as people have them: ``task.options.csv`` and sniffing (docs/data.md, "CSV
files from a spreadsheet").

``task.options.csv: {delimiter, encoding, quotechar}`` says how a ``.csv`` / ``.tsv`` file is
written; a field left out (null) is *sniffed* from the file:

* **encoding** — a byte-order mark decides (``utf-8-sig``, ``utf-16``, ``utf-32``); without one,
  ``utf-8`` when the whole file decodes as UTF-8, else ``cp1252`` (what Excel writes on Windows)
  when it decodes as that, else ``latin-1`` (which decodes any byte);
* **delimiter** — a ``.tsv`` file is tab-separated; for a ``.csv`` file, the one of ``,`` ``;``
  ``\\t`` ``|`` that splits the header line into the most fields (quotes respected; ties in that
  order; ``,`` when none splits it) — Excel in many European locales writes ``;``.

A sniffed choice other than the plain one (``,`` or tab, ``utf-8``) is logged once per file, so a
wrong guess is seen; setting the option skips the guess. :func:`innermost_error` finds the
parser's own message behind a ``datasets`` error (``DatasetGenerationError: An error occurred
while generating the dataset`` wraps pandas' ``ParserError: Error tokenizing data. C error:
Expected 3 fields in line 3, saw 4``).
"""
from __future__ import annotations

import codecs
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgalore.tasks.base import TaskError

__all__ = ["CsvOptions", "CsvChoice", "sniff_encoding", "sniff_delimiter", "csv_reader_options", "innermost_error"]

#: the delimiters a ``.csv`` file's header line is tried with, in order of preference on a tie
DELIMITERS = (",", ";", "\t", "|")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CsvOptions:
    """How ``.csv`` / ``.tsv`` files are read (``task.options.csv``); a field left null is sniffed
    from the file (module doc)."""

    #: the field separator, one character (``","``, ``";"``, ``"\\t"``, ``"|"``); null: sniffed
    delimiter: str | None = None
    #: a Python codec name (``utf-8``, ``utf-8-sig``, ``cp1252``, ``latin-1``, ``utf-16``); null: sniffed
    encoding: str | None = None
    #: the character quoting a field that holds the delimiter or a line break
    quotechar: str = '"'

    def __post_init__(self) -> None:
        if self.delimiter is not None and (not isinstance(self.delimiter, str) or len(self.delimiter) != 1):
            raise TaskError(f"task.options.csv.delimiter={self.delimiter!r} must be one character, e.g. ';' "
                            "(a tab: \"\\t\" in double quotes in YAML)")
        if not isinstance(self.quotechar, str) or len(self.quotechar) != 1:
            raise TaskError(f"task.options.csv.quotechar={self.quotechar!r} must be one character, e.g. '\"'")
        if self.delimiter is not None and self.delimiter == self.quotechar:
            raise TaskError("task.options.csv.delimiter and quotechar must differ")
        if self.encoding is not None:
            try:
                codecs.lookup(self.encoding)
            except LookupError:
                raise TaskError(f"task.options.csv.encoding={self.encoding!r} is not an encoding Python knows; "
                                "e.g. utf-8, utf-8-sig, cp1252, latin-1, utf-16") from None


@dataclass(frozen=True)
class CsvChoice:
    """The delimiter, encoding and quote character a file is read with, and which were sniffed."""

    delimiter: str
    encoding: str
    quotechar: str
    sniffed: tuple[str, ...] = ()

    def describe(self, marked: bool = False) -> str:
        """``delimiter ';', encoding utf-8-sig`` (for messages); ``marked``: each sniffed field
        followed by ``(sniffed)``."""
        mark = {k: " (sniffed)" if marked and k in self.sniffed else "" for k in ("delimiter", "encoding")}
        return f"delimiter {self.delimiter!r}{mark['delimiter']}, encoding {self.encoding}{mark['encoding']}"


def _decodes(path: Path, encoding: str) -> bool:
    """Whether the whole file decodes as ``encoding`` (read in 1 MiB chunks)."""
    dec = codecs.getincrementaldecoder(encoding)()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(_CHUNK), b""):
                dec.decode(chunk)
            dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def sniff_encoding(path: Path) -> str:
    """The encoding of a text file: its byte-order mark's, else ``utf-8`` / ``cp1252`` /
    ``latin-1``, the first that decodes the whole file (module doc)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8-sig"
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    for encoding in ("utf-8", "cp1252"):
        if _decodes(path, encoding):
            return encoding
    return "latin-1"


def sniff_delimiter(path: Path, encoding: str, quotechar: str = '"') -> str:
    """The delimiter of a ``.csv`` file: the candidate (:data:`DELIMITERS`) that splits its header
    line into the most fields, ``,`` when none splits it."""
    with open(path, encoding=encoding, errors="replace", newline="") as fh:
        header = fh.readline(1 << 16).rstrip("\r\n")
    fields = {d: len(next(csv.reader([header], delimiter=d, quotechar=quotechar), [])) for d in DELIMITERS}
    best = max(DELIMITERS, key=lambda d: (fields[d], -DELIMITERS.index(d)))
    return best if fields[best] > 1 else ","


def csv_reader_options(path: Path, options: CsvOptions | None) -> CsvChoice:
    """How ``path`` (a ``.csv`` or ``.tsv`` file) is read: ``options``' fields, the missing ones sniffed."""
    options = options or CsvOptions()
    sniffed = []
    encoding = options.encoding
    if encoding is None:
        encoding = sniff_encoding(path)
        sniffed.append("encoding")
    delimiter = options.delimiter
    if delimiter is None:
        if path.suffix.lower() == ".tsv":
            delimiter = "\t"
        else:
            delimiter = sniff_delimiter(path, encoding, options.quotechar)
            sniffed.append("delimiter")
    return CsvChoice(delimiter, encoding, options.quotechar, tuple(sniffed))


def innermost_error(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s cause chain with a message (the parser's own,
    behind a ``datasets`` ``DatasetGenerationError``); ``exc`` itself when none has one."""
    found, seen = exc, {id(exc)}
    cur: Any = exc
    while True:
        cur = cur.__cause__ or cur.__context__
        if cur is None or id(cur) in seen:
            return found
        seen.add(id(cur))
        if str(cur).strip():
            found = cur
