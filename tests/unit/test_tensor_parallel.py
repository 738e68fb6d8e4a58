"""Tensor-parallel helpers that need no process group: float8 style selection and the loss context."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.distributed.tensor_parallel import (
    is_float8_tensorwise,
    local_loss,
    loss_parallel_context,
    tp_regions,
)


def _converted(recipe: str) -> nn.Module:
    return convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=Float8LinearConfig.from_recipe_name(recipe))[0]


def test_only_tensorwise_float8_linears_get_float8_communication():
    assert is_float8_tensorwise(_converted("tensorwise"))
    assert not is_float8_tensorwise(_converted("rowwise"))
    assert not is_float8_tensorwise(_converted("rowwise_with_gw_hp"))
    assert not is_float8_tensorwise(nn.Linear(32, 32))


def test_loss_parallel_context_only_when_enabled():
    assert not isinstance(loss_parallel_context(True), contextlib.nullcontext)
    assert isinstance(loss_parallel_context(False), contextlib.nullcontext)


def test_float8_regions_need_every_consumer_tensorwise():
    """wk/wv in high precision (auto_filter_small_kn on 8B): the attention input stays bf16, the FFN input
    and both output projections communicate in float8."""
    high_precision = {"attention.wk", "attention.wv"}
    regions = tp_regions(LLAMA3_PARALLEL_PLAN.block_tp, lambda fqn: fqn not in high_precision)
    assert {r.name: r.float8 for r in regions} == {
        "attention input": False, "feed_forward input": True,
        "attention.wo output": True, "feed_forward.w2 output": True,
    }
    assert regions[0].why == "attention.wk, attention.wv not tensorwise float8"
    assert not any(r.float8 for r in tp_regions(LLAMA3_PARALLEL_PLAN.block_tp, lambda fqn: False))


def test_local_loss_passes_plain_tensors_through():
    t = torch.tensor(2.5)
    assert local_loss(t) is t


def test_a_block_applies_the_plan_entries_of_the_modules_it_has():
    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
    from models.deepseek_v3.parallelize import DEEPSEEK_V3_PARALLEL_PLAN
    from torchtitan_lite.distributed.tensor_parallel import block_plan

    with torch.device("meta"):
        model = DeepSeekV3Model(DEEPSEEK_V3_FLAVORS["debug"])  # block 0 dense, blocks 1-3 MoE; low-rank queries
    dense, moe = (block_plan(DEEPSEEK_V3_PARALLEL_PLAN.block_tp, model.layers[i]) for i in ("0", "1"))
    assert [(i.module, i.consumers) for i in dense.inputs] == [
        ("attention", ("attention.wq_a", "attention.wkv_a")), ("feed_forward", ("feed_forward.w1", "feed_forward.w3"))]
    assert dense.rowwise == ("attention.wo", "feed_forward.w2") and dense.moe is None
    assert [(i.module, i.consumers) for i in moe.inputs] == [("attention", ("attention.wq_a", "attention.wkv_a"))]
    assert moe.rowwise == ("attention.wo",) and moe.moe is not None and moe.moe.shared_rowwise == ("moe.shared_experts.w2",)
    # The replicated down-projections read the attention input: it is gathered in high precision, whatever they are.
    assert [(r.name, r.float8, r.why) for r in tp_regions(moe, lambda fqn: True)][0] == (
        "attention input", False, "attention.wq_a, attention.wkv_a replicated")
    # Only the up-projections and wo are split among the attention's Linears (wq, absent here, would be too).
    assert moe.colwise == ("attention.wq_b", "attention.wkv_b")
