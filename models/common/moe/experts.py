"""Routed experts held as 3-D weights, one SwiGLU per expert, computed as grouped GEMMs.

Weights follow nn.Linear's (out, in) layout per expert, stacked on dim 0: w1, w3 [E, hidden, dim] and
w2 [E, dim, hidden]. Each slice is the weight an HF per-expert Linear holds, and dim 0 is the one that
expert parallelism shards: under EP the parameters are DTensors sharded on dim 0 over the EP ranks, and
the forward computes with this rank's slice (the counts then cover the local experts only).

``GroupedExperts.grouped_mm`` is the single GEMM primitive of the grouped path: a low-precision
converter (FP8 rowwise, MXFP8, their emulation) replaces that one method and inherits everything else.
``loop_forward`` is the per-expert reference it must match.

Under tensor parallelism the weights are DTensors split along the hidden dim (expert tensor parallelism,
torchtitan_lite/distributed/expert_tensor_parallel.py); the GEMMs run on the local slices, which is the same
SwiGLU on a slice of the hidden channels, and the output is this rank's partial sum.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.init import trunc_normal_

GROUPED_MM_ALIGN_BYTES = 16
"""torch._grouped_mm needs every operand stride to be a multiple of 16 bytes: dim and hidden must be
multiples of 16 / element size (8 in bf16, 4 in float32)."""


class GroupedExperts(nn.Module):
    """x [N, dim] sorted by expert with ``counts`` [E] tokens per expert -> [N, dim] (same order)."""

    grouped_gemm_weights: ClassVar[tuple[str, ...]] = ("w1", "w3", "w2")
    """The 3-D weights, one grouped GEMM each (torchtitan_lite.protocols.grouped_experts)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True) -> None:
        super().__init__()
        if use_grouped_mm and (dim % 8 or hidden_dim % 8):
            raise ValueError(
                f"grouped experts need dim={dim} and hidden_dim={hidden_dim} to be multiples of 8 (torch._grouped_mm "
                f"requires {GROUPED_MM_ALIGN_BYTES}-byte aligned strides in bf16); round them up, or set "
                "use_grouped_mm=False to run the per-expert loop")
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, out_proj_std: float) -> None:
        trunc_normal_(self.w1, std=0.02)
        trunc_normal_(self.w2, std=out_proj_std)
        trunc_normal_(self.w3, std=out_proj_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm:
            return self.grouped_forward(x, counts)
        return self.loop_forward(x, counts)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of what this rank computes: the whole tensors, or the local slices of the DTensors
        that expert parallelism (expert dim) or tensor parallelism (hidden dim) made them (differentiable: the
        gradient lands in that slice)."""
        return _local(self.w1), _local(self.w2), _local(self.w3)

    def grouped_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.local_weights()
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(self.grouped_mm(x, w1.transpose(-2, -1), offsets))
        h = h * self.grouped_mm(x, w3.transpose(-2, -1), offsets)
        return self.grouped_mm(h, w2.transpose(-2, -1), offsets)

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ w [E, in, out] per group: rows offsets[e-1]:offsets[e] use expert e (int32 cumulative
        ends, last == N). The method a low-precision converter replaces.

        Autocast does not cover torch._grouped_mm, so the operands are cast to the autocast dtype here, as
        F.linear would be; FSDP's mixed precision has already cast the weights.
        """
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        return torch._grouped_mm(x.to(dtype), w.to(dtype), offs=offsets)

    def loop_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reference: one F.linear SwiGLU per expert over its slice of rows. An expert without tokens runs on
        zero rows, which keeps every weight in the graph (with a zero gradient) however the tokens fall."""
        w1, w2, w3 = self.local_weights()
        outputs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                   for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0))]
        return torch.cat(outputs, dim=0)

    def extra_repr(self) -> str:
        e, hidden, dim = self.w1.shape
        return f"num_experts={e}, dim={dim}, hidden_dim={hidden}, use_grouped_mm={self.use_grouped_mm}"


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
