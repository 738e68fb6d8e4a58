"""Qwen3-MoE size presets: a debug model for CPUs and the published Qwen3-30B-A3B / 235B-A22B shapes
(the config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, top-8, normalised top-k
softmax router, no shared experts, head_dim 128, rope theta 1e6, 151,936-token vocabulary)."""
from __future__ import annotations

from models.common.moe.layer import MoEArgs
from models.qwen3_moe.args import Qwen3MoeModelArgs


def _qwen3_router(hidden_dim: int, num_experts: int = 128, top_k: int = 8) -> MoEArgs:
    # Balanced by an auxiliary loss with Qwen3-MoE's coefficient (router_aux_loss_coef 0.001); ours is the
    # sequence-level form. No expert bias: the Hugging Face model has none to export it to.
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax",
                   norm_topk_prob=True, aux_loss_coeff=1e-3)


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeModelArgs] = {
    # 2.3M parameters (1.1M active per token: 2 of 8 experts), vocabulary as llama3 debug.
    "debug": Qwen3MoeModelArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, max_seq_len=2048,
        rope_theta=1000000.0, moe=_qwen3_router(hidden_dim=128, num_experts=8, top_k=2),
    ),
    "30B-A3B": Qwen3MoeModelArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936, max_seq_len=40960,
        rope_theta=1000000.0, moe=_qwen3_router(hidden_dim=768),
    ),
    "235B-A22B": Qwen3MoeModelArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936, max_seq_len=40960,
        rope_theta=1000000.0, moe=_qwen3_router(hidden_dim=1536),
    ),
}
