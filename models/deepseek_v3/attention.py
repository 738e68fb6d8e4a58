"""Multi-head latent attention (DeepSeek-V2 / V3).

Keys and values are expanded from one compressed latent per token (``wkv_a`` -> RMSNorm -> ``wkv_b``), which
is all an inference KV cache keeps. Position enters through a decoupled part: each query head has
``qk_rope_head_dim`` rotary channels, and the key's rotary channels are one vector per token (computed with
the latent by ``wkv_a``) shared by every head. The query is low-rank (``wq_a`` -> RMSNorm -> ``wq_b``) when
``q_lora_rank`` > 0, else one ``wq``. Rotary pairs are channels (2i, 2i+1), DeepSeek's own layout (HF's
``rope_interleave``), so the HF adapter permutes nothing.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from models.common.attention.grouped_query import masked_attention
from models.common.attention.mask import Mask
from models.common.attention.rope import apply_rotary_emb
from models.common.init import trunc_normal_
from models.common.rms_norm import RMSNorm
from models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan_lite.mesh.sequence_collectives import gather_sequence

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q / kv latent norms: DeepSeek's reference and HF both use the RMSNorm default, whatever
rms_norm_eps says."""


class MultiHeadLatentAttention(nn.Module):
    """x [batch, seq, dim] -> [batch, seq, dim], causal (or under a mask, models/common/attention/mask.py)."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.softmax_scale = args.softmax_scale
        q_out = args.n_heads * args.head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.cp_group: ProcessGroup | None = None
        """Context parallelism's group (None: this rank holds whole sequences); ``use_context_parallel``."""

    def use_context_parallel(self, group: ProcessGroup) -> bool:
        """Attend over the whole sequence: the compressed latent and rotary key of every token are all-gathered
        over ``group`` (the CP ranks) and expanded by ``wkv_b`` on each rank."""
        self.cp_group = group
        return True

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=out_proj_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def query_heads(self, x: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query [batch, seq, heads, ...] in two parts: its qk_nope_head_dim channels and its
        qk_rope_head_dim channels rotated by positions 0..seq-1 of ``rope_cache``."""
        bsz, seqlen, _ = x.shape
        # Head counts come from the projections' outputs, so that a rank holding a slice of the heads works.
        q = self.query(x).view(bsz, seqlen, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, apply_rotary_emb(q_rope, rope_cache)

    def compressed_kv(self, x: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a token contributes to every head's keys and values, and all the KV cache keeps of it
        (models/deepseek_v3/kv_cache.py): the normalised latent [batch, seq, kv_lora_rank], which ``wkv_b``
        expands, and the rotated key channels [batch, seq, 1, qk_rope_head_dim] every head shares."""
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_norm(latent), apply_rotary_emb(k_rope.unsqueeze(2), rope_cache)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_nope, q_rope = self.query_heads(x, rope_cache)
        latent, k_rope = self.compressed_kv(x, rope_cache)
        if self.cp_group is not None:
            # Context parallelism gathers what a token contributes to every head, kv_lora_rank + rope_dim values
            # (576 in V3), in one collective, not the expanded heads (n_heads x (qk_head_dim + v_head_dim)); each
            # key was rotated at its own position before the gather. The expansion then runs on every rank.
            compressed = gather_sequence(torch.cat([latent, k_rope.squeeze(2)], dim=-1), self.cp_group)
            latent, k_rope = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        kv = self.wkv_b(latent).view(bsz, latent.shape[1], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, enable_gqa=False,
                               scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
