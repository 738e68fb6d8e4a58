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
