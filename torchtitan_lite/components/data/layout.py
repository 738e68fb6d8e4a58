"""How a run feeds its data, recorded in every checkpoint and compared when a run resumes from one.

Every checkpoint's marker holds the ``DataLayout`` it was trained with (JSON, readable without loading
anything else), so ``--check-config`` can tell before launch what a resume changes: a random-access
source's position is a count of windows read in one global order, valid on any data-parallel degree; a
stream's is each rank's own reader, valid on the same degree only; a new global batch changes the
optimisation. ``resume_changes`` is the one place that judges it, for the check and for the trainer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

RESUME_REPORTED_ENV = "TORCHTITAN_LITE_RESUME_REPORTED"
"""Set by run_train.sh for its workers: its check before launch has printed what resuming changes, so the
trainer does not print the same notes and warnings again when it loads the checkpoint."""


@dataclass(frozen=True)
class DataLayout:
    dp_degree: int
    local_batch_size: int
    n_microbatches: int
    seq_len: int
    dataset: str
    streaming: bool
    position: str = "windows"
    """How the data position counts: 'windows' (windows of the global order read, any layout), 'stream' (each
    rank's stream reader), 'documents' (the per-rank document order of earlier versions, whose records have no
    such field)."""

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.local_batch_size * self.dp_degree * self.n_microbatches

    def describe(self) -> str:
        return (f"{self.global_batch_size} = local {self.local_batch_size} x data-parallel {self.dp_degree} x "
                f"{self.n_microbatches} micro-batch(es)")

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_record(record: dict[str, Any] | None) -> DataLayout | None:
        return None if record is None else DataLayout(**({"position": "documents"} | record))


def resume_changes(saved: DataLayout | None, now: DataLayout, *, step: int, data_loaded: bool,
                   global_batch_set: bool) -> tuple[list[str], list[str]]:
    """(notes, warnings) about resuming the checkpoint of ``step``, saved with ``saved``, as ``now``; a
    ValueError when its data position cannot continue in this run. ``data_loaded``: the checkpoint holds a
    data position and this run restores it. ``saved`` None: written before layouts were recorded."""
    notes: list[str] = []
    warnings: list[str] = []
    if saved is None:
        if data_loaded:
            raise ValueError(
                f"the data position of the checkpoint of step {step} was written by an earlier version of the data "
                f"loader (its positions name other documents now); resume with --checkpoint.exclude_from_loading "
                f"dataloader to start the data from the beginning")
        return notes, warnings
    if data_loaded:
        _check_position_applies(saved, now, step)
        if saved.dp_degree != now.dp_degree:
            notes.append(
                f"the data position of step {step} continues from {saved.dp_degree} on {now.dp_degree} data-parallel "
                f"rank(s): it counts the windows of the global order read so far, so every window is read once, "
                f"none twice (README, 'Resuming with another layout')")
    if saved.global_batch_size != now.global_batch_size:
        keep = "" if global_batch_set else f"; {keep_global_batch(saved.global_batch_size, now)}"
        warnings.append(f"the global batch changes on resume from step {step}: saved {saved.describe()}, now "
                        f"{now.describe()}{keep}")
    elif saved.n_microbatches != now.n_microbatches or saved.dp_degree != now.dp_degree:
        notes.append(f"global batch {now.global_batch_size} kept from step {step}: was {saved.describe()}, now "
                     f"{now.describe()}")
    return notes, warnings


def keep_global_batch(global_batch: int, now: DataLayout) -> str:
    """How ``now`` keeps ``global_batch`` sequences per step: options that pass the run's rule (a multiple of
    local batch x data-parallel degree), lowering the local batch when the current one does not divide it."""
    dp, local = now.dp_degree, now.local_batch_size
    if global_batch % (local * dp) == 0:
        return (f"set --training.global_batch_size {global_batch} to keep it (the micro-batches per step adjust to "
                f"the data-parallel degree)")
    if global_batch % dp == 0:
        per_rank = global_batch // dp
        fitting = max(d for d in range(1, min(local, per_rank) + 1) if per_rank % d == 0)
        return (f"set --training.global_batch_size {global_batch} --training.local_batch_size {fitting} to keep it "
                f"(local {fitting} x data-parallel {dp} x {per_rank // fitting} micro-batch(es); local {local} x "
                f"data-parallel {dp} does not divide {global_batch})")
    nearest = max(local * dp, round(global_batch / (local * dp)) * local * dp)
    return (f"{global_batch} sequences cannot be split over {dp} data-parallel ranks; resume on a data-parallel "
            f"degree that divides {global_batch}, or set --training.global_batch_size {nearest} (the nearest "
            f"multiple of local {local} x data-parallel {dp})")


def reshard_refusal(saved_dp: int, dp: int) -> str:
    """Why a streaming data position cannot move from ``saved_dp`` to ``dp`` data-parallel ranks."""
    return (f"the checkpoint's data position was saved by {saved_dp} data-parallel rank(s) reading a streaming "
            f"dataset (data.streaming=true), this run has {dp}: a stream's position is the state of each rank's own "
            f"shard reader and does not reshard. Resume with a data-parallel degree of {saved_dp} (parallelism."
            f"dp_shard x dp_replicate), read the data map-style (data.streaming=false) from the start, or start "
            f"the data from the beginning with --checkpoint.exclude_from_loading dataloader")


_OPTIONS = {"dataset": "data.dataset", "seq_len": "training.seq_len", "streaming": "data.streaming"}


def _check_position_applies(saved: DataLayout, now: DataLayout, step: int) -> None:
    """The refusals the data loader would make after the model build, made from the layouts alone."""
    for key, option in _OPTIONS.items():
        if getattr(saved, key) != getattr(now, key):
            raise ValueError(f"the data position of the checkpoint of step {step} was saved with {option}="
                             f"{getattr(saved, key)!r}, this run has {getattr(now, key)!r}: a position is only valid "
                             f"for the same data and seq_len. Restore it; start a new run in another folder with "
                             f"--job.dump_folder DIR; or keep the folder's weights and start the data from the "
                             f"beginning with --checkpoint.exclude_from_loading dataloader")
    if saved.position == "documents" and not saved.streaming:
        raise ValueError(
            f"the data position of the checkpoint of step {step} counts documents read per rank, as an earlier "
            f"version of the data loader did; the loader now reads windows of a token store in one global order, "
            f"which that position does not name. Resume with --checkpoint.exclude_from_loading dataloader to start "
            f"the data from the beginning (the weights and optimizer still load)")
    if saved.streaming and saved.dp_degree != now.dp_degree:
        raise ValueError(f"step {step}: {reshard_refusal(saved.dp_degree, now.dp_degree)}")
