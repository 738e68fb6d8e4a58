"""A folder holding another model's checkpoint is refused before launch, naming the model that wrote it and
--job.dump_folder; a seed checkpoint written over a later run warns. The checkpoints are fabricated: the
checks read only a step's config.toml, its marker and its DCP metadata."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.components.checkpoint.layout import new_marker, step_dir
from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
from torchtitan_lite.config import config_to_toml, parse_cli
from torchtitan_lite.launch_check import check_resume, check_resumed_model
from torchtitan_lite.resolved_run import resolve_run


def _config(*argv: str):
    return parse_cli(list(argv), registry=DEFAULT_REGISTRY).config


def _write_checkpoint(folder, step: int, *argv: str, embedding_rows: int | None = None, model_only=False) -> str:
    """``folder``/checkpoint/step-``step`` as the run of ``argv`` leaves it: its config.toml, its marker (with
    its data layout) and, with ``embedding_rows``, DCP metadata holding an embedding of that many rows."""
    config = _config(*argv, "--job.dump_folder", str(folder))
    run = resolve_run(config, world_size=1, device_type="cpu")
    path = step_dir(os.path.join(folder, "checkpoint"), step)
    os.makedirs(path)
    if embedding_rows is not None:
        dcp.save({"model": {"tok_embeddings.weight": torch.zeros(embedding_rows, 4)}}, checkpoint_id=path)
    with open(os.path.join(path, RUN_CONFIG_NAME), "w") as f:
        f.write(config_to_toml(config))
    states = ["model"] if model_only else ["dataloader", "model", "optimizer", "train_state"]
    layout = None if model_only else run.data_layout(config.data).to_record()
    new_marker(step, 1, states, model_only, layout).write(path)
    return path


def _check(folder, *argv: str, world_size: int = 1):
    config = _config(*argv, "--job.dump_folder", str(folder))
    return check_resume(config, resolve_run(config, world_size=world_size, device_type="cpu"))


def test_a_folder_holding_llama3_refuses_qwen3_moe_naming_the_model_and_the_dump_folder(tmp_path):
    path = _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    with pytest.raises(ValueError) as err:
        _check(tmp_path, "--config", "qwen3_moe_debug")
    message = str(err.value)
    assert message == (
        f"job.dump_folder={tmp_path} holds the checkpoint of step 200, written by llama3 flavor 'debug' (recorded in "
        f"{path}/config.toml); this run builds qwen3_moe flavor 'debug', which cannot load its weights. Start this "
        f"run in another folder with --job.dump_folder DIR, or resume that run with the configuration that wrote "
        f"it: --config-file {path}/config.toml")
    assert "exclude_from_loading" not in message


@pytest.mark.parametrize("config", ["deepseek_v3_debug", "qwen3_moe_debug"])
def test_the_refusal_comes_before_the_data_position_check(tmp_path, config):
    # The dataset differs too: its advice (exclude the data position) would lead into the weights' shapes.
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug", "--data.dataset", "data/*.jsonl")
    with pytest.raises(ValueError, match=r"written by llama3 flavor 'debug'.*--job.dump_folder DIR") as err:
        _check(tmp_path, "--config", config)
    assert "exclude_from_loading" not in str(err.value)


def test_on_two_processes_another_model_is_refused_not_resharded(tmp_path):
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    with pytest.raises(ValueError, match=r"this run builds qwen3_moe flavor 'debug'") as err:
        _check(tmp_path, "--config", "qwen3_moe_debug", "--parallelism.dp_shard", "2", world_size=2)
    assert "reshard" not in str(err.value)


def test_another_n_layers_or_vocabulary_of_the_same_flavor_is_refused_naming_the_argument(tmp_path):
    _write_checkpoint(tmp_path, 2, "--config", "llama3_debug", "--model.n_layers", "2")
    with pytest.raises(ValueError, match=r"written by llama3 flavor 'debug' with n_layers=2 .*this run builds "
                                         r"llama3 flavor 'debug' with n_layers=6, which cannot"):
        _check(tmp_path, "--config", "llama3_debug")
    other = tmp_path / "vocab"
    # The embedding a 4096-id tokenizer grew the model to; this run's default tokenizer has 2048 ids.
    _write_checkpoint(other, 2, "--config", "llama3_debug", embedding_rows=4096)
    with pytest.raises(ValueError, match=r"written by llama3 flavor 'debug' with vocab_size=4096 .*this run builds "
                                         r"llama3 flavor 'debug' with vocab_size=2048 \(the vocabulary follows the "
                                         r"tokenizer, tokenizer.path\)"):
        _check(other, "--config", "llama3_debug")


def test_the_same_model_resumes_and_a_model_only_checkpoint_is_checked_too(tmp_path):
    _write_checkpoint(tmp_path, 2, "--config", "llama3_debug_fp8", embedding_rows=2048)
    # Another precision and converter, the same weights: resumes.
    assert _check(tmp_path, "--config", "llama3_debug") == ([], [])
    seed = tmp_path / "seed"
    _write_checkpoint(seed, 0, "--config", "llama3_debug", model_only=True)
    with pytest.raises(ValueError, match=r"written by llama3 flavor 'debug'.*this run builds deepseek_v3"):
        _check(seed, "--config", "deepseek_v3_debug")


def test_excluding_the_model_and_its_optimizer_state_leaves_the_weights_unchecked(tmp_path):
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    excluded = _config("--config", "qwen3_moe_debug", "--job.dump_folder", str(tmp_path),
                       "--checkpoint.exclude_from_loading", "model,optimizer")
    check_resumed_model(excluded, resolve_run(excluded, world_size=1, device_type="cpu"))


def test_a_seed_checkpoint_over_a_later_run_warns_that_the_run_resumes_from_the_later_step(tmp_path):
    _write_checkpoint(tmp_path, 100, "--config", "llama3_debug")
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    notes, warnings = _check(tmp_path, "--config", "llama3_debug", "--checkpoint.create_seed_checkpoint", "true")
    folder = os.path.join(tmp_path, "checkpoint")
    assert notes == []
    assert warnings == [
        f"checkpoint.create_seed_checkpoint writes step 0 into {folder}, which holds the checkpoints of steps "
        f"[100, 200] of a later run: a run in this folder resumes from step 200, not from the seed. Write the seed to "
        f"a folder of its own (--job.dump_folder DIR) and start from it with --checkpoint.initial_load_path "
        f"DIR/checkpoint/step-0"]
    assert _check(tmp_path / "empty", "--config", "llama3_debug", "--checkpoint.create_seed_checkpoint", "true") == (
        [], [])


def test_other_data_on_the_same_model_names_the_folders_run_and_both_fixes(tmp_path):
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    with pytest.raises(ValueError) as err:
        _check(tmp_path, "--config", "llama3_debug", "--data.dataset", "data/*.jsonl")
    assert str(err.value) == (
        f"job.dump_folder={tmp_path} holds a llama3 flavor 'debug' run; the data position of the checkpoint of step "
        f"200 was saved with data.dataset='embedded', this run has 'data/*.jsonl': a position is only valid for the "
        f"same data and seq_len. Restore it; start a new run in another folder with --job.dump_folder DIR; or keep "
        f"the folder's weights and start the data from the beginning with --checkpoint.exclude_from_loading "
        f"dataloader")


def test_initial_weights_a_resume_passes_over_are_named_with_the_fix(tmp_path):
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    seed = tmp_path / "seed_ckpt"
    notes, warnings = _check(tmp_path, "--config", "llama3_debug", "--checkpoint.initial_load_path", str(seed))
    assert warnings == [
        f"checkpoint.initial_load_path={seed} is not read: {tmp_path}/checkpoint holds the checkpoint of step 200, "
        f"which this run resumes (initial weights only start a folder without checkpoints); to start from {seed}, "
        f"use another --job.dump_folder"]


def test_the_trainer_warns_when_it_writes_a_seed_over_a_later_run(tmp_path, caplog):
    _write_checkpoint(tmp_path, 200, "--config", "llama3_debug")
    config = _config("--config", "llama3_debug", "--model.n_layers", "1", "--checkpoint.create_seed_checkpoint", "true",
                     "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                     "--job.dump_folder", str(tmp_path))
    config.build().train()
    assert os.path.isdir(step_dir(str(tmp_path / "checkpoint"), 0))
    assert (f"checkpoint.create_seed_checkpoint writes step 0 into {tmp_path}/checkpoint, which holds the checkpoints "
            f"of steps [200] of a later run") in caplog.text
