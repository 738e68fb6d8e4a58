"""Tensor-parallel helpers that need no process group: float8 style selection and the loss context."""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from torchtitan_lite.config.sections import ParallelismConfig
from torchtitan_lite.distributed.parallel_dims import ParallelDims
from torchtitan_lite.distributed.tensor_parallel import is_float8_tensorwise, local_loss, loss_parallel_context


def _converted(recipe: str) -> nn.Module:
    return convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=Float8LinearConfig.from_recipe_name(recipe))[0]


def test_only_tensorwise_float8_linears_get_float8_communication():
    assert is_float8_tensorwise(_converted("tensorwise"))
    assert not is_float8_tensorwise(_converted("rowwise"))
    assert not is_float8_tensorwise(_converted("rowwise_with_gw_hp"))
    assert not is_float8_tensorwise(nn.Linear(32, 32))


def test_loss_parallel_context_only_with_tp_and_the_flag():
    config = SimpleNamespace(parallelism=ParallelismConfig(enable_loss_parallel=True))
    off = SimpleNamespace(parallelism=dataclasses.replace(config.parallelism, enable_loss_parallel=False))
    tp = ParallelDims(1, 1, 2, world_size=2)
    fsdp = ParallelDims(1, 2, 1, world_size=2)
    assert not isinstance(loss_parallel_context(tp, config), contextlib.nullcontext)
    assert isinstance(loss_parallel_context(tp, off), contextlib.nullcontext)
    assert isinstance(loss_parallel_context(fsdp, config), contextlib.nullcontext)


def test_local_loss_passes_plain_tensors_through():
    t = torch.tensor(2.5)
    assert local_loss(t) is t
