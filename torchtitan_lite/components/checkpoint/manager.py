"""Saves and restores the whole training state with torch.distributed.checkpoint (DCP).

Each checkpoint is ``<dump_folder>/<folder>/step-<N>/``: every rank writes its shards, DCP's
coordinator (rank 0) writes ``.metadata`` once all ranks reported their writes, and only then rank 0
writes the ``.complete`` marker. DCP's final gather is the barrier that makes this safe: rank 0 gets
past ``dcp.save`` (or its async future resolves) only after every rank finished writing. Loading
considers only folders with the marker; rank 0 scans the folder and broadcasts what it found, so all
ranks load the same step even on filesystems with lagging metadata caches.

The marker also holds a content hash of every file (``checksums.py``). Before loading, the ranks
split the files between them and verify them; an automatic resume skips a latest checkpoint that
fails (corrupt, truncated, ``.metadata`` missing) and takes the previous one, an explicit
``load_step`` fails instead. A save that fails (disk full, quota, read-only) is described in words
on every rank, its partial folder is removed, and the run stops or warns (``on_save_error``).

Model and optimizer state are sharded tensors that DCP reshards on load (save on FSDP 2, load on
1 process or FSDP x TP). Per-rank state that is not a sharded tensor (``dataloader``,
``train_state`` with its RNGs) is stored under rank-unique keys ``<name>.rank<r>``. A state with
``load_rank_states`` (the data loader) takes every saved rank's copy: when the data-parallel degree or the
world size changed since the save, every rank reads all of them and the loader continues from them (a
window position is the same on every rank; a stream's refuses another degree). The marker records
the run's data layout (``components/data/layout.py``), readable before launch.

Each checkpoint also holds the resolved config of the run that wrote it (``step-<N>/config.toml``,
written before the marker and covered by its checksums): the export and generation tools read that
one, so a later run with other settings in the same folder cannot change what a checkpoint is.

Whether a normal loss ever followed a checkpoint (the step trained from its state) is only learned after
it is saved, often by another process; the manager records it in the checkpoint's marker
(``Marker.followed_by``) as soon as it is known, and a resume from a checkpoint no normal loss followed
says so when it loads.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.components.checkpoint import hf_io
from torchtitan_lite.components.checkpoint.checksums import ALGORITHM, ChecksummingWriter, hash_file
from torchtitan_lite.components.checkpoint.disk import (
    check_writable_with_space,
    describe_save_error,
    expected_checkpoint_sizes,
    whole_checkpoint_bytes,
)
from torchtitan_lite.components.checkpoint.followups import Followups
from torchtitan_lite.components.checkpoint.key_accounting import check_loadable
from torchtitan_lite.components.checkpoint.layout import (
    ABNORMAL,
    MARKER_NAME,
    NORMAL,
    Marker,
    check_same_top_k,
    describe_steps,
    hf_export_dir,
    new_marker,
    purge_old,
    read_json,
    scan_steps,
    set_aside,
    step_dir,
    write_json_atomically,
    write_text_atomically,
)
from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
from torchtitan_lite.components.checkpoint.stateful import decode, encode
from torchtitan_lite.components.checkpoint.verify import (
    CheckpointError,
    WeightsOnlyLoadPlanner,
    describe_failure,
    newest_verified_step,
    read_metadata,
    saved_state_names,
    saved_tensor_shape,
    verify_together,
)
from torchtitan_lite.components.data.layout import DataLayout
from torchtitan_lite.config import Configurable
from torchtitan_lite.distributed import utils as dist_utils

logger = logging.getLogger(__name__)
# A run without a process group is a normal single-process run here, not a mistake worth a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

PER_RANK_STATES = ("dataloader", "train_state", "spike_guard")
"""States that are not sharded tensors; each rank saves and restores its own copy (the data position and
RNGs differ per rank; the spike guard's statistics are the same on every rank but vary in size)."""

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def initial_weights_passed_over(initial_load_path: str, folder: str, step: int) -> str:
    """Why checkpoint.initial_load_path is not read: the run's folder holds a checkpoint, which it resumes."""
    return (f"checkpoint.initial_load_path={initial_load_path} is not read: {folder} holds the checkpoint of step "
            f"{step}, which this run resumes (initial weights only start a folder without checkpoints); to start "
            f"from {initial_load_path}, use another --job.dump_folder")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The checkpoint a run resumed (or was initialised) from, as far as it can be vouched for."""

    path: str
    step: int
    unchecked: str | None
    """Why its files were not checked against checksums ('checkpoint.verify_checksums=false', 'it was
    written without checksums'), None when they were."""
    followed_by: str | None
    """``Marker.followed_by`` when it loaded: 'nothing', 'normal', 'abnormal', or None (not recorded)."""


class CheckpointManager(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        enable: bool = False
        """Save checkpoints, and resume from the latest complete one in the run's folder at start."""
        folder: str = "checkpoint"
        """Checkpoint folder under job.dump_folder; each checkpoint is <folder>/step-<N>/."""
        interval: int = 500
        """Save every this many steps; the last step is always saved."""
        keep_latest_k: int = 0
        """Keep only the newest k complete checkpoints (older ones are deleted after a new one completes);
        0 keeps all. The checkpoint this run resumed from, and the newest one known good (followed by a
        normal loss), are never deleted."""
        load_step: int = -1
        """Resume from this step's checkpoint instead of the latest complete one; -1 = latest."""
        async_mode: Literal["disabled", "async"] = "disabled"
        """'async' copies state to CPU and writes in a background thread while training goes on
        (over a separate gloo process group); a save waits for the previous one to finish first."""
        last_save_model_only: bool = False
        """The final checkpoint holds only the model weights (in export_dtype), for export and inference."""
        last_save_in_hf: bool = False
        """Also write the final model as Hugging Face config.json + model.safetensors to <folder>/step-<N>-hf/."""
        export_dtype: Literal["float32", "bfloat16"] = "float32"
        """Dtype of model-only checkpoints (seed, last_save_model_only) and of the Hugging Face export
        (last_save_in_hf, and scripts/convert_to_hf.py unless its --dtype says otherwise)."""
        initial_load_path: str | None = None
        """DCP checkpoint folder to initialise from when the run's folder has no complete checkpoint yet
        (a seed checkpoint, or the output of scripts/convert_from_hf.py); read with checkpoint.enable false too."""
        initial_load_model_only: bool = True
        """Load only the model from initial_load_path (the optimizer, data and step start fresh)."""
        exclude_from_loading: list[str] = field(default_factory=list)
        """State names not restored on resume (model, optimizer, lr_scheduler, dataloader, train_state,
        grad_scaler, spike_guard); they start fresh."""
        create_seed_checkpoint: bool = False
        """Write a model-only step-0 checkpoint right after initialisation and exit. Run it on 1 process:
        sharded initialisation draws different random numbers, the 1-process seed is layout-independent."""
        verify_checksums: bool = True
        """Before resuming, check every file of the checkpoint against the content hashes in its marker
        (the ranks share the reading). A mismatch names the file and tensor; an automatic resume then
        falls back to the previous complete checkpoint, an explicit load_step fails."""
        on_save_error: Literal["stop", "warn"] = "stop"
        """When a save fails (disk full, quota, read-only filesystem) its partial folder is removed and the
        previous checkpoint kept; 'stop' then ends the run with the reason, 'warn' logs it and trains on.
        Also decides whether too little free space at start is an error or a warning."""

        def __post_init__(self) -> None:
            if self.interval <= 0:
                raise ValueError(f"checkpoint.interval={self.interval} must be > 0; use e.g. 500 "
                                 f"(the last step is always saved)")
            if self.keep_latest_k < 0:
                raise ValueError(f"checkpoint.keep_latest_k={self.keep_latest_k} must be >= 0 (0 keeps all)")
            if self.load_step < -1:
                raise ValueError(f"checkpoint.load_step={self.load_step} must be a step >= 0, or -1 for the latest")
            if self.create_seed_checkpoint and not self.enable:
                raise ValueError("checkpoint.create_seed_checkpoint=True needs checkpoint.enable=True")
            if self.initial_load_path == "":
                raise ValueError("checkpoint.initial_load_path='' is empty; give a DCP folder or leave it unset")
            if self.last_save_in_hf and not self.enable:
                raise ValueError("checkpoint.last_save_in_hf=True needs checkpoint.enable=True")

    config: CheckpointManager.Config

    def __init__(self, config: CheckpointManager.Config, *, dump_folder: str, states: dict[str, Stateful],
                 model_args: Any = None, model_spec: Any = None, data_layout: DataLayout | None = None,
                 run_config: str | None = None, moe_top_k: int | None = None) -> None:
        """``run_config``: the run's resolved config as TOML, stored in every checkpoint (and HF export).
        ``moe_top_k``: the model's routed experts per token (MoE models), recorded in every marker and held
        against the marker of the checkpoint a run resumes from."""
        self.config = config
        self.run_config = run_config
        self.moe_top_k = moe_top_k
        self.data_layout = data_layout
        """How this run feeds its data, recorded in each checkpoint's marker."""
        self.loaded_data_layout: DataLayout | None = None
        """The data layout of the checkpoint ``load`` resumed from (None: none, or not recorded)."""
        self.folder = os.path.join(dump_folder, config.folder)
        self.states = dict(states)
        self.rank, self.world_size = dist_utils.rank(), dist_utils.world_size()
        unknown = sorted(set(config.exclude_from_loading) - set(self.states))
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading has unknown state(s) {unknown}; "
                             f"valid: {sorted(self.states)}")
        if config.create_seed_checkpoint and self.world_size > 1:
            raise ValueError(f"checkpoint.create_seed_checkpoint=True runs on 1 process (world size is "
                             f"{self.world_size}) so the seed does not depend on the parallel layout; "
                             f"launch with NGPU=1 / a single process")
        self.hf_adapter = None
        if config.last_save_in_hf:
            adapter_cls = getattr(model_spec, "state_dict_adapter_cls", None)
            if adapter_cls is None or model_args is None:
                raise ValueError("checkpoint.last_save_in_hf=True needs a model with a Hugging Face state-dict "
                                 "adapter; this model has none, set checkpoint.last_save_in_hf=False")
            self.hf_adapter = adapter_cls(model_args)
        # Background saves talk over their own gloo group so they never interleave with the
        # training loop's collectives on the default group.
        self._save_group = None
        self._poll_group = None
        if config.enable and config.async_mode == "async" and dist.is_initialized():
            self._save_group = dist.new_group(backend="gloo")
            # Each step's "has every rank's background save finished?" goes over a third group: the save
            # group is busy inside the save, and the default group may be NCCL (a device sync each step).
            self._poll_group = dist.new_group(backend="gloo")
        self._pending: Future | None = None
        self._pending_path: str | None = None
        self._loaded_step: int | None = None
        self._last_saved_step: int | None = None
        self._known_good: frozenset[int] = frozenset()
        self.loaded: LoadedCheckpoint | None = None
        """The checkpoint this run started from; None when it started fresh."""
        self.followups = Followups(self.folder, rank=self.rank, world_size=self.world_size)
        """Whether a normal loss followed each checkpoint this process saved or loaded, kept in its marker."""

    @property
    def known_good(self) -> frozenset[int]:
        """Steps whose checkpoint is known good (followed by a normal loss); purging keeps the newest of them."""
        return self._known_good

    @known_good.setter
    def known_good(self, steps: frozenset[int]) -> None:
        """Set by the training loop as it learns them; each newly good checkpoint records it in its marker."""
        for step in sorted(steps - self._known_good):
            self.followups.record(step, NORMAL)
        self._known_good = steps

    def note_abnormal_loss(self, step: int) -> None:
        """Step ``step`` trained to a non-finite or spiking loss: unless a normal loss followed it before,
        the checkpoint of step ``step - 1`` records that only an abnormal one did."""
        self.followups.record(step - 1, ABNORMAL)

    # ----------------------------------------------------------------------------------------------
    # Loading

    def load(self) -> int:
        """Restore the latest complete checkpoint (or ``load_step``); returns its step, 0 when none."""
        cfg = self.config
        if cfg.create_seed_checkpoint:
            return 0
        if not cfg.enable:
            # Initial weights do not need checkpoints of the run's own: a run may start from a seed and save nothing.
            return self._initial_load(cfg.initial_load_path) if cfg.initial_load_path is not None else 0
        complete, incomplete = self._agreed_scan()
        if incomplete:
            logger.warning("ignoring checkpoint folder(s) without a %s marker (interrupted saves): %s",
                           MARKER_NAME, [step_dir(self.folder, s) for s in incomplete])
        if cfg.load_step >= 0:
            if cfg.load_step not in complete:
                raise CheckpointError(f"checkpoint.load_step={cfg.load_step}: there is no complete "
                                      f"{step_dir(self.folder, cfg.load_step)}; {describe_steps(self.folder)}")
            problems = verify_together(step_dir(self.folder, cfg.load_step), checksums=cfg.verify_checksums,
                                       rank=self.rank, world_size=self.world_size)
            if problems:
                raise CheckpointError(f"checkpoint.load_step={cfg.load_step}: {step_dir(self.folder, cfg.load_step)} "
                                      f"fails verification: {'; '.join(problems)}. Load another step "
                                      f"({describe_steps(self.folder)}), or -1 for the newest one that verifies")
            step = cfg.load_step
        elif complete:
            step = newest_verified_step(self.folder, complete, checksums=cfg.verify_checksums, rank=self.rank,
                                            world_size=self.world_size)
        elif cfg.initial_load_path is not None:
            return self._initial_load(cfg.initial_load_path)
        else:
            logger.info("no checkpoint in %s: starting from step 0", self.folder)
            return 0

        if cfg.initial_load_path is not None:
            logger.warning("%s", initial_weights_passed_over(cfg.initial_load_path, self.folder, step))
        path = step_dir(self.folder, step)
        marker = Marker.read(path)
        if marker is None:  # scan_steps counts a step complete only when its marker exists
            raise CheckpointError(f"{path} lost its completion marker while loading; {describe_steps(self.folder)}")
        check_same_top_k(marker.moe_top_k, self.moe_top_k, path)
        wanted = [n for n in self.states if n not in cfg.exclude_from_loading]
        absent = [n for n in wanted if n not in marker.states]
        if absent:
            # A seed (step 0) or a model-only final save: expected for the former, notable for the latter.
            log = logger.info if step == 0 else logger.warning
            log("%s holds only %s; %s start fresh", path, marker.states, absent)
        start = time.perf_counter()
        self.loaded_data_layout = DataLayout.from_record(marker.data_layout)
        self._load_from(path, read_metadata(path), [n for n in wanted if n in marker.states], marker.world_size,
                        self.loaded_data_layout)
        self._loaded_step = step
        self._adopt(path, step, marker)
        logger.info("resumed from %s in %.1fs", path, time.perf_counter() - start)
        self.followups.warn_on_resume(path, marker, complete)
        return step

    def _adopt(self, path: str, step: int, marker: Marker | None) -> None:
        """``path`` (of ``step``) is the state training goes on from; facts learned about it go to its marker."""
        unchecked = ("checkpoint.verify_checksums=false" if not self.config.verify_checksums else
                     None if marker is not None and marker.checksums else "it was written without checksums")
        self.loaded = LoadedCheckpoint(path=path, step=step, unchecked=unchecked,
                                       followed_by=None if marker is None else marker.followed_by)
        if marker is not None and path == step_dir(self.folder, step):
            self.followups.adopt(marker)

    def followed_by_normal_loss(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose checkpoint a normal loss followed, as their markers record it."""
        return self.followups.normal(steps)

    def _initial_load(self, path: str) -> int:
        metadata = read_metadata(path)
        marker = Marker.read(path)
        problems = verify_together(path, checksums=self.config.verify_checksums, rank=self.rank,
                                   world_size=self.world_size) if marker is not None else []
        if problems:
            raise CheckpointError(f"checkpoint.initial_load_path={path} fails verification: {'; '.join(problems)}")
        candidates = ["model"] if self.config.initial_load_model_only else list(self.states)
        saved = saved_state_names(metadata)
        names = [n for n in candidates if n not in self.config.exclude_from_loading and n in saved]
        if not names:
            raise CheckpointError(f"checkpoint.initial_load_path={path} holds none of the states {candidates} "
                                  f"(its top-level names are {sorted(saved)}); write it with this project's "
                                  f"checkpointing or scripts/convert_from_hf.py")
        saved_world = marker.world_size if marker else _count_rank_keys(metadata)
        restored = self._load_from(path, metadata, names, saved_world,
                                   DataLayout.from_record(marker.data_layout) if marker else None)
        logger.info("initialised %s from %s", names, path)
        step = int(restored["train_state"]["step"]) if "train_state" in restored else 0
        self._adopt(path, step, marker)
        return step

    def _load_from(self, path: str, metadata: Metadata, names: list[str], saved_world_size: int | None,
                   saved_layout: DataLayout | None = None) -> dict[str, Any]:
        """DCP-load ``names`` from ``path`` after checking the folder; returns decoded per-rank states."""
        target: dict[str, Any] = {}
        per_rank_keys: dict[str, list[str]] = {}
        for name in names:
            if name not in PER_RANK_STATES:
                target[name] = _without_absent_optional_keys(name, self.states[name], metadata)
                continue
            keys = self._per_rank_sources(path, metadata, name, saved_world_size, saved_layout)
            if not keys:
                continue
            target[name] = {}
            for key in keys:
                shape = saved_tensor_shape(metadata, f"{name}.{key}")
                if shape is None:
                    raise CheckpointError(f"checkpoint {path} has no {name!r} state for {key} (it holds "
                                          f"{sorted(saved_state_names(metadata))})")
                target[name][key] = torch.empty(shape, dtype=torch.uint8)
            per_rank_keys[name] = keys
        check_loadable(path, metadata, target, rank=self.rank, world_size=self.world_size)
        try:
            dcp.load(target, checkpoint_id=path, planner=WeightsOnlyLoadPlanner(), no_dist=not dist.is_initialized())
        except CheckpointException as e:
            raise CheckpointError(f"loading checkpoint {path} failed: {describe_failure(e)}") from e
        restored = {}
        for name, value in target.items():
            if name in per_rank_keys and hasattr(self.states[name], "load_rank_states"):
                self.states[name].load_rank_states([decode(value[key]) for key in per_rank_keys[name]])  # type: ignore[attr-defined]
            elif name in per_rank_keys:
                restored[name] = decode(value[per_rank_keys[name][0]])
                self.states[name].load_state_dict(restored[name])
            else:
                self.states[name].load_state_dict(value)
        return restored

    def _per_rank_sources(self, path: str, metadata: Metadata, name: str, saved_world_size: int | None,
                          saved_layout: DataLayout | None) -> list[str]:
        """The saved copies of per-rank state ``name`` this rank reads."""
        own = f"rank{self.rank}"
        same_world = saved_world_size == self.world_size
        if hasattr(self.states[name], "load_rank_states"):
            same_dp = saved_layout is None or self.data_layout is None or \
                saved_layout.dp_degree == self.data_layout.dp_degree
            if same_world and same_dp:
                return [own]
            saved_ranks = saved_world_size if saved_world_size is not None else _count_rank_keys(metadata)
            if saved_ranks is None:
                logger.warning("%s does not say how many ranks saved it: %s starts from the beginning", path, name)
                return []
            return [f"rank{r}" for r in range(saved_ranks)]
        if same_world:
            return [own]
        # The step is the same on every rank; RNG streams come from rank 0 where this rank has none.
        return [own if saved_tensor_shape(metadata, f"{name}.{own}") is not None else "rank0"]

    def _agreed_scan(self) -> tuple[list[int], list[int]]:
        found: list[Any] = [scan_steps(self.folder) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def roll_back(self, step: int, *, set_aside_as: str) -> None:
        """Restore every saved state from the complete checkpoint of ``step`` (a run going back to a
        known-good point; collective). Newer checkpoints move to ``<folder>/<set_aside_as>/`` so that a
        restart resumes from the rolled-back run, not the abandoned one; nothing is deleted."""
        self.wait()
        path = step_dir(self.folder, step)
        problems = verify_together(path, checksums=self.config.verify_checksums, rank=self.rank,
                                   world_size=self.world_size)
        marker = Marker.read(path)
        if problems or marker is None:
            raise CheckpointError(f"cannot roll back to {path}: {'; '.join(problems) or 'its marker is gone'}")
        complete, incomplete = self._agreed_scan()
        newer = sorted(s for s in complete + incomplete if s > step)
        start = time.perf_counter()
        self._load_from(path, read_metadata(path), [n for n in self.states if n in marker.states], marker.world_size,
                        DataLayout.from_record(marker.data_layout))
        self._loaded_step, self._last_saved_step = step, None
        self.followups.adopt(marker)
        if self.rank == 0 and newer:
            set_aside(self.folder, newer, set_aside_as)
        if dist.is_initialized():
            dist.barrier()
        logger.info("rolled back to %s in %.1fs%s", path, time.perf_counter() - start,
                    f"; newer checkpoints {newer} moved to {os.path.join(self.folder, set_aside_as)}" if newer else "")

    def rollback_candidates(self) -> list[int]:
        """Complete checkpoints holding the whole training state (not model-only), as rank 0 sees them."""
        complete, _ = self._agreed_scan()
        found: list[Any] = [[s for s in complete if not _model_only(step_dir(self.folder, s))] if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def write_record(self, name: str, record: Any) -> None:
        """Rank 0 writes ``record`` as ``<folder>/<name>.json`` (atomically); facts about the run that must
        outlive it before its next checkpoint."""
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            write_json_atomically(os.path.join(self.folder, f"{name}.json"), record)

    def read_record(self, name: str, default: Any) -> Any:
        """What ``write_record`` stored under ``name`` (rank 0 reads, every rank gets it); ``default``
        when there is none or checkpointing is off."""
        if not self.config.enable:
            return default
        found: list[Any] = [read_json(os.path.join(self.folder, f"{name}.json"), default) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint in this run's folder, ascending."""
        return scan_steps(self.folder)[0] if self.config.enable else []

    def last_complete_step(self) -> int | None:
        """Newest step with a complete checkpoint in this run's folder, None when there is none."""
        if not self.config.enable:
            return None
        complete, _ = scan_steps(self.folder)
        return complete[-1] if complete else None

    # ----------------------------------------------------------------------------------------------
    # Saving

    def due(self, step: int, *, last_step: bool = False, force: bool = False) -> bool:
        """Whether ``save`` with these arguments writes a checkpoint."""
        if not self.config.enable or step == self._last_saved_step:
            return False
        return force or last_step or step % self.config.interval == 0

    def save(self, step: int, *, last_step: bool = False, force: bool = False, model_only: bool = False) -> bool:
        """Save when ``step`` is a multiple of ``interval``, or ``last_step`` / ``force``; collective, called at
        every step (it also concludes a background save that has finished since).

        Returns whether a checkpoint was started. ``model_only`` saves only the model in export_dtype
        (the seed checkpoint); ``last_save_model_only`` applies it to the last step.
        """
        cfg = self.config
        self._poll()
        if not self.due(step, last_step=last_step, force=force):
            return False
        model_only = model_only or (last_step and cfg.last_save_model_only)
        self.wait()
        start = time.perf_counter()
        state = self._state_to_save(model_only)
        path = step_dir(self.folder, step)
        self._prepare_folder(path)
        layout = None if model_only or self.data_layout is None else self.data_layout.to_record()
        marker = new_marker(step, self.world_size, list(state), model_only, layout, self.moe_top_k)
        self.followups.saving(marker)
        no_dist = not dist.is_initialized()
        writer = ChecksummingWriter(path)
        if cfg.async_mode == "async":
            upload = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=self._save_group,
                                    no_dist=no_dist)
            self._pending, self._pending_path = self._then_mark_complete(upload, path, marker, writer), path  # type: ignore[arg-type]  # a Future without async_stager
            logger.info("staged checkpoint %s in %.1fs; writing in the background", path, time.perf_counter() - start)
        else:
            error: BaseException | None = None
            try:
                dcp.save(state, checkpoint_id=path, storage_writer=writer, no_dist=no_dist)
                self._mark_complete(path, marker, writer)
            except (Exception, CheckpointException) as e:
                error = e
            if not self._conclude_save(path, error):
                return False
            logger.info("saved checkpoint %s in %.1fs", path, time.perf_counter() - start)
        if last_step and self.hf_adapter is not None:
            self._export_hf(step)
        self._last_saved_step = step
        return True

    def _state_to_save(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            dtype = EXPORT_DTYPES[self.config.export_dtype]
            model = self.states["model"].state_dict()
            return {"model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}}
        state = {}
        for name, obj in self.states.items():
            if name in PER_RANK_STATES:
                state[name] = {f"rank{self.rank}": encode(obj.state_dict())}
            else:
                state[name] = obj.state_dict()
        return state

    def _prepare_folder(self, path: str) -> None:
        if self.rank == 0 and os.path.exists(path):
            # Re-saving a step (a resumed run that went back): the old folder must not keep its
            # marker while being overwritten, and stale shard files must not linger.
            logger.warning("overwriting existing checkpoint folder %s", path)
            marker = os.path.join(path, MARKER_NAME)
            if os.path.exists(marker):
                os.remove(marker)
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier()

    def _mark_complete(self, path: str, marker: Marker, writer: ChecksummingWriter) -> None:
        if self.rank != 0:
            return
        checksums = dict(writer.checksums or {})
        if self.run_config is not None:
            # Before the marker: a checkpoint is complete with the config that describes it, or not at all.
            write_text_atomically(os.path.join(path, RUN_CONFIG_NAME), self.run_config)
            checksums[RUN_CONFIG_NAME] = hash_file(os.path.join(path, RUN_CONFIG_NAME))
        marker.checksum_algorithm, marker.checksums = ALGORITHM, checksums
        # A normal loss may have followed this state while it was written.
        self.followups.write_marker(path, marker)
        protected = {marker.step} | ({self._loaded_step} if self._loaded_step is not None else set())
        good = [s for s in scan_steps(self.folder)[0] if s in self.known_good]
        protected |= {max(good)} if good else set()
        purge_old(self.folder, self.config.keep_latest_k, protected)

    def _then_mark_complete(self, upload: Future, path: str, marker: Marker, writer: ChecksummingWriter) -> Future:
        done: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()
                self._mark_complete(path, marker, writer)
                done.set_result(marker.step)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        upload.add_done_callback(finish)
        return done

    def _poll(self) -> None:
        """Conclude a background save as soon as it has finished on every rank (collective, called at every
        step, does not block): a failed one stops the run (or warns) at the step it is noticed, not at the
        next save, and its partial folder is removed at once."""
        if self._pending is None:
            return
        done = self._pending.done()
        if self._poll_group is not None and self.world_size > 1:
            finished = torch.tensor([int(done)])
            dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=self._poll_group)
            done = bool(finished.item())
        if done:
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished and its marker is written."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        error: BaseException | None = None
        try:
            pending.result()
        except (Exception, CheckpointException) as e:
            error = e
        assert self._pending_path is not None
        self._conclude_save(self._pending_path, error)

    def _conclude_save(self, path: str, error: BaseException | None) -> bool:
        """Collective: whether the save of ``path`` succeeded on every rank. On a failure anywhere, rank 0
        removes the partial folder and every rank stops (raises) or warns, per ``on_save_error``."""
        reason = None if error is None else describe_save_error(self.folder, error, describe_failure(error))
        reasons = [reason]
        if dist.is_initialized() and self.world_size > 1:
            reasons = [None] * self.world_size
            dist.all_gather_object(reasons, reason)
        failed = [r for r in reasons if r is not None]
        if not failed:
            return True
        if self.rank == 0:
            marker = os.path.join(path, MARKER_NAME)
            if os.path.exists(marker):
                os.remove(marker)
            shutil.rmtree(path, ignore_errors=True)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()  # every rank then describes the folder without the partial save
        complete = scan_steps(self.folder)[0]
        kept = (f"the previous complete checkpoint {step_dir(self.folder, complete[-1])} is kept" if complete
                else f"there is no complete checkpoint in {self.folder}")
        message = f"saving checkpoint {path} failed: {failed[0]}. The partial folder was removed; {kept}"
        if self.config.on_save_error == "stop":
            resume = (f"the run resumes from step {complete[-1]}" if complete
                      else "the run starts again from step 0, nothing was saved")
            raise CheckpointError(f"{message}. Free space or fix the folder, then rerun: {resume} "
                                  f"(checkpoint.on_save_error=warn trains on without checkpoints instead)") from error
        logger.warning("%s; training continues (checkpoint.on_save_error=warn)", message)
        return False

    def check_storage(self) -> None:
        """Before training: the checkpoint folder is writable and has room for one checkpoint (rank 0
        checks, every rank gets the verdict)."""
        if not self.config.enable:
            return
        # Every rank writes its part into the same folder; under a pipeline each holds only its stage's layers.
        own = expected_checkpoint_sizes({n: s for n, s in self.states.items() if n not in PER_RANK_STATES})
        sizes: list[Any] = [own]
        if dist.is_initialized() and self.world_size > 1:
            sizes = [None] * self.world_size
            dist.all_gather_object(sizes, own)
        expected = whole_checkpoint_bytes(sizes)
        verdict = [check_writable_with_space(self.folder, expected) if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
        if problem is None:
            return
        if self.config.on_save_error == "stop" or problem.startswith("cannot write"):
            raise CheckpointError(f"{problem} (checked before training, checkpoint.on_save_error=stop)")
        logger.warning("%s; training anyway (checkpoint.on_save_error=warn)", problem)

    def _export_hf(self, step: int) -> None:
        run_config = self.run_config

        def add_config(folder: str) -> None:
            if run_config is not None:
                write_text_atomically(os.path.join(folder, RUN_CONFIG_NAME), run_config)

        state = self.states["model"].state_dict()
        saved = read_metadata(step_dir(self.folder, step)) if self._wait_for(step) else None
        if saved is not None and not {f"model.{k}" for k in state} >= set(hf_io.model_keys(saved)):
            # Pipeline stages: no rank holds the whole model, the checkpoint just written does.
            state = hf_io.load_dcp_model(step_dir(self.folder, step), saved) if self.rank == 0 else {}
        hf_io.export_model_state(state, hf_export_dir(self.folder, step), self.hf_adapter,
                                 EXPORT_DTYPES[self.config.export_dtype], write=self.rank == 0, extra=add_config)

    def _wait_for(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is complete once a background save has finished (collective)."""
        self.wait()
        return step in self._agreed_scan()[0]

    def close(self) -> None:
        """Wait for a background save; call once at the end of training (also after a seed save)."""
        self.wait()
        for group in (self._save_group, self._poll_group):
            if group is not None:
                dist.destroy_process_group(group)
        self._save_group = self._poll_group = None


def _model_only(path: str) -> bool:
    marker = Marker.read(path)
    return marker is None or marker.model_only


def _count_rank_keys(metadata: Metadata) -> int | None:
    ranks = [k for k in metadata.state_dict_metadata if k.startswith("train_state.rank")]
    return len(ranks) or None


def _without_absent_optional_keys(name: str, state: Any, metadata: Metadata) -> dict[str, Any]:
    """``state``'s state_dict without the keys it declares optional (``OPTIONAL_STATE_KEYS``: added after
    earlier releases wrote their checkpoints) that the checkpoint lacks, so such a checkpoint still resumes."""
    state_dict = state.state_dict()
    saved = metadata.state_dict_metadata
    for key in getattr(state, "OPTIONAL_STATE_KEYS", ()):
        if key in state_dict and f"{name}.{key}" not in saved:
            logger.info("checkpoint has no %s.%s (written by an earlier release): it starts fresh", name, key)
            del state_dict[key]
    return state_dict
