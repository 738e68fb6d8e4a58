"""Expert-parallel layouts a run cannot train are refused when the run is resolved (so --check-config refuses
them before launch), each with the fix named; a layout that can is accepted."""
from __future__ import annotations

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import parse_cli
from torchtitan_lite.resolved_run import resolve_run


def _resolve(world_size: int, *argv: str):
    if "--config" not in argv:
        argv = ("--config", "qwen3_moe_debug", *argv)
    config = parse_cli(list(argv), registry=DEFAULT_REGISTRY).config
    return resolve_run(config, world_size=world_size, device_type="cpu")


@pytest.mark.parametrize("world_size, argv, message", [
    # qwen3_moe debug has 8 experts.
    (3, ["--parallelism.ep", "3"], "parallelism.ep=3 must divide the model's num_experts=8 (each EP rank holds whole "
                                   "experts); use an ep among 1, 2, 4, 8 that also divides dp_shard"),
    (2, ["--config", "llama3_debug", "--parallelism.ep", "2"],
     "parallelism.ep=2 splits routed experts over ranks, but model llama3 (flavor debug) is dense: it has no MoE "
     "layers. Set --parallelism.ep 1"),
    (2, ["--parallelism.ep", "2", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option",
         "op"], "use --activation_checkpoint.mode full, or --activation_checkpoint.selective_option 2"),
    # ep larger than the data-parallel ranks (ParallelDims, before any model is looked at).
    (2, ["--parallelism.ep", "4"], "parallelism.ep=4 splits the experts over data-parallel (FSDP) ranks, and 2 "
                                   "process(es) leave parallelism.dp_shard=2 after pp x dp_replicate x tp = 1 x 1 x 1 "
                                   "= 1: this layout needs 4 processes"),
])
def test_layouts_expert_parallelism_cannot_train_are_refused_with_the_fix(world_size, argv, message):
    with pytest.raises(ValueError) as error:
        _resolve(world_size, *argv)
    assert message in str(error.value)


def test_expert_parallel_layouts_that_train_are_accepted():
    run = _resolve(4, "--parallelism.ep", "2", "--activation_checkpoint.mode", "full")
    assert (run.parallel_dims.ep, run.parallel_dims.expert_fsdp_degree) == (2, 2)
    assert run.parallel_dims.describe() == "FSDP 4 + EP 2"
    assert _resolve(8, "--parallelism.ep", "8").parallel_dims.expert_fsdp_degree == 1
    # EP composes with TP: the experts split over ep and their hidden dim over tp.
    ep_tp = _resolve(4, "--parallelism.ep", "2", "--parallelism.tp", "2").parallel_dims
    assert (ep_tp.ep, ep_tp.tp, ep_tp.expert_fsdp_degree) == (2, 2, 1)
    assert ep_tp.describe() == "FSDP 2 + TP 2 + EP 2"
