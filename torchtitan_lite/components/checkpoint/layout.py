"""On-disk layout of a run's checkpoints: ``<folder>/step-<N>/`` plus a completeness marker.

A checkpoint folder counts as complete only once ``step-<N>/.complete`` exists. The marker is
written (atomically: temporary file + rename) after every rank's shards and DCP's ``.metadata``
are on disk, so a process killed mid-save leaves a folder without a marker, which loading ignores.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

MARKER_NAME = ".complete"
DCP_METADATA_NAME = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")
NOTHING_YET, NORMAL, ABNORMAL = "nothing", "normal", "abnormal"
"""Values of ``Marker.followed_by``."""


@dataclass
class Marker:
    """What a complete checkpoint holds; stored as JSON in ``step-<N>/.complete``."""

    step: int
    world_size: int
    states: list[str]
    model_only: bool
    time: float
    checksum_algorithm: str | None = None
    checksums: dict[str, Any] | None = None
    """File name (relative to the step folder) -> content digest, see checksums.py; None in checkpoints
    written before checksums existed, which are then checked for completeness only."""
    data_layout: dict[str, Any] | None = None
    """How the run fed its data (components/data/layout.py DataLayout); None in model-only checkpoints,
    runs without one and checkpoints written before it was recorded."""
    moe_top_k: int | None = None
    """Routed experts per token of the model that wrote it (MoE models); None for dense models and checkpoints
    written before it was recorded. The weights have the same shapes under any top_k, so only this tells a
    resume that the routing changed."""
    followed_by: str | None = None
    """What the loss of the step trained from this state was, as far as any run saw it: 'nothing' (no step
    has trained from it yet), 'normal' (one did, to a finite loss within the spike bounds) or 'abnormal'
    (only non-finite or spiking losses so far). Rewritten in place as runs learn it, so a resume in a new
    process knows; None in checkpoints written before this was recorded."""

    @staticmethod
    def read(checkpoint_dir: str) -> Marker | None:
        path = os.path.join(checkpoint_dir, MARKER_NAME)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                saved = json.load(f)
            # Fields a later release added are ignored, so this one still reads its checkpoints.
            return Marker(**{k: v for k, v in saved.items() if k in _MARKER_FIELDS})
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"checkpoint marker {path} is unreadable ({e}); delete it to treat "
                             f"{checkpoint_dir} as incomplete") from e

    def write(self, checkpoint_dir: str) -> None:
        write_json_atomically(os.path.join(checkpoint_dir, MARKER_NAME), asdict(self))


_MARKER_FIELDS = {f.name for f in fields(Marker)}


def write_json_atomically(path: str, obj: Any) -> None:
    """``obj`` as JSON at ``path``: a temporary file, flushed to disk, then renamed over it."""
    write_text_atomically(path, json.dumps(obj, indent=1))


def write_text_atomically(path: str, text: str) -> None:
    """``text`` at ``path``: a temporary file, flushed to disk, then renamed over it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, default: Any) -> Any:
    """The JSON at ``path``, ``default`` when there is no such file."""
    if not os.path.isfile(path):
        return default
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); restore or delete it") from e


def new_marker(step: int, world_size: int, states: list[str], model_only: bool,
               data_layout: dict[str, Any] | None = None, moe_top_k: int | None = None) -> Marker:
    return Marker(step=step, world_size=world_size, states=sorted(states), model_only=model_only, time=time.time(),
                  data_layout=data_layout, moe_top_k=moe_top_k, followed_by=NOTHING_YET)


def check_same_top_k(saved: int | None, now: int | None, checkpoint: str) -> None:
    """A resume must keep the routing its weights were trained with: top_k changes what every MoE layer
    computes (how many experts each token mixes) while every tensor keeps its shape, so nothing else would
    notice. ``saved`` None: a dense model, or a checkpoint from before top_k was recorded."""
    if saved is None or now is None or saved == now:
        return
    raise ValueError(
        f"{checkpoint} was trained with MoE top_k={saved} (routed experts per token), this run has top_k={now}: "
        f"top_k changes what the model computes, so resuming would continue another model. Resume with the model "
        f"that wrote it (top_k={saved}), or start a new run from these weights in its own --job.dump_folder with "
        f"--checkpoint.initial_load_path {checkpoint} --checkpoint.initial_load_model_only true")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def hf_export_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}-hf")


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA_NAME))


def scan_steps(folder: str) -> tuple[list[int], list[int]]:
    """(complete, incomplete) step numbers found in ``folder``, each sorted ascending."""
    if not os.path.isdir(folder):
        return [], []
    complete: list[int] = []
    incomplete: list[int] = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match is None or not os.path.isdir(os.path.join(folder, name)):
            continue
        step = int(match.group(1))
        has_marker = os.path.isfile(os.path.join(folder, name, MARKER_NAME))
        (complete if has_marker else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


def describe_steps(folder: str) -> str:
    complete, incomplete = scan_steps(folder)
    text = f"complete steps in {folder}: {complete or 'none'}"
    if incomplete:
        text += f"; incomplete (no {MARKER_NAME} marker, never loaded): {incomplete}"
    return text


def set_aside(folder: str, steps: list[int], subfolder: str) -> None:
    """Move the checkpoints of ``steps`` to ``<folder>/<subfolder>/step-<N>``, out of what loading and
    purging look at."""
    destination = os.path.join(folder, subfolder)
    os.makedirs(destination, exist_ok=True)
    for step in steps:
        os.replace(step_dir(folder, step), step_dir(destination, step))


def purge_old(folder: str, keep_latest_k: int, protected: set[int]) -> list[int]:
    """Delete complete checkpoints beyond the newest ``keep_latest_k`` plus unfinished folders
    older than the newest complete one (leftovers of crashed saves). Never touches ``protected``.

    Returns the purged step numbers.
    """
    complete, incomplete = scan_steps(folder)
    if keep_latest_k <= 0 or not complete:
        return []
    newest = complete[-1]
    doomed = complete[:-keep_latest_k] + [s for s in incomplete if s < newest]
    purged = []
    for step in sorted(doomed):
        if step in protected:
            continue
        path = step_dir(folder, step)
        # The marker goes first so an interrupted purge never leaves a "complete" partial folder.
        marker = os.path.join(path, MARKER_NAME)
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(path, ignore_errors=True)
        purged.append(step)
    if purged:
        logger.info("purged checkpoints %s from %s (keep_latest_k=%d)", purged, folder, keep_latest_k)
    return purged
