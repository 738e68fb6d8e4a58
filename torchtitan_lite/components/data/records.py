"""Bad records in local data files, found before ``datasets`` reads them.

``datasets`` reports a broken record far from its cause (an int among strings becomes "holds
Json(decode=True), not strings", an invalid JSON line is reported at the wrong row, invalid UTF-8
names no file, a Parquet file whose text column is an int is silently turned into strings, a CSV row
with an extra field fails the whole file). Local JSON-lines, text, CSV and Parquet files (compressed
ones too) are therefore scanned first, record by record (``record_formats.py`` says what is bad in
each). ``data.on_bad_record='error'`` stops at the first bad record with its file and line or row;
``'skip'`` leaves them out, logs how many per reason, and builds the dataset from the good records
only, in file order, so the documents, and hence the loader's resumable positions, are the same on
every run over the same files.

Sources that are not local files (hub datasets, dataset folders, streams) are checked as they are read
(``bad_document`` in the data loader), under the same policy.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.record_formats import (
    Record,
    array_records,
    csv_records,
    is_json_lines,
    line_records,
    parquet_records,
)

logger = logging.getLogger(__name__)

BadRecordPolicy = Literal["error", "skip"]
SCANNED_BUILDERS = ("json", "text", "csv", "parquet")


@dataclass
class BadRecords:
    first: list[str] = field(default_factory=list)
    """'location: problem' of the first few bad records."""
    reasons: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.reasons.values())


def scan(files: list[str], builder: str, text_field: str, policy: BadRecordPolicy, where: str) -> BadRecords:
    """Check every record of ``files``; raises on the first bad one with ``policy='error'``."""
    found = BadRecords()
    for path in files:
        for record in _problems(path, builder, text_field):
            assert record.problem is not None
            reason, detail = record.problem
            if policy == "error":
                raise bad_record_error(f"{record.location}: {detail} ({where})", reason)
            found.reasons[reason] += record.count
            if len(found.first) < 3:
                found.first.append(f"{record.location}: {detail}")
    if found.count:
        log_skipped(found.count, found.reasons, where, found.first)
    return found


def bad_record_error(text: str, reason: str) -> ValueError:
    """The DataSourceError for one bad record under data.on_bad_record=error."""
    field_hint = (", or point data.text_field at the field that holds the text"
                  if reason in ("missing field", "missing column", "non-string value") else "")
    return DataSourceError(f"{text}; fix the record{field_hint}, or set data.on_bad_record=skip to leave bad "
                           f"records out (they are counted)")


def log_skipped(count: int, reasons: Counter, where: str, first: list[str]) -> None:
    per_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items()))
    logger.warning("skipped %d bad record(s) of %s (data.on_bad_record=skip): %s; first: %s",
                   count, where, per_reason, "; ".join(first))


def good_records(files: list[str], builder: str, text_field: str, stamps: list[tuple[int, float]]
                 ) -> Iterator[dict[str, str]]:
    """The good records of ``files`` in file order (``stamps`` = size and mtime per file only makes
    the ``datasets`` cache fingerprint change with the files)."""
    del stamps
    for path in files:
        for record in _records(path, builder, text_field):
            if record.problem is None:
                assert record.text is not None
                yield {text_field: record.text}


def _records(path: str, builder: str, text_field: str) -> Iterator[Record]:
    if builder == "csv":
        return csv_records(path, text_field)
    if builder == "parquet":
        return parquet_records(path, text_field)
    if builder == "json" and not is_json_lines(path):
        return array_records(path, text_field)
    return line_records(path, builder, text_field)


def _problems(path: str, builder: str, text_field: str) -> Iterator[Record]:
    if builder == "parquet":
        return parquet_records(path, text_field, only_bad=True)
    return (r for r in _records(path, builder, text_field) if r.problem is not None)


def file_stamps(files: list[str]) -> list[tuple[int, float]]:
    return [(os.path.getsize(f), os.path.getmtime(f)) for f in files]
