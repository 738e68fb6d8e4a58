"""The training loss: summed token cross-entropy, so the loop can normalise by the global token count.

Gradient accumulation and data parallelism divide the loss by the number of target tokens of the whole
optimizer step (summed over micro-batches and ranks), which only a per-micro-batch *sum* allows; a
per-micro-batch mean would weight short and long micro-batches equally.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value that contributes neither loss nor a token to the count."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``logits`` [B, S, V] against ``labels`` [B, S], computed in float32.

    Returns ``(loss_sum, n_tokens)``: a float32 scalar and an int64 scalar counting labels that are
    not ``IGNORE_INDEX``. Low-precision logits are upcast first because log-softmax over a large
    vocabulary loses most of its accuracy in bf16/fp16. Works on vocab-sharded DTensor logits inside
    ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    n_tokens = (labels != IGNORE_INDEX).sum()
    return loss_sum, n_tokens
