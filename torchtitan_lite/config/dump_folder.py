"""The default dump folder is one per registered config: ``./outputs/<config name>``.

Runs of different configs then never share a folder by default, so a run never finds another config's
checkpoints and tries to resume another model from them. The folder is derived here, once, when a
registered config is looked up by its name; a config function, a --config-file or a --job.dump_folder
that names a folder is kept as it is.
"""
from __future__ import annotations

from typing import Any

OUTPUTS_ROOT = "./outputs"
"""job.dump_folder's default, the root of the per-config folders."""


def default_dump_folder(config_name: str) -> str:
    """Where a run of the registered config ``config_name`` writes unless told otherwise."""
    return f"{OUTPUTS_ROOT}/{config_name}"


def with_default_dump_folder(config: Any, config_name: str) -> Any:
    """``config`` (a registered config just built) with job.dump_folder moved from the shared default to
    the config's own folder; a root config without a job section, or one that names a folder, is unchanged."""
    job: Any = getattr(config, "job", None)
    if getattr(job, "dump_folder", None) == OUTPUTS_ROOT:
        # The section's checks (e.g. a file of that name) run again once the overrides are applied.
        job.dump_folder = default_dump_folder(config_name)
    return config
