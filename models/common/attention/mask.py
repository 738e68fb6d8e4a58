"""The attention mask of a sequence's layout: each query sees the keys at or before it in its own document.

``Decoder.forward`` builds the mask once per forward from the keyword tensors of
torchtitan_lite/components/data/sequence_layout.py (window index and document of every query and key) and
hands it to every block. Without them the model passes no mask and attends with SDPA's ``is_causal``, which is
the same function of the plain causal window.

The mask takes the form the device's kernel reads: on CPU a dense additive float32 [B, 1, s, S] for SDPA (0 where
a query sees a key, -inf elsewhere); on CUDA a FlexAttention ``BlockMask``, which skips the key blocks no query of
a block sees (a window of many short documents computes a fraction of the causal pairs).

Additive float32 rather than boolean: SDPA turns a boolean mask into that float form inside every call and saves
the copy for backward, one per layer (4 bytes per pair each); built once here, every layer reads and saves the
same tensor. CPU attention always computes in float32 (models/common/attention/grouped_query.py), so the dtype
matches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Mask = Union[torch.Tensor, "BlockMask"]
"""A dense additive float32 [B, 1, s, S] mask or a FlexAttention BlockMask (flex is imported only where one is
built)."""


def build_mask(q_index: torch.Tensor, kv_index: torch.Tensor, q_doc: torch.Tensor | None = None,
               kv_doc: torch.Tensor | None = None, *, kind: str | None = None) -> Mask:
    """The allowed (query, key) pairs: ``kv_index <= q_index`` and, with documents, ``kv_doc == q_doc``.

    ``kind``: "dense" or "flex"; by default flex on CUDA, dense elsewhere."""
    kind = kind or ("flex" if q_index.device.type == "cuda" else "dense")
    if kind == "dense":
        allowed = kv_index[:, None, :] <= q_index[:, :, None]
        if q_doc is not None and kv_doc is not None:
            allowed = allowed & (kv_doc[:, None, :] == q_doc[:, :, None])
        additive = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        return additive.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed_pair(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        causal = kv_index[b, k] <= q_index[b, q]
        return causal if q_doc is None or kv_doc is None else causal & (kv_doc[b, k] == q_doc[b, q])

    bsz, s, total = q_index.shape[0], q_index.shape[1], kv_index.shape[1]
    return create_block_mask(allowed_pair, bsz, None, s, total, device=q_index.device)
