"""Rotary layout of q / k projections between our checkpoints and Hugging Face's.

Our rotary embedding pairs channels (2i, 2i+1) of each head (Meta's original convention); HF's pairs
channel i with i + head_dim/2 ("rotate_half"). Permuting the output rows of wq and wk, head by head, from
[pairs, 2] to [2, pairs] order makes HF's rotary produce the same attention scores as ours; v and o are
untouched because the permutation of q and k cancels in q . k.
"""
from __future__ import annotations

import torch


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved-pair order to HF's rotate_half order (per head)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of permute_to_hf."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
