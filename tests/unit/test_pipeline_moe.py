"""MoE under pipeline parallelism, the parts that need no process group: which schedules may combine expert
parallelism with activation checkpointing (refused at resolve time, with the fix), and how the router
statistics of several stages merge into the whole model's."""
from __future__ import annotations

import pytest

from config_registry import DEFAULT_REGISTRY
from models.common.moe.router_stats import merge_router_stats
from torchtitan_lite.config import parse_cli
from torchtitan_lite.resolved_run import resolve_run

PP2_EP2 = ["--config", "qwen3_moe_debug", "--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep",
           "2", "--training.local_batch_size", "4"]


def _resolve(*argv: str):
    config = parse_cli([*PP2_EP2, *argv], registry=DEFAULT_REGISTRY).config
    return resolve_run(config, world_size=4, device_type="cpu")


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_expert_parallelism_with_checkpointing(schedule):
    with pytest.raises(ValueError) as error:
        _resolve("--parallelism.pipeline_schedule", schedule, "--activation_checkpoint.mode", "full")
    assert str(error.value) == (
        f"parallelism.pipeline_schedule={schedule} with parallelism.ep=2 and activation_checkpoint.mode=full is not "
        "supported: this schedule computes each micro-batch's input and weight gradients in two passes, each "
        "recomputing a checkpointed block, and the second cannot replay the block's expert-parallel exchanges. Use "
        "--parallelism.pipeline_schedule 1F1B or Interleaved1F1B, or --activation_checkpoint.mode none")


@pytest.mark.parametrize("argv", [
    ["--parallelism.pipeline_schedule", "1F1B", "--activation_checkpoint.mode", "full"],
    ["--parallelism.pipeline_schedule", "Interleaved1F1B", "--activation_checkpoint.mode", "full"],
    ["--parallelism.pipeline_schedule", "ZBVZeroBubble"],  # no recomputation to replay
])
def test_pipeline_expert_parallel_layouts_that_train_are_accepted(argv):
    run = _resolve(*argv)
    assert run.pipeline is not None and run.parallel_dims.ep == 2


def test_router_stats_of_two_stages_and_a_dense_one_merge_into_the_whole_models():
    first = {"moe/layers.1/imbalance": 1.5, "moe/layers.1/dead_share": 0.25,
             "moe/imbalance_max": 1.5, "moe/dead_share": 0.25, "moe/aux_loss": 0.25}
    second = {"moe/layers.2/imbalance": 3.0, "moe/layers.2/dead_share": 0.5,
              "moe/layers.3/imbalance": 1.0, "moe/layers.3/dead_share": 0.0,
              "moe/imbalance_max": 3.0, "moe/dead_share": 0.25, "moe/aux_loss": 0.5}
    merged = merge_router_stats([{}, first, second])  # the dense first stage reports nothing
    assert merged == {**first, **second, "moe/imbalance_max": 3.0, "moe/aux_loss": 0.75,
                      # 3 MoE layers of equal expert counts: (0.25 + 0.5 + 0) / 3.
                      "moe/dead_share": pytest.approx(0.25)}
    assert merge_router_stats([first]) == first and merge_router_stats([{}]) == {}
