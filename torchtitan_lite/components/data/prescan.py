"""Local records scanned before launch are not scanned again by every worker.

run_train.sh's check before torchrun (``--check-config``) scans the run's local data files for bad records
(``records.scan``), so that a bad record stops the launch before any process starts. When the files it
scanned are clean, it hands the workers their fingerprint in ``TORCHTITAN_LITE_CLEAN_RECORDS``: each file's
absolute path, inode, size and modification time (ns), the reader and the text field. A worker skips the scan only
for files that match a fingerprint exactly; changed files, or a launch without run_train.sh (torchrun or
train.py directly, which sets no fingerprint), are scanned as before.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from torchtitan_lite.components.data import records

logger = logging.getLogger(__name__)

CLEAN_RECORDS_ENV = "TORCHTITAN_LITE_CLEAN_RECORDS"
"""Comma-separated fingerprints of local files found clean before launch (set by run_train.sh)."""
CLEAN_RECORDS_OUT_ENV = "TORCHTITAN_LITE_CLEAN_RECORDS_OUT"
"""Where ``--check-config`` writes those fingerprints for run_train.sh to pass on."""


def fingerprint(files: list[str], builder: str, text_field: str) -> str:
    stamps = [(os.path.abspath(f), *_stamp(os.stat(f))) for f in files]
    return hashlib.sha256(json.dumps([builder, text_field, stamps]).encode()).hexdigest()[:32]


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    # The inode changes when a file is replaced (written elsewhere and renamed over it), size and mtime
    # when it is written in place.
    return st.st_ino, st.st_size, st.st_mtime_ns


def scan(files: list[str], builder: str, text_field: str, policy: records.BadRecordPolicy,
         where: str) -> records.BadRecords:
    """``records.scan``, unless the check before launch found these very files clean."""
    if fingerprint(files, builder, text_field) in os.environ.get(CLEAN_RECORDS_ENV, "").split(","):
        logger.info("the records of %s were scanned before launch and are clean: not scanned again", where)
        return records.BadRecords()
    return records.scan(files, builder, text_field, policy, where)


def hand_over(clean: list[str]) -> None:
    """Write the fingerprints of clean sources where run_train.sh asked for them (nothing when not asked)."""
    path = os.environ.get(CLEAN_RECORDS_OUT_ENV)
    if path:
        with open(path, "w") as f:
            f.write(",".join(clean))
