"""Checkpoints under expert parallelism: a DCP checkpoint saved with EP 2 loads with EP 1 (FSDP 2, and one
process) and one saved with EP 1 loads with EP 2, with identical weights, expert biases and optimizer state
(the experts are saved as their global [num_experts, ...] tensors, which DCP reshards); resuming with EP 2
continues exactly as the uninterrupted run."""
from __future__ import annotations

import os

import pytest
import torch
from _harness import run_ranks
from _moe_ep_steps import Run, load_and_continue, save_after
from _rel_diff import rel_diff

SAVED_AT = 3
EP2 = Run(dp_shard=2, ep=2)
EP1 = Run(dp_shard=2)
# A different layout of the same run changes only the order of float32 sums (test_expert_parallel.py
# measures at most 1.2e-7 relative over 20 steps of these layouts).
FP32_RTOL = 1e-6


def _two_rank_checkpoints(rank: int, world_size: int, tmp: str) -> dict:
    ep2, ep1 = os.path.join(tmp, "ep2"), os.path.join(tmp, "ep1")
    return {
        "ep2_saved": save_after(rank, world_size, EP2, ep2, SAVED_AT),
        "ep2_resumed": load_and_continue(rank, world_size, EP2, ep2, SAVED_AT),
        "ep1_from_ep2": load_and_continue(rank, world_size, EP1, ep2, SAVED_AT),
        "ep1_saved": save_after(rank, world_size, EP1, ep1, SAVED_AT),
        "ep2_from_ep1": load_and_continue(rank, world_size, EP2, ep1, SAVED_AT),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("ep_ckpt"))
    per_rank = run_ranks(_two_rank_checkpoints, 2, tmp)
    one_process = run_ranks(load_and_continue, 1, Run(), os.path.join(tmp, "ep2"), SAVED_AT)[0]
    return {"ranks": per_rank, "one_process_from_ep2": one_process}


def _assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_the_saved_state_holds_the_global_experts_and_a_moved_bias(checkpoints):
    state = checkpoints["ranks"][0]["ep2_saved"]["state"]
    assert state["layers.0.moe.experts.w1"].shape == (4, 32, 64)  # all 4 experts, not a rank's 2
    assert state["layers.0.moe.expert_bias"].abs().max() > 0


def test_ep2_checkpoint_loads_with_ep1_and_on_one_process_with_identical_weights_and_biases(checkpoints):
    for rank_results in checkpoints["ranks"]:
        saved = rank_results["ep2_saved"]
        _assert_same_state(rank_results["ep1_from_ep2"]["state"], saved["state"])
        # Weights, biases and Adam moments resharded: the next steps train as the EP 2 run does.
        assert rel_diff(rank_results["ep1_from_ep2"]["next"]["losses"], saved["next"]["losses"]) <= FP32_RTOL
    saved = checkpoints["ranks"][0]["ep2_saved"]
    _assert_same_state(checkpoints["one_process_from_ep2"]["state"], saved["state"])
    assert rel_diff(checkpoints["one_process_from_ep2"]["next"]["losses"], saved["next"]["losses"]) <= FP32_RTOL


def test_ep1_checkpoint_loads_with_ep2_with_identical_weights_and_biases(checkpoints):
    for rank_results in checkpoints["ranks"]:
        saved = rank_results["ep1_saved"]
        _assert_same_state(rank_results["ep2_from_ep1"]["state"], saved["state"])
        assert rel_diff(rank_results["ep2_from_ep1"]["next"]["losses"], saved["next"]["losses"]) <= FP32_RTOL


def test_resume_with_ep2_is_exact(checkpoints):
    for rank_results in checkpoints["ranks"]:
        saved, resumed = rank_results["ep2_saved"], rank_results["ep2_resumed"]
        _assert_same_state(resumed["state"], saved["state"])
        assert resumed["next"]["losses"] == saved["next"]["losses"]
        for a, b in zip(resumed["next"]["bias"], saved["next"]["bias"], strict=True):
            assert torch.equal(a, b)
