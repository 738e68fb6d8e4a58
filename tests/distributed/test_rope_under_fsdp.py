"""The rotary table keeps full precision inside FSDP bf16 blocks: FSDP's mixed-precision policy casts the
blocks' floating-point forward arguments to bf16, and the table is one of them unless it is complex."""
from __future__ import annotations

import torch
from _harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.common.attention.rope import rope_cache
from models.llama3.model import Llama3ModelArgs, Transformer


def _table_seen_by_attention(rank: int, world_size: int) -> str:
    args = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args)
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen: list[torch.Tensor] = []
    model.layers["1"].attention.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[1]))
    model(torch.randint(0, 64, (2, 16))).float().sum().backward()
    exact = torch.equal(seen[0], rope_cache(16, 64, args.rope_theta, None))
    return f"{seen[0].dtype} exact={exact}"


def test_fsdp_bf16_blocks_receive_the_complex64_rotary_table_unrounded():
    assert run_ranks(_table_seen_by_attention, 2, timeout_s=120) == ["torch.complex64 exact=True"] * 2
