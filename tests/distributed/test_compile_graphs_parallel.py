"""Per-block compile under FSDP2 or tensor parallelism, with activation checkpointing, still compiles one graph
per block kind at any depth: FSDP's per-block hooks stay outside the graphs, and TP's DTensor parameters of
one block pass the guards of another's, so dynamo does not recompile for each block."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from models.llama3.model import Llama3ModelArgs, Transformer
from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.compile import apply_compile, compiled_graphs
from torchtitan_lite.distributed.fsdp import apply_fsdp
from torchtitan_lite.distributed.tensor_parallel import apply_tp

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=32)


def _graphs_per_depth(rank: int, world_size: int, layout: str) -> dict[int, int]:
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (world_size,))
    graphs = {}
    for n_layers in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(ARGS, n_layers=n_layers))
        if layout == "tp":  # the trainer's order: TP, then AC, then compile, then FSDP
            apply_tp(model, mesh, LLAMA3_PARALLEL_PLAN, sequence_parallel=True, loss_parallel=False)
        apply_ac(model.layers, "selective", "2", compiled_tp=layout == "tp")  # two block kinds: every second checkpointed
        apply_compile(model.layers, backend="aot_eager", fullgraph=True)
        if layout == "fsdp":
            apply_fsdp(model, mesh, LLAMA3_PARALLEL_PLAN)
        for _ in range(2):
            model(torch.randint(0, 64, (2, 16))).float().sum().backward()
        graphs[n_layers] = compiled_graphs()
    return graphs


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_checkpointed_compiled_blocks_compile_once_per_kind_at_any_depth(layout):
    assert run_ranks(_graphs_per_depth, 2, layout, timeout_s=180) == [{2: 2, 5: 2}] * 2
