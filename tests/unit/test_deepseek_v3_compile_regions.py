"""What DeepSeek-V3 compiles under expert parallelism: its dense first blocks whole, and of each MoE block
everything but the all-to-all dispatch and combine (whose split sizes are host integers), so a graph never
breaks at the exchange."""
from __future__ import annotations

import dataclasses

import torch

from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from models.deepseek_v3.parallelize import DEEPSEEK_V3_PARALLEL_PLAN
from torchtitan_lite.distributed.compile import apply_compile, expert_parallel_regions


def _compiled(module: torch.nn.Module) -> bool:
    return module._compiled_call_impl is not None


def test_dense_blocks_compile_whole_and_moe_blocks_all_but_the_exchange():
    with torch.device("meta"):
        model = DeepSeekV3Model(dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], n_layers=3))  # 1 dense + 2 MoE
    assert apply_compile(model.layers, backend="eager", fullgraph=True,
                         regions=expert_parallel_regions(DEEPSEEK_V3_PARALLEL_PLAN)) == 3
    dense, moe_blocks = model.layers["0"], [model.layers["1"], model.layers["2"]]
    assert _compiled(dense) and not any(_compiled(m) for m in dense.modules() if m is not dense)
    for block in moe_blocks:
        assert not _compiled(block) and not _compiled(block.moe)
        assert all(_compiled(block.get_submodule(name)) for name in DEEPSEEK_V3_PARALLEL_PLAN.ep_compile_regions)
