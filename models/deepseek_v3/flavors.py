"""DeepSeek-V3 size presets.

- ``debug``: a CPU model of the full architecture (low-rank Q, YaRN, 1 dense + 3 MoE blocks, group-limited
  sigmoid routing over 8 experts, a shared expert). Every dim is a multiple of 8 (grouped GEMMs) and every
  Linear but ``wkv_a`` a multiple of 128 (the blockwise FP8 tile); ``wkv_a`` writes kv_lora_rank +
  qk_rope_head_dim = 160 channels, as the 671B model's 576 is no multiple of 128 either.
- ``16B``: Moonlight-16B-A3B's shapes (moonshotai/Moonlight-16B-A3B, a ``DeepseekV3ForCausalLM``): full-rank
  Q, 27 layers (1 dense), 64 experts top-6 with 2 shared, one expert group, routed scale 2.446, no YaRN.
  DeepSeek-V2-Lite has the same attention and expert shapes but a softmax router and a 102,400 vocabulary.
- ``671B``: DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3): 61 layers (3 dense), 256 experts
  top-8 in 8 groups (4 kept) with 1 shared, routed scale 2.5, YaRN factor 40 over 4,096 positions. Balancing as
  the paper trains it: bias update speed 1e-3 and a sequence-level balance loss of weight 1e-4.
"""
from __future__ import annotations

from models.common.attention.yarn import YarnScaling
from models.common.moe.layer import MoEArgs
from models.deepseek_v3.args import DeepSeekV3ModelArgs


def _deepseek_moe(num_experts: int, top_k: int, hidden_dim: int, *, shared: int, route_scale: float,
                  groups: int = 1, topk_groups: int = 1) -> MoEArgs:
    # Sigmoid scores, normalised top-k times the routed scale, balanced by the expert bias plus a small
    # sequence-level loss (DeepSeek-V3 section 2.1.2).
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="sigmoid",
                   norm_topk_prob=True, route_scale=route_scale, num_groups=groups, topk_groups=topk_groups,
                   num_shared_experts=shared, bias_update_rate=1e-3, aux_loss_coeff=1e-4)


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3ModelArgs] = {
    "debug": DeepSeekV3ModelArgs(
        dim=256, n_layers=4, n_heads=4, vocab_size=2048, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, n_dense_layers=1, dense_hidden_dim=512, norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512),
        max_seq_len=2048,
        moe=_deepseek_moe(8, 2, 128, shared=1, route_scale=2.5, groups=4, topk_groups=2),
    ),
    "16B": DeepSeekV3ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=1, dense_hidden_dim=11264, norm_eps=1e-5,
        rope_theta=50000.0, rope_scaling=None, max_seq_len=8192,
        moe=_deepseek_moe(64, 6, 1408, shared=2, route_scale=2.446),
    ),
    "671B": DeepSeekV3ModelArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_dense_layers=3, dense_hidden_dim=18432,
        norm_eps=1e-6, rope_theta=10000.0, rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096),
        max_seq_len=163840,
        moe=_deepseek_moe(256, 8, 2048, shared=1, route_scale=2.5, groups=8, topk_groups=4),
    ),
}
