"""Bad records in local JSON-lines and text files, found before ``datasets`` reads them.

``datasets`` reports a broken record far from its cause (an int among strings becomes "holds
Json(decode=True), not strings", an invalid JSON line is reported at the wrong row, invalid UTF-8
names no file). Local ``.jsonl`` / line-delimited ``.json`` and text files are therefore scanned line
by line first. Each bad record is one of: invalid UTF-8, invalid JSON, not a JSON object, missing
field, non-string value. ``data.on_bad_record='error'`` stops at the first with its file and line;
``'skip'`` leaves them out, logs how many per reason, and builds the dataset from the good records
only, in file order, so the documents, and hence the loader's resumable positions, are the same on
every run over the same files.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

BadRecordPolicy = Literal["error", "skip"]


@dataclass
class BadRecords:
    first: list[str] = field(default_factory=list)
    """'file:line: problem' of the first few bad records."""
    reasons: Counter = field(default_factory=Counter)
    lines: dict[str, set[int]] = field(default_factory=dict)
    """file -> 1-based numbers of its bad lines."""

    @property
    def count(self) -> int:
        return sum(self.reasons.values())


def _is_json_lines(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")  # a JSON array file is one document, not lines


def problem_of(raw: bytes, builder: str, text_field: str) -> tuple[str, str] | None:
    """(reason, detail) of one line, None when it is a good record; blank JSON lines are no records."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid UTF-8", f"invalid UTF-8 at byte {e.start} of the line"
    if builder == "text":
        return None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return "invalid JSON", f"invalid JSON ({e.msg}, column {e.colno})"
    if not isinstance(record, dict):
        return "not a JSON object", f"a JSON {type(record).__name__}, not an object with a {text_field!r} field"
    if text_field not in record:
        return "missing field", f"no {text_field!r} field (fields: {sorted(record)[:8]})"
    value = record[text_field]
    if not isinstance(value, str):
        return "non-string value", f"{text_field}={value!r} is a {type(value).__name__}, not a string"
    return None


def scan(files: list[str], builder: str, text_field: str, policy: BadRecordPolicy, where: str) -> BadRecords:
    """Check every line of ``files``; raises on the first bad record with ``policy='error'``."""
    found = BadRecords()
    for path in files:
        if builder == "json" and not _is_json_lines(path):
            continue
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                problem = problem_of(raw.rstrip(b"\r\n"), builder, text_field)
                if problem is None:
                    continue
                reason, detail = problem
                if policy == "error":
                    from torchtitan_lite.components.data.sources import DataSourceError

                    field_hint = (", or point data.text_field at the field that holds the text"
                                  if reason in ("missing field", "non-string value") else "")
                    raise DataSourceError(f"{path}:{number}: {detail} ({where}); fix the record{field_hint}, or set "
                                          f"data.on_bad_record=skip to leave bad records out (they are counted)")
                found.reasons[reason] += 1
                found.lines.setdefault(path, set()).add(number)
                if len(found.first) < 3:
                    found.first.append(f"{path}:{number}: {detail}")
    if found.count:
        per_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(found.reasons.items()))
        logger.warning("skipped %d bad record(s) of %s (data.on_bad_record=skip): %s; first: %s",
                       found.count, where, per_reason, "; ".join(found.first))
    return found


def good_records(files: list[str], builder: str, text_field: str, bad_lines: dict[str, list[int]],
                 stamps: list[tuple[int, float]]) -> Iterator[dict[str, str]]:
    """The good records of ``files`` in file order (``stamps`` = size and mtime per file only makes
    the ``datasets`` cache fingerprint change with the files)."""
    del stamps
    for path in files:
        skip = set(bad_lines.get(path, ()))
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if number in skip:
                    continue
                line = raw.rstrip(b"\r\n").decode("utf-8")
                if builder == "text":
                    yield {text_field: line}
                elif line.strip():
                    yield {text_field: json.loads(line)[text_field]}


def file_stamps(files: list[str]) -> list[tuple[int, float]]:
    return [(os.path.getsize(f), os.path.getmtime(f)) for f in files]
