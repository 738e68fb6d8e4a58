"""Routed experts between our 3-D weights and Hugging Face's layouts, for the MoE families' adapters.

We hold each layer's experts as w1 (gate), w3 (up) [E, hidden, dim] and w2 (down) [E, dim, hidden]. A HF
checkpoint holds one Linear per expert (``mlp.experts.<j>.gate_proj.weight`` ...), which every transformers
version and serving stack reads; a live transformers 5 model holds them fused (``mlp.experts.gate_up_proj``
[E, 2 * hidden, dim] with the gate rows first, ``mlp.experts.down_proj``). ``to_hf`` writes the per-expert
layout; ``from_hf`` accepts both.
"""
from __future__ import annotations

import re

import torch

EXPERT_WEIGHTS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
"""Our block-relative expert weights -> HF's per-expert Linear names."""
HF_EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
HF_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def experts_to_hf(hf_prefix: str, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert weight of ours (``name`` in EXPERT_WEIGHTS) -> HF's per-expert tensors under ``hf_prefix``
    (``model.layers.<i>.``). Clones: slices of one tensor share storage, which safetensors refuses to write."""
    return {f"{hf_prefix}mlp.experts.{j}.{EXPERT_WEIGHTS[name]}.weight": tensor[j].clone()
            for j in range(tensor.shape[0])}


def split_fused(name: str, tensor: torch.Tensor, hidden_dim: int, hf_key: str) -> dict[str, torch.Tensor]:
    """transformers 5's fused ``name`` (one of HF_FUSED) -> our block-relative expert weights."""
    if name == "mlp.experts.down_proj":
        return {"moe.experts.w2": tensor}
    if tensor.dim() != 3 or tensor.shape[1] != 2 * hidden_dim:
        raise ValueError(f"{hf_key} has shape {tuple(tensor.shape)}, expected (num_experts, {2 * hidden_dim}, dim) "
                         "for these model args; the checkpoint was saved from a different flavor")
    # transformers 5 computes gate, up = (x @ gate_up_proj[e].T).chunk(2): gate rows first.
    return {"moe.experts.w1": tensor[:, :hidden_dim], "moe.experts.w3": tensor[:, hidden_dim:]}


class PerExpertCollector:
    """Gathers HF's per-expert tensors of every layer, then stacks each weight into our [E, ...] tensor."""

    _OURS = {hf: ours for ours, hf in EXPERT_WEIGHTS.items()}

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._parts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def add(self, layer: int, match: re.Match[str], tensor: torch.Tensor) -> None:
        """``match``: HF_EXPERT_KEY on the layer-relative HF name."""
        self._parts.setdefault((layer, self._OURS[match.group(2)]), {})[int(match.group(1))] = tensor

    def stacked(self) -> dict[str, torch.Tensor]:
        """layers.<i>.moe.experts.w* -> the stacked tensors; KeyError naming any expert missing."""
        out = {}
        for (i, name), experts in self._parts.items():
            if sorted(experts) != list(range(self.num_experts)):
                missing = sorted(set(range(self.num_experts)) - set(experts))
                raise KeyError(f"layer {i} {EXPERT_WEIGHTS[name]}: experts {missing[:5]} are missing or numbered beyond "
                               f"num_experts={self.num_experts}; the checkpoint does not match the flavor")
            out[f"layers.{i}.{name}"] = torch.stack([experts[j] for j in range(self.num_experts)])
        return out
