"""Reading local data files record by record, each record judged good or bad, for ``records.py``.

One reader per format, each yielding ``Record``s in file order: JSON lines, JSON arrays and text lines (optionally
compressed: .gz, .bz2, .xz from the standard library; .zst and .lz4 when ``zstandard`` / ``lz4`` are
installed, as ``datasets`` itself needs), CSV rows, and Parquet rows. The same reader serves the scan
(which stops at the first bad record or counts them) and the dataset built from the good records, so
the two cannot disagree about which records are good.

What is bad, per format:

- every line-based format: bytes that are not UTF-8;
- JSON lines: invalid JSON, not an object, no text field, a text value that is not a string (null
  included). Blank lines are no records;
- CSV: a header without the text column (every row of the file), a row with more fields than the header
  (``datasets``' CSV reader refuses the whole file for it), an empty text cell (CSV has no other way to
  write a null; ``datasets`` reads it as one). Every CSV cell is text: a number in the text column is
  the document "5", not a bad record. Blank lines are no records;
- Parquet: a file without the text column, or whose text column is not a string type (every row of
  the file), and null values. The scan reads only the footer (schema, and the null counts of each row
  group) and the row groups that hold nulls.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

Problem = tuple[str, str]
"""(reason, detail): the reason counts records under skip, the detail describes one."""


@dataclass(frozen=True)
class Record:
    location: str
    """'file:line' (line-based formats and CSV), 'file row N' (Parquet, 0-based as pyarrow counts)."""
    key: int
    """Line number (1-based), CSV data row (1-based) or Parquet row index (0-based)."""
    text: str | None
    problem: Problem | None
    count: int = 1
    """More than 1: the whole file is bad for one reason (``key`` is its first record)."""


class MissingCodec(ValueError):
    """A compressed file whose codec package is not installed."""


def open_binary(path: str) -> BinaryIO:
    """``path`` opened for reading bytes, decompressed by its extension."""
    lower = path.lower()
    for extension, opener in _CODECS.items():
        if lower.endswith(extension):
            return opener(path)
    return open(path, "rb")


def _zstd(path: str) -> BinaryIO:
    try:
        import zstandard
    except ImportError:
        raise MissingCodec(f"{path}: reading .zst files needs the zstandard package (datasets needs it too): "
                           f"pip install zstandard, or decompress the files") from None
    return cast(BinaryIO, zstandard.open(path, "rb"))


def _lz4(path: str) -> BinaryIO:
    try:
        import lz4.frame
    except ImportError:
        raise MissingCodec(f"{path}: reading .lz4 files needs the lz4 package (datasets needs it too): "
                           f"pip install lz4, or decompress the files") from None
    return cast(BinaryIO, lz4.frame.open(path, "rb"))


_CODECS: dict[str, Callable[[str], BinaryIO]] = {
    ".gz": lambda p: cast(BinaryIO, gzip.open(p, "rb")),
    ".bz2": lambda p: cast(BinaryIO, bz2.open(p, "rb")),
    ".xz": lambda p: cast(BinaryIO, lzma.open(p, "rb")),
    ".zst": _zstd,
    ".lz4": _lz4,
}


def check_codec(path: str) -> None:
    """Raise ``MissingCodec`` now for a compressed file that could not be read later."""
    open_binary(path).close()


# --------------------------------------------------------------------------------------------------
# JSON lines and text


def is_json_lines(path: str) -> bool:
    with open_binary(path) as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")  # a JSON array file is one document, not lines


def array_records(path: str, text_field: str) -> Iterator[Record]:
    """The elements of a JSON file holding one array of records (read whole, as ``datasets`` does)."""
    with open_binary(path) as f:
        raw = f.read()
    try:
        elements = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        yield Record(path, 0, None, ("invalid UTF-8", f"invalid UTF-8 at byte {e.start} of the file"))
        return
    except json.JSONDecodeError as e:
        yield Record(f"{path}:{e.lineno}", e.lineno, None, ("invalid JSON", f"invalid JSON ({e.msg}, column {e.colno})"))
        return
    for index, element in enumerate(elements if isinstance(elements, list) else [elements]):
        text, problem = _json_object_text(element, text_field)
        yield Record(f"{path} element {index}", index, text, problem)


def line_records(path: str, builder: str, text_field: str) -> Iterator[Record]:
    """The records of a JSON-lines (``builder='json'``) or text file."""
    with open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(f"{path}:{number}", number, None, ("invalid UTF-8", f"invalid UTF-8 at byte {e.start} "
                                                                                 f"of the line"))
                continue
            if builder == "text":
                yield Record(f"{path}:{number}", number, line, None)
            elif line.strip():
                text, problem = _json_text(line, text_field)
                yield Record(f"{path}:{number}", number, text, problem)


def _json_text(line: str, text_field: str) -> tuple[str | None, Problem | None]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return None, ("invalid JSON", f"invalid JSON ({e.msg}, column {e.colno})")
    return _json_object_text(record, text_field)


def _json_object_text(record: Any, text_field: str) -> tuple[str | None, Problem | None]:
    if not isinstance(record, dict):
        return None, ("not a JSON object", f"a JSON {type(record).__name__}, not an object with a {text_field!r} field")
    if text_field not in record:
        return None, ("missing field", f"no {text_field!r} field (fields: {sorted(record)[:8]})")
    return _string_value(text_field, record[text_field])


def _string_value(text_field: str, value: Any) -> tuple[str | None, Problem | None]:
    if isinstance(value, str):
        return value, None
    return None, ("non-string value", f"{text_field}={value!r} is a {type(value).__name__}, not a string")


# --------------------------------------------------------------------------------------------------
# CSV


def csv_records(path: str, text_field: str) -> Iterator[Record]:
    """The data rows of a CSV file with a header line (the dialect ``datasets`` reads: comma, double quotes)."""
    with io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            return
        column = header.index(text_field) if text_field in header else None
        line, number = rows.line_num, 0
        for row in rows:
            start, line = line + 1, rows.line_num
            if not row:
                continue
            number += 1
            where = f"{path}:{start}"
            if column is None:
                yield _missing_column(path, where, number, header, text_field, rows)
                return
            yield Record(where, number, *_csv_text(row, column, len(header), text_field))


def _csv_text(row: list[str], column: int, width: int, text_field: str) -> tuple[str | None, Problem | None]:
    try:
        "".join(row).encode("utf-8")
    except UnicodeEncodeError:  # an undecodable byte, kept as a surrogate by surrogateescape
        return None, ("invalid UTF-8", "invalid UTF-8 in the row")
    if len(row) > width:
        return None, ("malformed row", f"{len(row)} fields, the header has {width}")
    if column >= len(row) or row[column] == "":
        return None, ("null value", f"the {text_field!r} cell is empty (CSV's null)")
    return row[column], None


def _missing_column(path: str, where: str, number: int, header: list[str], text_field: str,
                    rows: Any) -> Record:
    count = 1 + sum(1 for row in rows if row)
    return Record(where, number, None, ("missing column", f"the header has no {text_field!r} column (columns: "
                                                          f"{header[:8]}); all {count} rows of {path}"), count)


# --------------------------------------------------------------------------------------------------
# Parquet


def parquet_records(path: str, text_field: str, *, only_bad: bool = False) -> Iterator[Record]:
    """The rows of a Parquet file, read one row group at a time; ``only_bad`` yields just the bad ones,
    reading only the footer and the row groups whose statistics do not rule out nulls."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    whole_file = _parquet_column_problem(path, file, text_field)
    if whole_file is not None:
        yield whole_file
        return
    first_row = 0
    for group in range(file.metadata.num_row_groups):
        meta = file.metadata.row_group(group)
        stats = meta.column(_leaf_index(file, text_field)).statistics
        if not only_bad or stats is None or not stats.has_null_count or stats.null_count > 0:
            values = file.read_row_group(group, columns=[text_field]).column(0).to_pylist()
            for row, value in enumerate(values, start=first_row):
                if value is None:
                    yield Record(f"{path} row {row}", row, None, ("null value", f"{text_field} is null"))
                elif not only_bad:
                    yield Record(f"{path} row {row}", row, value, None)
        first_row += meta.num_rows


def _parquet_column_problem(path: str, file: Any, text_field: str) -> Record | None:
    import pyarrow as pa

    schema, rows = file.schema_arrow, file.metadata.num_rows
    if rows == 0:
        return None
    if text_field not in schema.names:
        return Record(f"{path} row 0", 0, None, ("missing column", f"no {text_field!r} column (columns: "
                                                                   f"{schema.names[:8]}); all {rows} rows of {path}"), rows)
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return Record(f"{path} row 0", 0, None, ("non-string value", f"column {text_field!r} holds {kind}, not "
                                                                     f"strings; all {rows} rows of {path}"), rows)
    return None


def _leaf_index(file: Any, text_field: str) -> int:
    return [file.schema.column(i).path for i in range(len(file.schema))].index(text_field)
