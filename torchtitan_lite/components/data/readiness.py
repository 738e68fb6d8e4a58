"""Is what a training run reads there, and usable? The tokenizer and the data source, checked before launch.

``--check-config`` lists the problems (and run_train.sh's check before torchrun makes them errors); the
trainer checks again before its process group starts, for launches that bypass run_train.sh. Options
the source has no use for (``check_options``) and local paths are checked; a hub dataset is asked for its
metadata with a short timeout, never downloaded. ``--check-config`` also scans local files for bad
records (``scan_local_records``), which the trainer leaves to its data loader. Each problem names the
command that fetches the missing piece, the option that fixes it, or the override for a smoke run.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchtitan_lite.components.data import prescan, records
from torchtitan_lite.components.data.sources import (
    DataSourceError,
    check_held_out,
    check_options,
    local_files,
    resolve_data_files,
    source_kind,
)
from torchtitan_lite.components.tokenizer_files import TokenizerError, locate_tokenizer
from torchtitan_lite.hf_assets import (
    DATASET_CHECK_TIMEOUT_S,
    HubAccessError,
    check_hub_dataset,
    hub_offline,
    tokenizer_fetch_hint,
)

if TYPE_CHECKING:
    from torchtitan_lite.components.data.dataloader import TextDataLoader
    from torchtitan_lite.components.tokenizer import Tokenizer


class DataNotReadyError(ValueError):
    """The tokenizer or the data source of a run is missing or unreachable."""


def data_problems(data: TextDataLoader.Config, tokenizer: Tokenizer.Config, *, validation: bool,
                  timeout: float = DATASET_CHECK_TIMEOUT_S) -> list[str]:
    """What would stop a run from reading its data, one message per problem (empty when ready)."""
    problems = []
    if tokenizer.path is not None:
        try:
            locate_tokenizer(tokenizer.path, missing_hint=tokenizer_fetch_hint(tokenizer.path))
        except TokenizerError as error:
            problems.append(str(error))
    if data.sources:
        from torchtitan_lite.components.data.mixture_loader import for_source

        # Each source is checked as a single source is, its problems naming the source and its own fields.
        for i, source in enumerate(data.sources):
            problems.extend(str(for_source(DataSourceError(p), i, source.name)) for p in
                            _source_problems(data.source_config(i), validation=validation, timeout=timeout))
        return problems
    return problems + _source_problems(data, validation=validation, timeout=timeout)


def _source_problems(data: TextDataLoader.Config, *, validation: bool, timeout: float) -> list[str]:
    problems = []
    try:
        check_options(data, validation=validation)
    except DataSourceError as error:
        problems.append(str(error))
    if data.token_store is not None:
        problems.extend(_store_problems(data, validation=validation))
        return problems
    try:
        _check_source(data, timeout=timeout)
        if validation and data.validation_files is not None:
            resolve_data_files(data.validation_files, f"data.validation_files={data.validation_files!r}")
            check_held_out(data)
    except (DataSourceError, HubAccessError) as error:
        problems.append(str(error))
    return problems


def require_data(data: TextDataLoader.Config, tokenizer: Tokenizer.Config, *, validation: bool) -> None:
    """Raise ``DataNotReadyError`` listing every problem. Under torchrun only local rank 0 asks (one hub
    request per node, not per GPU); when it fails, torchrun stops the node's other ranks."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    problems = data_problems(data, tokenizer, validation=validation)
    if problems:
        raise DataNotReadyError(not_ready_text(problems))


def scan_local_records(data: TextDataLoader.Config, *, validation: bool) -> tuple[list[str], list[str]]:
    """Scan the run's local data files for bad records as the workers would: (problems, fingerprints of the
    clean sources). A bad record is a problem under data.on_bad_record=error; under 'skip' it is logged
    and its source gets no fingerprint, so the workers scan it again to leave the bad records out."""
    if data.sources:
        scans = [scan_local_records(data.source_config(i), validation=validation) for i in range(len(data.sources))]
        return [p for problems, _ in scans for p in problems], [f for _, clean in scans for f in clean]
    sources = []
    if source_kind(data.dataset) == "files":
        sources.append((data.dataset, f"data.dataset={data.dataset!r}"))
    if validation and data.validation_files is not None:
        sources.append((data.validation_files, f"data.validation_files={data.validation_files!r}"))
    problems, clean = [], []
    for pattern, where in sources:
        try:
            files, builder, field = local_files(pattern, data, where)
            bad = records.scan(files, builder, field, data.on_bad_record, where)
        except DataSourceError as error:
            problems.append(str(error))
            continue
        if not bad.count:
            clean.append(prescan.fingerprint(files, builder, field))
    return problems, clean


def _store_problems(data: TextDataLoader.Config, *, validation: bool) -> list[str]:
    """A pretokenised store's files, checked for presence and size (the checksums are read by the loader)."""
    from torchtitan_lite.components.data.window_loader import run_store

    problems = []
    for role in ("train", "validation") if validation else ("train",):
        try:
            run_store(data, role, tokenizer=None)
        except DataSourceError as error:
            problems.append(str(error))
    return problems


def not_ready_text(problems: list[str]) -> str:
    return "the run's data is not ready:\n" + "\n".join(f"  - {p}" for p in problems)


def _check_source(data: TextDataLoader.Config, *, timeout: float) -> None:
    kind = source_kind(data.dataset)
    if kind == "files":
        resolve_data_files(data.dataset, f"data.dataset={data.dataset!r}")
    elif kind == "hub" and (data.streaming or not hub_offline()):
        # Offline, a map-style hub dataset may still be in the datasets cache; streaming never works offline.
        check_hub_dataset(data.dataset, data.dataset_config, timeout=timeout)
