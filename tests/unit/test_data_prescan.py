"""Local files found clean before launch (run_train.sh's --check-config) are not scanned again by the
workers; anything else is: changed files, and launches without run_train.sh (no fingerprint)."""
from __future__ import annotations

import json

import pytest

from torchtitan_lite.components.data import DataSourceError, TextDataLoader, prescan, records
from torchtitan_lite.components.data.readiness import scan_local_records
from torchtitan_lite.components.data.sources import load_split

GOOD = json.dumps({"text": "x = 1"}) + "\n"
BAD = json.dumps({"text": None}) + "\n"


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.delenv(prescan.CLEAN_RECORDS_ENV, raising=False)


def _cfg(path) -> TextDataLoader.Config:
    return TextDataLoader.Config(dataset=str(path), shuffle="none")


def _count_scans(monkeypatch) -> list[str]:
    scanned: list[str] = []
    real = records.scan

    def scan(files, *args):
        scanned.extend(files)
        return real(files, *args)
    monkeypatch.setattr(records, "scan", scan)
    return scanned


def test_the_check_before_launch_fingerprints_only_clean_sources(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(GOOD * 3)
    bad.write_text(GOOD + BAD)
    assert scan_local_records(_cfg(good), validation=False) == ([], [prescan.fingerprint([str(good)], "json", "text")])
    problems, clean = scan_local_records(_cfg(bad), validation=False)
    assert clean == [] and len(problems) == 1 and problems[0].startswith(f"{bad}:2: ")
    skipping = TextDataLoader.Config(dataset=str(bad), shuffle="none", on_bad_record="skip")
    assert scan_local_records(skipping, validation=False) == ([], [])  # the workers must scan to leave it out


def test_a_worker_skips_the_scan_of_files_found_clean(tmp_path, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text(GOOD * 3)
    scanned = _count_scans(monkeypatch)
    monkeypatch.setenv(prescan.CLEAN_RECORDS_ENV, "0" * 32 + "," + prescan.fingerprint([str(path)], "json", "text"))
    assert load_split(_cfg(path), "train")["text"] == ["x = 1"] * 3
    assert scanned == []


def test_a_worker_without_a_fingerprint_scans(tmp_path, monkeypatch):
    """torchrun or train.py launched directly: nothing was checked before, so the workers scan."""
    path = tmp_path / "docs.jsonl"
    path.write_text(GOOD + BAD)
    scanned = _count_scans(monkeypatch)
    with pytest.raises(DataSourceError, match=r"docs\.jsonl:2: "):
        load_split(_cfg(path), "train")
    assert scanned == [str(path)]


def test_a_file_changed_after_the_check_is_scanned_again(tmp_path, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text(GOOD * 3)
    monkeypatch.setenv(prescan.CLEAN_RECORDS_ENV, prescan.fingerprint([str(path)], "json", "text"))
    path.write_text(GOOD + BAD)
    with pytest.raises(DataSourceError, match=r"docs\.jsonl:2: "):
        load_split(_cfg(path), "train")
