"""Saves and restores the whole training state with torch.distributed.checkpoint (DCP).

Each checkpoint is ``<dump_folder>/<folder>/step-<N>/``: every rank writes its shards, DCP's
coordinator (rank 0) writes ``.metadata`` once all ranks reported their writes, and only then rank 0
writes the ``.complete`` marker. DCP's final gather is the barrier that makes this safe: rank 0 gets
past ``dcp.save`` (or its async future resolves) only after every rank finished writing. Loading
considers only folders with the marker; rank 0 scans the folder and broadcasts what it found, so all
ranks load the same step even on filesystems with lagging metadata caches.

The manager decides when to save and what to resume from; the work is done by ``saving.py`` (writing a
checkpoint, background saves, a failed save), ``resume.py`` (which checkpoint, verified, a run resumes
from), ``loading.py`` (restoring states, resharded, per rank) and ``disk.py`` (room before training). The
marker records the run's data layout (``components/data/layout.py``), readable before launch.

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
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.components.checkpoint.checksums import ChecksummingWriter
from torchtitan_lite.components.checkpoint.disk import check_storage_before_training
from torchtitan_lite.components.checkpoint.followups import Followups
from torchtitan_lite.components.checkpoint.layout import (
    ABNORMAL,
    NORMAL,
    Marker,
    check_same_top_k,
    describe_steps,
    new_marker,
    purge_old,
    read_json,
    scan_steps,
    set_aside,
    step_dir,
    write_json_atomically,
)
from torchtitan_lite.components.checkpoint.loading import count_rank_keys, load_states
from torchtitan_lite.components.checkpoint.resume import LoadedCheckpoint, initial_weights_passed_over, step_to_resume
from torchtitan_lite.components.checkpoint.saving import (
    EXPORT_DTYPES as EXPORT_DTYPES,  # re-exported: convert.py imports it from the manager
)
from torchtitan_lite.components.checkpoint.saving import (
    BackgroundSave,
    conclude_save,
    export_hf,
    mark_complete,
    prepare_folder,
    state_to_save,
)
from torchtitan_lite.components.checkpoint.verify import CheckpointError, read_metadata, saved_state_names, verify_together
from torchtitan_lite.components.data.layout import DataLayout
from torchtitan_lite.config import Configurable
from torchtitan_lite.mesh import process_groups as dist_utils

logger = logging.getLogger(__name__)
# A run without a process group is a normal single-process run here, not a mistake worth a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
        self._background = BackgroundSave(enabled=config.enable and config.async_mode == "async",
                                          world_size=self.world_size)
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
        step = step_to_resume(self.folder, complete, incomplete, load_step=cfg.load_step,
                              verify_checksums=cfg.verify_checksums, rank=self.rank, world_size=self.world_size)
        if step is None:
            if cfg.initial_load_path is not None:
                return self._initial_load(cfg.initial_load_path)
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
        saved_world = marker.world_size if marker else count_rank_keys(metadata)
        restored = self._load_from(path, metadata, names, saved_world,
                                   DataLayout.from_record(marker.data_layout) if marker else None)
        logger.info("initialised %s from %s", names, path)
        step = int(restored["train_state"]["step"]) if "train_state" in restored else 0
        self._adopt(path, step, marker)
        return step

    def _load_from(self, path: str, metadata: Metadata, names: list[str], saved_world_size: int | None,
                   saved_layout: DataLayout | None = None) -> dict[str, Any]:
        return load_states(path, metadata, names, saved_world_size, saved_layout, states=self.states, rank=self.rank,
                           world_size=self.world_size, data_layout=self.data_layout)

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
        state = state_to_save(self.states, model_only, export_dtype=cfg.export_dtype, rank=self.rank)
        path = step_dir(self.folder, step)
        prepare_folder(path, self.rank)
        layout = None if model_only or self.data_layout is None else self.data_layout.to_record()
        marker = new_marker(step, self.world_size, list(state), model_only, layout, self.moe_top_k)
        self.followups.saving(marker)
        no_dist = not dist.is_initialized()
        writer = ChecksummingWriter(path)
        if cfg.async_mode == "async":
            upload = dcp.async_save(state, checkpoint_id=path, storage_writer=writer,
                                    process_group=self._background.save_group, no_dist=no_dist)
            self._background.start(upload, path, marker, lambda: self._mark_complete(path, marker, writer))  # type: ignore[arg-type]  # a Future without async_stager
            logger.info("staged checkpoint %s in %.1fs; writing in the background", path, time.perf_counter() - start)
        else:
            error: BaseException | None = None
            try:
                dcp.save(state, checkpoint_id=path, storage_writer=writer, no_dist=no_dist)
                self._mark_complete(path, marker, writer)
            except (Exception, CheckpointException) as e:
                error = e
            if not conclude_save(self.folder, path, error, rank=self.rank, world_size=self.world_size,
                                 on_save_error=cfg.on_save_error):
                return False
            logger.info("saved checkpoint %s in %.1fs", path, time.perf_counter() - start)
        if last_step and self.hf_adapter is not None:
            export_hf(self.states["model"].state_dict(), self.folder, step, self.hf_adapter, written=self._wait_for(step),
                      export_dtype=cfg.export_dtype, run_config=self.run_config, rank=self.rank)
        self._last_saved_step = step
        return True

    def _mark_complete(self, path: str, marker: Marker, writer: ChecksummingWriter) -> None:
        if self.rank != 0:
            return
        mark_complete(path, marker, writer, run_config=self.run_config, followups=self.followups)
        protected = {marker.step} | ({self._loaded_step} if self._loaded_step is not None else set())
        good = [s for s in scan_steps(self.folder)[0] if s in self.known_good]
        protected |= {max(good)} if good else set()
        purge_old(self.folder, self.config.keep_latest_k, protected)

    def _poll(self) -> None:
        """Conclude a background save as soon as it has finished on every rank (collective, called at every
        step, does not block): a failed one stops the run (or warns) at the step it is noticed, not at the
        next save, and its partial folder is removed at once."""
        if self._background.finished_on_every_rank():
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished and its marker is written."""
        finished = self._background.outcome()
        if finished is not None:
            path, error = finished
            conclude_save(self.folder, path, error, rank=self.rank, world_size=self.world_size,
                          on_save_error=self.config.on_save_error)

    def check_storage(self) -> None:
        """Before training: the checkpoint folder is writable and has room for one checkpoint (rank 0
        checks, every rank gets the verdict)."""
        if not self.config.enable:
            return
        check_storage_before_training(self.folder, self.states, rank=self.rank, world_size=self.world_size,
                                      on_save_error=self.config.on_save_error)

    def _wait_for(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is complete once a background save has finished (collective)."""
        self.wait()
        return step in self._agreed_scan()[0]

    def close(self) -> None:
        """Wait for a background save; call once at the end of training (also after a seed save)."""
        self.wait()
        self._background.close()


def _model_only(path: str) -> bool:
    marker = Marker.read(path)
    return marker is None or marker.model_only
