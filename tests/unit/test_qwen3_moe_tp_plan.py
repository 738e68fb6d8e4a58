"""Qwen3-MoE's tensor-parallel plan as data, and the layouts refused before launch (no process group)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models.qwen3_moe import QWEN3_MOE_FLAVORS
from models.qwen3_moe.parallelize import QWEN3_MOE_PARALLEL_PLAN, check_qwen3_moe_run
from torchtitan_lite.distributed.tensor_parallel import tp_regions
from torchtitan_lite.protocols.model_spec import RunFacts


@pytest.mark.parametrize(("param", "dim"), [
    ("layers.3.moe.experts.w1", 1),  # [E, hidden, dim]: each expert's hidden rows
    ("layers.3.moe.experts.w3", 1),
    ("layers.3.moe.experts.w2", 2),  # [E, dim, hidden]: each expert's hidden columns
    ("layers.3.moe.shared_experts.w1.weight", 0),
    ("layers.3.moe.shared_experts.w2.weight", 1),
    ("layers.3.attention.wq.weight", 0),
    ("layers.3.attention.wo.weight", 1),
    ("layers.3.moe.router.gate.weight", None),  # replicated
    ("layers.3.attention.q_norm.weight", None),
    ("tok_embeddings.weight", 0),
    ("output.weight", 0),
])
def test_plan_splits_every_expert_on_its_hidden_dim_and_attention_by_heads(param, dim):
    assert QWEN3_MOE_PARALLEL_PLAN.param_tp_shard_dim(param) == dim


def test_moe_communication_stays_high_precision_whatever_the_attention_does():
    regions = tp_regions(QWEN3_MOE_PARALLEL_PLAN.block_tp, lambda fqn: True)  # every Linear tensorwise float8
    assert [(r.name, r.float8, r.why) for r in regions] == [
        ("attention input", True, "every consumer is tensorwise float8"),
        ("attention.wo output", True, "tensorwise float8"),
        ("moe input", False, "the router reads it in float32"),
        ("moe output", False, "partial sums of the experts"),
    ]


def _facts(tp: int, **moe) -> RunFacts:
    debug = QWEN3_MOE_FLAVORS["debug"]
    args = dataclasses.replace(debug, moe=dataclasses.replace(debug.moe, **moe))
    return RunFacts(model_args=args, compile_model=False, param_dtype=torch.float32, tp=tp)


def test_tp_that_splits_the_experts_evenly_and_aligned_is_accepted():
    check_qwen3_moe_run(_facts(2))  # hidden_dim 128 -> 64 channels per rank
    check_qwen3_moe_run(_facts(3, hidden_dim=48))  # 16 per rank


def test_tp_that_does_not_divide_the_experts_hidden_dim_is_refused_with_the_fix():
    with pytest.raises(ValueError) as error:
        check_qwen3_moe_run(_facts(3, hidden_dim=128))
    assert str(error.value) == (
        "parallelism.tp=3 must divide the MoE experts' hidden_dim=128 (expert tensor parallelism gives each rank "
        "hidden_dim / tp channels of every expert); use a tp among the divisors of 128, or data parallelism "
        "(parallelism.dp_shard) instead")


def test_tp_that_leaves_unaligned_expert_slices_for_grouped_mm_is_refused_unless_the_loop_runs():
    with pytest.raises(ValueError, match=r"^parallelism.tp=2 leaves each rank 20 of the experts' hidden_dim=40 "
                                         r"channels, not a multiple of 8: .* or set the flavor's "
                                         r"moe.use_grouped_mm=False to run the per-expert loop$"):
        check_qwen3_moe_run(_facts(2, hidden_dim=40))
    check_qwen3_moe_run(_facts(2, hidden_dim=40, use_grouped_mm=False))
