"""A checkpoint of an MoE model resumes only with the top_k it was trained with: the weights have the same shapes
under any top_k, so without the marker's record a changed routing would load without a word."""
from __future__ import annotations

import pytest
from test_checkpoint_manager import Loader, Optim, Steps, Tiny, ckpt_dir

from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.layout import Marker


def _manager(dump, moe_top_k):
    model = Tiny()
    optim = Optim(model)
    states = {"model": ModelWrapper(model), "optimizer": optim, "dataloader": Loader(), "train_state": Steps()}
    return CheckpointManager.Config(enable=True, interval=1).build(dump_folder=str(dump), states=states,
                                                                   moe_top_k=moe_top_k)


def test_a_resume_with_another_top_k_is_refused_naming_both_values_and_the_way_to_start_anew(tmp_path):
    _manager(tmp_path, moe_top_k=2).save(1, force=True)
    assert Marker.read(ckpt_dir(tmp_path, 1)).moe_top_k == 2
    with pytest.raises(ValueError) as error:
        _manager(tmp_path, moe_top_k=1).load()
    path = ckpt_dir(tmp_path, 1)
    assert str(error.value) == (
        f"{path} was trained with MoE top_k=2 (routed experts per token), this run has top_k=1: top_k changes what "
        f"the model computes, so resuming would continue another model. Resume with the model that wrote it "
        f"(top_k=2), or start a new run from these weights in its own --job.dump_folder with "
        f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only true")
    assert _manager(tmp_path, moe_top_k=2).load() == 1  # the same routing resumes


def test_the_explicit_way_to_start_anew_from_the_weights_is_not_refused(tmp_path):
    _manager(tmp_path / "moe", moe_top_k=2).save(1, force=True)
    model = Tiny()
    states = {"model": ModelWrapper(model), "optimizer": Optim(model), "train_state": Steps()}
    fresh = CheckpointManager.Config(enable=True, initial_load_path=ckpt_dir(tmp_path / "moe", 1),
                                     initial_load_model_only=True).build(
        dump_folder=str(tmp_path / "top1"), states=states, moe_top_k=1)
    fresh.load()  # the weights initialise another model, as asked


def test_dense_models_and_older_markers_record_no_top_k(tmp_path):
    _manager(tmp_path, moe_top_k=None).save(1, force=True)
    assert Marker.read(ckpt_dir(tmp_path, 1)).moe_top_k is None
    assert _manager(tmp_path, moe_top_k=2).load() == 1  # nothing recorded: nothing to hold against
