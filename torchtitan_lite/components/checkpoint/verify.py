"""Checks a DCP folder against the state about to be loaded, before any byte is read into it.

DCP's own failures for corrupt or mismatched input are assertion texts deep inside a collective;
these checks run first and name the file and the mismatch instead: an unreadable ``.metadata``,
keys the checkpoint lacks or holds in excess, a tensor of another shape (a checkpoint from another
model flavor), and shard files that are missing or shorter than ``.metadata`` says.
``WeightsOnlyLoadPlanner`` then reads non-tensor entries without unpickling arbitrary objects.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtitan_lite.components.checkpoint.layout import DCP_METADATA_NAME, is_dcp_folder, step_dir

_SHOWN = 5


logger = logging.getLogger(__name__)

class CheckpointError(RuntimeError):
    """A checkpoint folder cannot serve the requested load; the message names file and mismatch."""


def read_metadata(path: str) -> Metadata:
    if not is_dcp_folder(path):
        hint = ""
        if os.path.isdir(path) and any(n.startswith("step-") for n in os.listdir(path)):
            hint = f" It holds step-<N> folders: point at one of them, e.g. {path}/step-<N>."
        elif os.path.isfile(os.path.join(path, "config.json")):
            hint = " It looks like a Hugging Face folder: convert it with scripts/convert_from_hf.py first."
        raise CheckpointError(f"{path} is not a DCP checkpoint folder: {os.path.join(path, DCP_METADATA_NAME)} "
                              f"does not exist.{hint}")
    metadata_path = os.path.join(path, DCP_METADATA_NAME)
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated pickle raises any of several types
        raise CheckpointError(f"checkpoint metadata {metadata_path} is unreadable or truncated "
                              f"({type(e).__name__}: {e}); the checkpoint is corrupt, load another step") from e


def check_compatible(path: str, metadata: Metadata, state: dict[str, Any], *, exact_prefixes: tuple[str, ...] = ()) -> None:
    """Raise ``CheckpointError`` unless every key of ``state`` (nested, flattened the way DCP does)
    exists in the checkpoint with the same shape and its data files are whole.

    Keys under ``exact_prefixes`` (e.g. ``"model."``) must also not exist in excess in the checkpoint.
    """
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: {key!r} is a tensor of shape {tuple(value.shape)} here "
                                  f"but a non-tensor value in the checkpoint")
        if tuple(entry.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path}: shape mismatch for {key!r}: checkpoint has {tuple(entry.size)}, this run "
                f"expects {tuple(value.shape)}. The checkpoint was written for another model configuration "
                f"(flavor, vocabulary or n_layers); load it with the configuration that wrote it (its config.toml), "
                f"or start this run in a folder of its own with --job.dump_folder DIR")
    missing = [k for k in flat if k not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} key(s) this run needs, first {missing[:_SHOWN]}. It was "
            f"written for another model or optimizer configuration; use the matching configuration, or list "
            f"the state in checkpoint.exclude_from_loading to start it fresh")
    for prefix in exact_prefixes:
        extra = [k for k in saved if k.startswith(prefix) and k not in flat]
        if extra:
            raise CheckpointError(
                f"checkpoint {path} holds {len(extra)} {prefix.rstrip('.')} key(s) this run does not have, first "
                f"{extra[:_SHOWN]}. It was written for a larger or different model; use the matching configuration")
    check_data_files(path, metadata, set(flat))


def check_data_files(path: str, metadata: Metadata, keys: set[str]) -> None:
    """Every shard file holding one of ``keys`` exists and is at least as long as ``.metadata`` says."""
    needed_bytes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in keys:
            end = info.offset + info.length
            needed_bytes[info.relative_path] = max(needed_bytes.get(info.relative_path, 0), end)
    for relative_path, needed in sorted(needed_bytes.items()):
        file = os.path.join(path, relative_path)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint data file {file} is missing ({DCP_METADATA_NAME} lists it); "
                                  f"the checkpoint is incomplete, load another step")
        size = os.path.getsize(file)
        if size < needed:
            raise CheckpointError(f"checkpoint data file {file} is truncated: {size} bytes, {DCP_METADATA_NAME} "
                                  f"expects at least {needed}; the checkpoint is corrupt, load another step")


def saved_tensor_shape(metadata: Metadata, key: str) -> tuple[int, ...] | None:
    entry = metadata.state_dict_metadata.get(key)
    return tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None


def saved_state_names(metadata: Metadata) -> set[str]:
    """Top-level state names (``model``, ``optimizer`` ...) present in a checkpoint."""
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def describe_failure(e: BaseException) -> str:
    """One line per failing rank from DCP's CheckpointException (a BaseException carrying tracebacks)."""
    if not isinstance(e, CheckpointException):
        return f"{type(e).__name__}: {e}"
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        parts.append(f"rank {rank}: {type(exc).__name__}: {text}")
    return "; ".join(parts)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with ``weights_only=False``; this one does not."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def verify_step(path: str, *, checksums: bool = True, part: int = 0, n_parts: int = 1) -> list[str]:
    """What makes the complete checkpoint ``path`` unusable, empty when nothing: an unreadable marker
    or ``.metadata``, missing or truncated shard files, and (``checksums``) files whose content no
    longer matches the hashes in the marker. ``part`` / ``n_parts`` split the hashing between ranks:
    this call hashes every ``n_parts``-th file starting at ``part``; the cheap checks run on every part."""
    from torchtitan_lite.components.checkpoint.checksums import verify_file
    from torchtitan_lite.components.checkpoint.layout import Marker

    try:
        marker = Marker.read(path)
        metadata = read_metadata(path)
        check_data_files(path, metadata, set(metadata.state_dict_metadata))
    except (ValueError, CheckpointError) as e:
        return [str(e)]
    if not checksums or marker is None or not marker.checksums:
        return []
    names = sorted(marker.checksums)[part::n_parts]
    return [problem for name in names if (problem := verify_file(path, name, marker.checksums[name])) is not None]


def verify_folder(path: str) -> dict[str, list[str]]:
    """Offline check of a checkpoint folder (one ``step-<N>`` or a folder of them): checkpoint -> problems.
    Folders without a completeness marker are reported as incomplete rather than checked."""
    from torchtitan_lite.components.checkpoint.layout import MARKER_NAME, scan_steps, step_dir

    if os.path.isfile(os.path.join(path, MARKER_NAME)) or is_dcp_folder(path):
        return {path: verify_step(path)}
    complete, incomplete = scan_steps(path)
    if not complete and not incomplete:
        raise CheckpointError(_not_a_checkpoint(path))
    found = {step_dir(path, s): verify_step(step_dir(path, s)) for s in complete}
    found.update({step_dir(path, s): [f"incomplete: no {MARKER_NAME} marker (an interrupted save), never loaded"]
                  for s in incomplete})
    return found


def _not_a_checkpoint(path: str) -> str:
    """Why ``path`` (neither a checkpoint nor a folder of step-<N> checkpoints) has nothing to verify, and what
    to pass instead: each mistake gets its own answer."""
    from torchtitan_lite.components.checkpoint.layout import MARKER_NAME, scan_steps

    usage = "give a checkpoint folder (step-<N>) or the folder holding them (<dump_folder>/checkpoint)"
    if not os.path.exists(path):
        return f"{path} does not exist; {usage}"
    if not os.path.isdir(path):
        return f"{path} is a file, not a checkpoint folder; {usage}"
    if re.fullmatch(r"step-\d+", os.path.basename(os.path.normpath(path))):
        files = os.listdir(path)
        held = "it is empty" if not files else f"it holds {len(files)} file(s) of a save that never finished"
        return (f"{path} is a step folder without a checkpoint: no {MARKER_NAME} marker and no {DCP_METADATA_NAME} "
                f"({held}), so nothing there was ever loadable; verify {os.path.dirname(os.path.normpath(path))} "
                f"to see the complete steps")
    inner = sorted(name for name in os.listdir(path) if any(scan_steps(os.path.join(path, name))))
    if inner:
        return (f"{path} holds no step-<N> folders itself, but {', '.join(inner)} in it does (a run's dump folder): "
                f"verify {os.path.join(path, inner[0])}")
    return f"{path} holds neither a checkpoint nor step-<N> checkpoint folders; {usage}"


def verify_together(path: str, *, checksums: bool, rank: int, world_size: int) -> list[str]:
    """Problems found in ``path`` by all ranks together (each hashes a share of the files)."""
    start = time.perf_counter()
    mine = verify_step(path, checksums=checksums, part=rank, n_parts=world_size)
    if dist.is_initialized() and world_size > 1:
        gathered: list[list[str] | None] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        mine = sorted({p for problems in gathered for p in problems or []})
    if not mine and checksums:
        logger.info("verified %s in %.1fs", path, time.perf_counter() - start)
    return mine


def newest_verified_step(folder: str, complete: list[int], *, checksums: bool, rank: int, world_size: int) -> int:
    """The newest complete step whose files verify; the ones skipped are reported."""
    rejected: list[int] = []
    reasons: list[str] = []
    for step in reversed(complete):
        path = step_dir(folder, step)
        problems = verify_together(path, checksums=checksums, rank=rank, world_size=world_size)
        if not problems:
            if rejected:
                logger.warning("resuming from %s instead of the newer %s, which failed verification",
                               path, [step_dir(folder, s) for s in rejected])
            return step
        logger.error("checkpoint %s fails verification and is skipped: %s", path, "; ".join(problems))
        rejected.append(step)
        reasons.append(f"step {step}: {'; '.join(problems)}")
    raise CheckpointError(f"no complete checkpoint in {folder} passes verification ({' | '.join(reasons)}); "
                          f"move the folder away to start from scratch")
