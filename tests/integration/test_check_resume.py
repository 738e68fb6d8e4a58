"""--check-config reports what resuming the run folder's checkpoint changes in the data layout, and
run_train.sh refuses a position that cannot continue before torchrun starts, leaving the folder as it was."""
from __future__ import annotations

import os

import pytest
from _cli import TINY

from torchtitan_lite.components.checkpoint.layout import new_marker, step_dir
from torchtitan_lite.components.data.layout import DataLayout

FSDP2 = DataLayout(dp_degree=2, local_batch_size=2, n_microbatches=1, seq_len=32, dataset="embedded", streaming=False)
ARGS = ["--training.local_batch_size", "2", "--training.seq_len", "32", "--checkpoint.enable", "true",
        "--parallelism.tp", "2"]


def _folder_with_checkpoint(tmp_path, layout: DataLayout) -> str:
    path = step_dir(str(tmp_path / "checkpoint"), 20)
    os.makedirs(path)
    new_marker(20, 2, ["dataloader", "model", "optimizer"], False, layout.to_record()).write(path)
    return str(tmp_path)


def _snapshot(folder: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.join(root, name)] = f.read()
    return files


def test_check_config_reports_the_reshard_and_the_global_batch_change(cli, tmp_path):
    folder = _folder_with_checkpoint(tmp_path, FSDP2)
    result = cli([*ARGS, "--job.dump_folder", folder, "--check-config"], NPROC="2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "note: the data position of step 20 reshards from 2 to 1 data-parallel rank(s)" in result.stdout
    assert ("warning: the global batch changes on resume from step 20: saved 4 = local 2 x data-parallel 2 x 1 "
            "micro-batch(es), now 2 = local 2 x data-parallel 1 x 1 micro-batch(es); set "
            "--training.global_batch_size 4 to keep it") in result.stdout
    assert lines[0].startswith("config 'llama3_debug' is valid for 2 process(es) (TP 2)")


def test_a_streaming_position_on_another_degree_is_refused_before_torchrun(cli, tmp_path):
    folder = _folder_with_checkpoint(tmp_path, DataLayout(**(FSDP2.to_record() | {"streaming": True})))
    before = _snapshot(folder)
    result = cli([*ARGS, "--data.streaming", "true", "--data.shuffle", "false", "--job.dump_folder", folder],
                 NPROC="2")
    assert result.returncode == 2
    assert ("error: step 20: the checkpoint's data position was saved by 2 data-parallel rank(s) reading a "
            "streaming dataset (data.streaming=true), this run has 1") in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started
    assert _snapshot(folder) == before


@pytest.mark.slow
def test_a_resume_through_run_train_says_each_change_once(cli, tmp_path):
    # The check before torchrun prints what the resume changes; the workers, loading the checkpoint, do not
    # print it a second time.
    run = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    first = cli([*run, "--training.steps", "2"])
    assert first.returncode == 0, first.stderr
    resumed = cli([*run, "--training.steps", "3"], NPROC="2")
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stdout + resumed.stderr
    assert said.count("the data position of step 2 reshards from 1 to 2 data-parallel rank(s)") == 1, said
    assert said.count("the global batch changes on resume from step 2") == 1, said

