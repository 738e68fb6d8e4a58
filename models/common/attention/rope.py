"""Rotary position embeddings in Meta's Llama convention: channels (2i, 2i+1) of a head form one pair.

The Hugging Face checkpoints pair channel i with i + head_dim/2 instead ("rotate_half"); the state-dict
adapter permutes the rows of wq / wk so that both conventions compute the same attention scores.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from models.common.attention.rope_scaling import RopeScaling
from models.common.attention.yarn import YarnScaling, yarn_frequencies

RotaryScaling = RopeScaling | YarnScaling
"""Llama 3.1's frequency scaling or YaRN (DeepSeek-V3)."""


def rope_frequencies(head_dim: int, theta: float, scaling: RotaryScaling | None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequency of each channel pair, float32 [head_dim / 2], Llama 3.1 or YaRN scaling applied if given."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(theta ** exponents, head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    return _llama31_scale(inv_freq, scaling)


def _llama31_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Same float32 operations, in the same order, as the reference per-frequency loop of Llama 3.1.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, scaling: RotaryScaling | None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """complex64 table [max_seq_len, head_dim / 2] holding cos + i sin of position * frequency (float32 parts).

    Complex, not a float32 (cos, sin) pair: the table reaches every block as a forward argument, and FSDP's
    mixed-precision policy casts floating-point arguments to the compute dtype (a bf16 table rotates late
    positions by visibly wrong angles) but leaves complex ones alone.
    """
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    if isinstance(scaling, YarnScaling) and scaling.attention_factor != 1.0:
        return torch.complex(angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor)
    return torch.complex(angles.cos(), angles.sin())


def rope_at(cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The rotary table's rows for ``positions`` [batch, seq] (one row per token), or the whole table."""
    return cache if positions is None else cache[positions]


def apply_rotary_emb(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by its positions 0..seq-1 of the table ``cache`` [max_seq, ...], or
    by one row per token when ``cache`` is [batch, seq, ...] (``rope_at``); computed in float32, returned in
    x.dtype.

    The head count is read from x, so tensor-parallel ranks holding a slice of the heads work unchanged.
    Each channel pair is multiplied as one complex number by the table: one kernel each way, where the
    real-valued form (a cos - b sin, a sin + b cos) costs four multiplies, two adds and two concatenations
    forward and again backward (measured 5x slower per call on CPU). Under torch.compile inductor leaves
    the complex multiply to its eager kernel; generating the real form into the neighbouring kernels
    instead measured no faster per step and added ~1 s (three C++ kernels) to every cold compile.
    """
    bsz, seqlen = x.shape[:2]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rows = cache.view(bsz, seqlen, 1, -1) if cache.dim() == 3 else cache[:seqlen].view(1, seqlen, 1, -1)
    return torch.view_as_real(pairs * rows).flatten(-2).type_as(x)


class RotaryEmbedding(nn.Module):
    """Owns the complex64 (cos + i sin) table as a non-persistent buffer that dtype casts cannot degrade.

    The table is derived state, so after every `_apply` (`.to(dtype)`, `.bfloat16()`, `.to(device)`,
    `to_empty`) it is recomputed on the buffer's new device instead of being cast: a bf16 table would
    rotate late positions by visibly wrong angles, and `to_empty` would leave it uninitialised.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RotaryScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        self.cache: torch.Tensor
        self.register_buffer("cache", self._compute(device=None), persistent=False)

    def _compute(self, device: torch.device | str | None) -> torch.Tensor:
        return rope_cache(self.head_dim, self.max_seq_len, self.theta, self.scaling, device)

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """Recompute the table on `device` (default: where it is now)."""
        self.cache = self._compute(self.cache.device if device is None else device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        # The table is recomputed, never converted: `.to(bfloat16)` would cast the complex table to a real
        # one (dropping the sines, with a warning). `fn` on an empty tensor says where the table now belongs.
        cache = self.cache
        del self._buffers["cache"]
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["cache"] = cache
        self.reset_cache(fn(torch.empty(0, device=cache.device)).device)
        return self

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, scaling={self.scaling}"
