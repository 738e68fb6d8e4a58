"""The attention every family shares: q / k / v projections, rotary embedding, causal grouped-query SDPA."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from models.common.attention.mask import Mask
from models.common.attention.rope import apply_rotary_emb
from models.common.init import trunc_normal_
from torchtitan_lite.mesh.sequence_collectives import gather_sequence


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, seq, kv_heads, head_dim] -> [batch, seq, kv_heads * n_rep, head_dim]; head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    bsz, seqlen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bsz, seqlen, n_kv_heads, n_rep, head_dim).reshape(
        bsz, seqlen, n_kv_heads * n_rep, head_dim
    )


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (wq, wk, wv, wo without bias).

    head_dim is its own argument: Llama 3 derives it as dim / n_heads, Qwen3 sets it. A family that
    normalises q and k per head overrides `norm_qk`."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.cp_group: ProcessGroup | None = None
        """Context parallelism's group (None: this rank holds whole sequences); ``use_context_parallel``."""

    def use_context_parallel(self, group: ProcessGroup) -> bool:
        """Attend over the keys and values of the whole sequence, all-gathered over ``group`` (the CP ranks)."""
        self.cp_group = group
        return True

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=out_proj_std)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [batch, seq, heads, head_dim] before the rotary embedding; unchanged here."""
        return q, k

    def project(self, x: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] of x, q and k normalised
        and rotated by positions 0..seq-1 of ``rope_cache``: what the training forward and the KV cache
        (models/common/attention/gqa_kv_cache.py) attend with."""
        bsz, seqlen, _ = x.shape
        # Head counts come from the projections' outputs, not from the args: under tensor parallelism each
        # rank holds n_heads / tp query heads and n_kv_heads / tp key/value heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.norm_qk(q, k)
        return apply_rotary_emb(q, rope_cache), apply_rotary_emb(k, rope_cache), v

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        """``rope_cache``: the rotary table [max_seq, head_dim / 2], or one row per token [batch, seq, ...]
        (positions restarting per document); ``mask``: models/common/attention/mask.py's (None: causal).

        Under context parallelism x holds this rank's chunks of each sequence: its queries attend over the keys
        and values of every chunk, gathered from the CP group (n_kv_heads of them, before any repeat, so the
        bytes are the smallest the attention can use), under the mask the sequence layout built for them."""
        q, k, v = self.project(x, rope_cache)
        k, v = gather_sequence(k, self.cp_group), gather_sequence(v, self.cp_group)
        return self.wo(grouped_query_attention(q, k, v, mask))


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: Mask | None = None) -> torch.Tensor:
    """Attention of [batch, seq, heads, head_dim] q and [batch, seq, kv_heads, head_dim] k / v (rotary
    already applied) under ``mask`` (None: causal) -> [batch, seq, heads * head_dim], ready for the output
    projection.

    Head counts come from the tensors, not from model args: under tensor parallelism each rank holds
    n_heads / tp query heads and n_kv_heads / tp key/value heads."""
    bsz, seqlen = q.shape[:2]  # the queries' length (under context parallelism the keys may be more)
    n_rep = q.shape[2] // k.shape[2]
    # On CPU the flash kernel reads each key/value head for its n_rep query heads itself (enable_gqa): no
    # repeated copies forward and no reduction over them backward (measured ~6% faster per attention
    # call). On CUDA enable_gqa is only served by the flash and math kernels, so float32 runs would fall
    # back to the memory-hungry math kernel: there the heads are repeated explicitly.
    # FlexAttention (a BlockMask) reads the key/value heads itself on every device.
    gqa = n_rep > 1 and (q.device.type == "cpu" or not (mask is None or isinstance(mask, torch.Tensor)))
    if not gqa:
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
    out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(bsz, seqlen, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool,
                     scale: float | None = None) -> torch.Tensor:
    """Causal SDPA of [batch, heads, seq, head_dim] tensors, returned in q's dtype; ``scale`` multiplies the
    scores (default head_dim ** -0.5). v may have its own head_dim (multi-head latent attention).

    On CPU, bfloat16 / float16 inputs are attended in float32: torch's CPU flash kernel runs its
    reduced-precision path several times slower than its float32 one (measured on an AVX-512 BF16 CPU:
    19.6 vs 8.9 ms forward + backward at the debug model's shapes, 16 x 8 heads x 128 x 32), and float32
    keeps the scores and the probability-weighted sum exact where bfloat16 would round them. The inputs
    are the same bfloat16-rounded values either way; only the output is rounded back. CPU autocast would
    cast the float32 inputs down again, so it is off for the call. GPUs keep their native kernels.
    """
    return masked_attention(q, k, v, None, enable_gqa=enable_gqa, scale=scale)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None, *, enable_gqa: bool,
                     scale: float | None = None) -> torch.Tensor:
    """``causal_attention`` under ``mask``: None (SDPA's is_causal), a dense additive [B, 1, s, S] (SDPA's
    attn_mask) or a FlexAttention BlockMask. The CPU float32 rule above holds for the first two."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        return _flex()(q, k, v, block_mask=mask, enable_gqa=enable_gqa, scale=scale)
    masking = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        if mask is not None and mask.dtype != q.dtype:  # a float32 mask (mask.py) under another compute dtype
            masking = {"attn_mask": mask.to(q.dtype)}
        return F.scaled_dot_product_attention(q, k, v, **masking, enable_gqa=enable_gqa, scale=scale)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **masking, enable_gqa=enable_gqa,
                                             scale=scale)
    return out.to(q.dtype)


@functools.cache
def _flex() -> Callable[..., torch.Tensor]:
    """FlexAttention: compiled on CUDA (the eager form materialises every score), eager elsewhere (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return cast(Callable[..., torch.Tensor], torch.compile(flex_attention) if torch.cuda.is_available()
                else flex_attention)
