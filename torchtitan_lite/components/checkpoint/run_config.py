"""The config a checkpoint was trained with: the ``config.toml`` saved with it, or a registered config.

Every checkpoint ``<dump_folder>/<checkpoint.folder>/step-N`` holds the resolved config (every override
included) of the run that wrote it, ``step-N/config.toml``, and so does a Hugging Face export. The export,
import and generation scripts read that one, so a run trained with ``--model.n_layers 2`` converts with no
flags, whatever later runs in the same folder wrote. Checkpoints written before checkpoints carried their
config fall back to the run's ``<dump_folder>/config.toml``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torchtitan_lite.config.overrides import apply_overrides, overrides_from_dict
from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.config.toml_io import load_toml_overrides

logger = logging.getLogger(__name__)

RUN_CONFIG_NAME = "config.toml"
BASE_CONFIG = "llama3_debug"
"""The registered config the saved TOML is applied to; the TOML is complete, so any base of the same
root gives the same result."""


def find_run_config(checkpoint_dir: str) -> Path | None:
    """The ``config.toml`` inside ``checkpoint_dir`` (a checkpoint or an exported folder), else that of
    the run folder above it (<dump>/<folder>/step-N of an older checkpoint); None when there is none."""
    path = Path(checkpoint_dir).resolve()
    for folder in (path, path.parent, path.parent.parent):
        candidate = folder / RUN_CONFIG_NAME
        if candidate.is_file():
            return candidate
    return None


def load_config_file(path: str | Path, *, registry: ConfigRegistry, base: str = BASE_CONFIG) -> Any:
    """A root config read back from a saved ``config.toml``."""
    saved = _renamed_values(load_toml_overrides(str(path)))
    overrides = overrides_from_dict(saved, origin=str(path))
    return apply_overrides(registry.get(base), overrides, base_label=f"config '{base}'")


def _renamed_values(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config in today's spelling: data.shuffle was a bool (true read documents in a shuffled order,
    what 'documents' reads; false the source order, 'none'). A new run is refused such a value; a checkpoint
    that was trained with it still exports, converts and generates."""
    data = saved.get("data")
    if isinstance(data, dict) and isinstance(data.get("shuffle"), bool):
        data["shuffle"] = "documents" if data["shuffle"] else "none"
    return saved


def config_for_checkpoint(checkpoint_dir: str, *, registry: ConfigRegistry, config_name: str | None = None) -> Any:
    """The root config of ``checkpoint_dir``: the registered ``config_name`` when given (it overrides the
    run's file), else the run's saved ``config.toml``."""
    if config_name is not None:
        logger.info("using registered config %r (given with --config) for %s", config_name, checkpoint_dir)
        return registry.get(config_name)
    path = find_run_config(checkpoint_dir)
    if path is None:
        raise FileNotFoundError(
            f"no {RUN_CONFIG_NAME} next to {checkpoint_dir} (looked in it, its parent and the run folder "
            f"above); pass --config NAME with the registered config it was trained with")
    logger.info("using the run's config %s", path)
    return load_config_file(path, registry=registry)
