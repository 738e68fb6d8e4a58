"""torch.profiler traces and CUDA memory snapshots every ``profile_freq`` steps.

Used as a context manager around the loop, with ``step()`` called once per training step::

    with config.profiling.build(dump_folder=..., start_step=step) as profiler:
        for ...:
            train_step()
            profiler.step()

Every ``profile_freq`` steps, the last ``active`` steps before the multiple are recorded after
``warmup`` steps of profiler warm-up, and written as a Chrome trace (open in Perfetto or
chrome://tracing) to ``<dump_folder>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json``. With
memory snapshots on, the CUDA caching allocator's history is dumped at the same steps next to it as
``rank<R>_memory_snapshot.pickle`` (open in https://pytorch.org/memory_viz), and once more as
``iteration_<N>_exit`` when the loop dies of an out-of-memory error.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from types import TracebackType

import torch

from torchtitan_lite.config import Configurable
from torchtitan_lite.mesh import process_groups as dist_utils

logger = logging.getLogger("torchtitan_lite")

# Allocation events the CUDA allocator remembers for a snapshot (a ring buffer; about 100 MB of host RAM).
_MEMORY_HISTORY_ENTRIES = 100_000


class Profiler(Configurable):
    """Periodic torch.profiler traces and CUDA memory snapshots; a no-op when both are off."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        enable_profiling: bool = False
        """Record torch.profiler traces (CPU ops, and CUDA kernels on GPU) every profile_freq steps."""
        profile_freq: int = 100
        """Steps between traces (and memory snapshots)."""
        save_traces_folder: str = "profiles"
        """Folder under the dump folder for traces and snapshots."""
        warmup: int = 3
        """Profiler warm-up steps before each recorded window (their overhead is not in the trace)."""
        active: int = 1
        """Steps recorded in each trace."""
        enable_memory_snapshot: bool = False
        """Dump CUDA caching-allocator snapshots every profile_freq steps and on OOM (CUDA only; on
        CPU it logs that nothing is recorded)."""

        def __post_init__(self) -> None:
            if self.profile_freq < 1:
                raise ValueError(f"profiling.profile_freq must be >= 1, got {self.profile_freq}")
            if self.warmup < 0 or self.active < 1:
                raise ValueError(
                    f"profiling.warmup must be >= 0 and profiling.active >= 1, got warmup={self.warmup}, "
                    f"active={self.active}"
                )
            if self.warmup + self.active > self.profile_freq:
                raise ValueError(
                    f"profiling.warmup + profiling.active = {self.warmup} + {self.active} must fit in "
                    f"profiling.profile_freq={self.profile_freq}; raise profile_freq or lower warmup/active"
                )
            if not self.save_traces_folder:
                raise ValueError("profiling.save_traces_folder must be a folder name, got an empty string")

    config: Profiler.Config

    def __init__(
        self, config: Profiler.Config, *, dump_folder: str, start_step: int = 0, rank: int | None = None
    ) -> None:
        """
        Args:
            start_step: training steps already done (a resumed run), so traces stay on multiples of
                profile_freq.
            rank: this process's rank, used in file names (default: from the process group).
        """
        self.config = config
        self.folder = os.path.join(dump_folder, config.save_traces_folder)
        self.start_step = start_step
        self.step_num = start_step
        self.rank = dist_utils.rank() if rank is None else rank
        self.cuda = dist_utils.device_type() == "cuda"
        self._torch_profiler: torch.profiler.profile | None = None
        self._recording_memory = False

    def __enter__(self) -> Profiler:
        cfg = self.config
        if cfg.enable_profiling:
            self._torch_profiler = self._start_torch_profiler()
        if cfg.enable_memory_snapshot:
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
                self._recording_memory = True
                logger.info("recording CUDA memory history for snapshots every %d steps", cfg.profile_freq)
            else:
                logger.info("profiling.enable_memory_snapshot: memory snapshots are a CUDA allocator feature; "
                            "nothing is recorded on CPU")
        return self

    def step(self) -> None:
        """Call once after every training step."""
        self.step_num += 1
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self._recording_memory and self.step_num % self.config.profile_freq == 0:
            self._dump_memory_snapshot(f"iteration_{self.step_num}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
        if self._recording_memory:
            if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
                self._dump_memory_snapshot(f"iteration_{self.step_num}_exit")
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False

    # ----------------------------------------------------------------------------------------------

    def _start_torch_profiler(self) -> torch.profiler.profile:
        cfg = self.config
        cycle = torch.profiler.schedule(wait=cfg.profile_freq - cfg.warmup - cfg.active, warmup=cfg.warmup,
                                        active=cfg.active)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            # The profiler counts from 0 at start; offsetting keeps windows on multiples of profile_freq.
            schedule=lambda n: cycle(n + self.start_step),
            on_trace_ready=self._write_trace,
            record_shapes=True,
        )
        profiler.start()
        logger.info("profiling %d step(s) every %d steps into %s", cfg.active, cfg.profile_freq, self.folder)
        return profiler

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        folder = os.path.join(self.folder, f"iteration_{self.start_step + profiler.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        start = time.perf_counter()
        profiler.export_chrome_trace(path)
        logger.info("profiler trace written to %s in %.1fs", path, time.perf_counter() - start)

    def _dump_memory_snapshot(self, name: str) -> None:
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info("CUDA memory snapshot written to %s", path)
