"""Exact resume: a run restarted from its step-10 checkpoint continues exactly as if never stopped.

Run A trains 20 steps and saves at 10 and 20. Run B starts in a fresh folder holding only A's
step-10 checkpoint and trains to 20. B's per-step losses and gradient norms must equal A's, and the
two step-20 checkpoints must hold the same model, optimizer, LR schedule, data loader position and
RNG states: the data order after resume is the same because the loader's position is equal at the
end and every loss in between is equal.

Losses are read from TensorBoard, which stores float32; both runs go through the same float32
rounding, so equal float32 values still show that the underlying losses agree to float32 precision
(the training itself runs in fp32, so that is all the precision there is).
"""
from __future__ import annotations

import shutil

import pytest
from _cli import TINY, Launch, differences, read_checkpoint, read_scalars, train_cmd

STEPS, SAVE_AT = 20, 10


def _args(folder) -> list[str]:
    return ["--config", "llama3_debug", *TINY, "--training.steps", str(STEPS), "--checkpoint.enable", "true",
            "--checkpoint.interval", str(SAVE_AT), "--job.dump_folder", str(folder)]


def _train(folder, nproc: int | None, extra: list[str]) -> str:
    launch = Launch(train_cmd(_args(folder) + extra, nproc=nproc))
    rc = launch.finish()
    assert rc == 0, launch.output[-4000:]
    return launch.output


def _run_a_then_b(tmp_path, nproc: int | None, extra: list[str]):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, nproc, extra)
    shutil.copytree(a / "checkpoint" / f"step-{SAVE_AT}", b / "checkpoint" / f"step-{SAVE_AT}")
    out_b = _train(b, nproc, extra)
    assert f"resumed from {b / 'checkpoint' / f'step-{SAVE_AT}'}" in out_b
    assert f"training {STEPS} steps from step {SAVE_AT}" in out_b
    return a, b


# Bitwise (tolerance 0) in both layouts. One process: every operation repeats in the same order on
# the same data. FSDP 2: the gradient reduce-scatter and the loss / token-count all-reduces add the
# two ranks' values in a fixed order, so the sharded run is just as deterministic; the acceptance bound
# of 1e-6 is not needed. debug.deterministic keeps GPU kernels with atomic adds (embedding backward)
# out of the picture when the suite runs on CUDA.
@pytest.mark.parametrize(
    ("nproc", "extra"),
    [pytest.param(None, [], id="1proc-fp32"), pytest.param(2, ["--parallelism.dp_shard", "2"], id="fsdp2")],
)
def test_resumed_run_repeats_the_uninterrupted_one_bitwise(tmp_path, nproc, extra):
    a, b = _run_a_then_b(tmp_path, nproc, ["--debug.deterministic", "true", *extra])

    tb_a, tb_b = read_scalars(a / "tb"), read_scalars(b / "tb")
    resumed = list(range(SAVE_AT + 1, STEPS + 1))
    assert sorted(tb_b["train/loss"]) == resumed
    for tag in ("train/loss", "train/grad_norm", "train/lr"):
        gaps = {s: tb_a[tag][s] - tb_b[tag][s] for s in resumed}
        assert all(g == 0 for g in gaps.values()), f"{tag}: A-B gaps per step {gaps}"

    final_a = read_checkpoint(a / "checkpoint" / f"step-{STEPS}")
    final_b = read_checkpoint(b / "checkpoint" / f"step-{STEPS}")
    ranks = 1 if nproc is None else nproc
    for r in range(ranks):
        assert final_a[f"train_state.rank{r}.step"] == STEPS
        assert final_a[f"dataloader.rank{r}.consumed"] == final_b[f"dataloader.rank{r}.consumed"] == STEPS * 2 * ranks
    # Model, optimizer moments, LR schedule, data positions and RNG states of every rank.
    assert differences(final_a, final_b) == []
