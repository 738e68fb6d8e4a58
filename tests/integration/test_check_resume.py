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
    if os.path.isfile(folder):
        with open(folder, "rb") as f:
            return {folder: f.read()}
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.join(root, name)] = f.read()
    return files


def test_check_config_reports_the_new_degree_and_the_global_batch_change(cli, tmp_path):
    folder = _folder_with_checkpoint(tmp_path, FSDP2)
    result = cli([*ARGS, "--job.dump_folder", folder, "--check-config"], NPROC="2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "note: the data position of step 20 continues from 2 on 1 data-parallel rank(s)" in result.stdout
    assert ("warning: the global batch changes on resume from step 20: saved 4 = local 2 x data-parallel 2 x 1 "
            "micro-batch(es), now 2 = local 2 x data-parallel 1 x 1 micro-batch(es); set "
            "--training.global_batch_size 4 to keep it") in result.stdout
    assert lines[0].startswith("config 'llama3_debug' is valid for 2 process(es) (TP 2)")


def test_a_streaming_position_on_another_degree_is_refused_before_torchrun(cli, tmp_path):
    folder = _folder_with_checkpoint(tmp_path, DataLayout(**(FSDP2.to_record() | {"streaming": True})))
    before = _snapshot(folder)
    result = cli([*ARGS, "--data.streaming", "true", "--data.shuffle", "none", "--job.dump_folder", folder],
                 NPROC="2")
    assert result.returncode == 2
    assert ("error: step 20: the checkpoint's data position was saved by 2 data-parallel rank(s) reading a "
            "streaming dataset (data.streaming=true), this run has 1") in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started
    assert _snapshot(folder) == before


def test_a_run_shorter_than_its_checkpoint_is_refused_before_torchrun_changing_no_file(cli, tmp_path):
    # Resuming step 20 with training.steps 8 would train nothing and exit 0, rewriting config.toml.
    folder = _folder_with_checkpoint(tmp_path, FSDP2)
    (tmp_path / "config.toml").write_text("# the run that wrote step 20\n")
    before = _snapshot(folder)
    result = cli([*ARGS, "--training.steps", "8", "--job.dump_folder", folder], NPROC="2")
    assert result.returncode == 2, result.stderr
    assert (f"error: the checkpoint in {folder}/checkpoint is at step 20, beyond training.steps=8: resuming it "
            f"would train nothing. Set --training.steps above 20 to train on, --checkpoint.load_step to an earlier "
            f"step, or give a new run its own --job.dump_folder") in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started
    assert _snapshot(folder) == before


def test_a_moe_checkpoint_of_another_top_k_is_refused_before_torchrun_changing_no_file(cli, tmp_path):
    # qwen3_moe_debug routes each token to 2 experts; the checkpoint says it was trained with 1. Every tensor
    # has the same shape under both, so only the marker's record can tell.
    path = step_dir(str(tmp_path / "checkpoint"), 20)
    os.makedirs(path)
    new_marker(20, 1, ["model", "optimizer"], False, moe_top_k=1).write(path)
    before = _snapshot(str(tmp_path))
    result = cli(["--config", "qwen3_moe_debug", "--checkpoint.enable", "true", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 2, result.stderr
    assert (f"error: {path} was trained with MoE top_k=1 (routed experts per token), this run has top_k=2: top_k "
            f"changes what the model computes") in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started
    assert _snapshot(str(tmp_path)) == before


def test_a_direct_launch_shorter_than_its_checkpoint_is_refused_before_config_toml_is_written(cli, tmp_path):
    # train.py without run_train.sh's check: the trainer refuses once it knows the step it resumes.
    from _cli import TINY

    args = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.cpu_peak_tflops", "1",
            "--job.dump_folder", str(tmp_path)]
    assert cli([*args, "--training.steps", "2"], launcher="train.py").returncode == 0
    config, checkpoints = _snapshot(str(tmp_path / "config.toml")), _snapshot(str(tmp_path / "checkpoint"))
    result = cli([*args, "--training.steps", "1"], launcher="train.py")
    assert result.returncode == 1
    assert (f"the checkpoint in {tmp_path / 'checkpoint'} is at step 2, beyond training.steps=1: resuming it would "
            f"train nothing") in result.stdout
    assert _snapshot(str(tmp_path / "checkpoint")) == checkpoints
    assert (tmp_path / "config.toml").read_bytes() == next(iter(config.values()), b"")


def _folder_with_llama3_checkpoint(tmp_path) -> str:
    """A folder as the default run leaves it, as far as the checks read it: step-200 with its config.toml
    and marker (the embedded corpus on 1 process)."""
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
    from torchtitan_lite.config import config_to_toml, parse_cli

    config = parse_cli(["--job.dump_folder", str(tmp_path)], registry=DEFAULT_REGISTRY).config
    path = step_dir(str(tmp_path / "checkpoint"), 200)
    os.makedirs(path)
    with open(os.path.join(path, RUN_CONFIG_NAME), "w") as f:
        f.write(config_to_toml(config))
    layout = DataLayout(dp_degree=1, local_batch_size=16, n_microbatches=1, seq_len=128, dataset="embedded",
                        streaming=False)
    new_marker(200, 1, ["dataloader", "model", "optimizer"], False, layout.to_record()).write(path)
    return str(tmp_path)


def test_another_model_on_two_processes_is_refused_before_torchrun_naming_the_folders_model(cli, tmp_path):
    folder = _folder_with_llama3_checkpoint(tmp_path)
    before = _snapshot(folder)
    args = ["--config", "qwen3_moe_debug", "--parallelism.dp_shard", "2", "--job.dump_folder", folder]
    checked = cli([*args, "--check-config"], NPROC="2")
    launched = cli(args, NPROC="2")
    for result in (checked, launched):
        assert result.returncode == 2, result.stdout + result.stderr
        assert (f"error: job.dump_folder={folder} holds the checkpoint of step 200, written by llama3 flavor 'debug' "
                f"(recorded in {folder}/checkpoint/step-200/config.toml); this run builds qwen3_moe flavor 'debug', "
                f"which cannot load its weights. Start this run in another folder with --job.dump_folder DIR"
                ) in result.stderr
        assert "data position" not in result.stdout + result.stderr
        assert "exclude_from_loading" not in result.stderr
    assert "torch.distributed.run" not in launched.stderr  # torchrun never started
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
    assert said.count("the data position of step 2 continues from 1 on 2 data-parallel rank(s)") == 1, said
    assert said.count("the global batch changes on resume from step 2") == 1, said

