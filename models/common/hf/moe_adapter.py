"""What the MoE families' Hugging Face adapters share: the walk over both state dicts, the routed experts between
our stacked [E, ...] weights and HF's per-expert (or transformers 5's fused) layout (models/common/hf/experts.py),
the expert bias, tied embeddings, and the checks on names, shapes and completeness.

A family states only its names and what differs (``MoEStateDictAdapter``'s class attributes and hooks): the
block-relative renames, which names each block holds, their shapes, the router settings HF's model can express,
its config.json, and any rewrite of a tensor on the way (Qwen3-MoE's q/k rotary permutation).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch.distributed.tensor import DTensor

from models.common.hf import names as hf_names
from models.common.hf.experts import (
    EXPERT_WEIGHTS,
    HF_EXPERT_KEY,
    HF_FUSED,
    PerExpertCollector,
    experts_to_hf,
    split_fused,
)
from models.common.moe.layer import MoEArgs

EXPERT_BIAS = "moe.expert_bias"
"""The MoE layer's expert-bias buffer (a state-dict key; block-relative)."""


class MoEAdapterArgs(Protocol):
    """What the shared conversion reads of a family's model args."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def moe(self) -> MoEArgs: ...


ArgsT = TypeVar("ArgsT", bound=MoEAdapterArgs)


class MoEStateDictAdapter(ABC, Generic[ArgsT]):
    """Renames and splits / stacks experts between our full state dict and HF's. Tensors must be whole: gather
    DTensor-sharded state (get_model_state_dict with full_state_dict=True) first."""

    family: ClassVar[str]
    """The family's name in messages ('Qwen3-MoE')."""
    hf_class: ClassVar[str]
    """HF's model class ('Qwen3MoeForCausalLM')."""
    hf_router: ClassVar[str]
    """What HF's model has, for the refusal of args it cannot express ('a softmax router without ...')."""
    per_layer: ClassVar[dict[str, str]]
    """Block-relative renames, ours -> HF's, of every block weight but the routed experts (and an expert bias
    that HF's model lacks: it must be zero on export, and is zero on import)."""
    layer_hint: ClassVar[str] = ""
    """Appended to the refusal of a key outside the model's layers."""

    def __init__(self, args: ArgsT) -> None:
        self.args = args
        self._from_hf_names = {hf: ours for ours, hf in self.per_layer.items()}

    # -- what a family states --------------------------------------------------------------------------

    @abstractmethod
    def _hf_requires(self) -> tuple[tuple[str, object, object], ...]:
        """(setting as shown, our value, the value HF's model has) for what HF's model cannot change."""
        ...

    @abstractmethod
    def _hf_config(self, **kwargs: Any) -> dict[str, Any]:
        """The family's config.json content for these args."""
        ...

    @abstractmethod
    def _block_names(self, layer: int) -> list[str]:
        """The block-relative state-dict names of block ``layer``, in module order."""
        ...

    @abstractmethod
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each top-level and block-relative name (the routed experts' included)."""
        ...

    def _to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A renamed block weight (``name`` ours) as HF holds it; as is by default."""
        return tensor

    def _from_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A renamed block weight from HF's (``name`` ours) as we hold it; as is by default."""
        return tensor

    def _misplaced(self, key: str, shown_as: str, layer: int) -> Exception:
        """The refusal of ``key`` (ours; ``shown_as`` in the message), a name block ``layer`` does not hold."""
        return KeyError(f"no Hugging Face name for {shown_as!r}: not a {self.family} weight")

    def _check_expert_layer(self, layer: int, hf_key: str) -> None:
        """Refuse HF's per-expert ``hf_key`` where block ``layer`` has no routed experts; all have by default."""

    # -- shared ----------------------------------------------------------------------------------------

    def _check_representable(self) -> None:
        unsupported = [f"{name}={value!r}" for name, value, hf in self._hf_requires() if value != hf]
        if unsupported:
            raise ValueError(f"{self.hf_class} has {self.hf_router}, but these model args set "
                             f"{', '.join(unsupported)}; such a model has no Hugging Face {self.family} form")

    def hf_config_dict(self, **kwargs: Any) -> dict[str, Any]:
        self._check_representable()
        return self._hf_config(**kwargs)

    def our_keys(self) -> list[str]:
        """Every key of the family's model state_dict(), tied output included (block by block)."""
        keys = ["tok_embeddings.weight"]
        for i in range(self.args.n_layers):
            keys += [f"layers.{i}.{name}" for name in self._block_names(i)]
        return keys + ["norm.weight", "output.weight"]

    def _moe_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the MoE layer's weights (block-relative): router, expert bias, routed and shared experts."""
        dim, m = self.args.dim, self.args.moe
        shared = m.num_shared_experts * m.hidden_dim
        return {
            "moe.router.gate.weight": (m.num_experts, dim),
            EXPERT_BIAS: (m.num_experts,),
            "moe.experts.w1": (m.num_experts, m.hidden_dim, dim),
            "moe.experts.w3": (m.num_experts, m.hidden_dim, dim),
            "moe.experts.w2": (m.num_experts, dim, m.hidden_dim),
            "moe.shared_experts.w1.weight": (shared, dim),
            "moe.shared_experts.w3.weight": (shared, dim),
            "moe.shared_experts.w2.weight": (dim, shared),
        }

    def _checked(self, key: str, tensor: torch.Tensor, shown_as: str) -> torch.Tensor:
        """``tensor`` when it is whole, ``key`` (ours) belongs in its block and the shape matches."""
        if isinstance(tensor, DTensor):
            raise TypeError(f"{shown_as} is a DTensor: gather a full state dict before converting")
        layer = hf_names.OUR_LAYER_KEY.match(key)
        if layer is not None and hf_names.block_name(key) not in self._block_names(int(layer.group(1))):
            raise self._misplaced(key, shown_as, int(layer.group(1)))
        return hf_names.check_shape(tensor, self._shapes()[hf_names.block_name(key)], shown_as)

    def _layer(self, match: re.Match[str] | None, key: str, kind: str) -> tuple[int, str]:
        if match is None or int(match.group(1)) >= self.args.n_layers:
            raise KeyError(f"unexpected {kind} key {key!r} for a {self.args.n_layers}-layer {self.family} model; "
                           f"check that the checkpoint matches the flavor{self.layer_hint}")
        return int(match.group(1)), match.group(2)

    # -- conversions -----------------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Our names -> HF's per-expert checkpoint layout. A tied model writes no lm_head.weight. An expert bias
        without an HF name must be zero (else the export would change which experts the model picks)."""
        self._check_representable()
        tied = self.args.tie_word_embeddings
        if strict:
            expected = [k for k in self.our_keys() if not (tied and k == "output.weight")]
            hf_names.check_complete(set(state_dict), expected, "state dict", names=" (our names)")
        hf: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            if key in hf_names.TOP_LEVEL:
                if not (tied and key == "output.weight"):
                    hf[hf_names.TOP_LEVEL[key]] = self._checked(key, tensor, key)
                continue
            i, name = self._layer(hf_names.OUR_LAYER_KEY.match(key), key, "state dict")
            tensor = self._checked(key, tensor, key)
            prefix = f"model.layers.{i}."
            if name in EXPERT_WEIGHTS:
                hf.update(experts_to_hf(prefix, name, tensor))
            elif name in self.per_layer:
                hf[prefix + self.per_layer[name]] = self._to_hf_tensor(name, tensor)
            elif name == EXPERT_BIAS:
                if bool(tensor.ne(0).any()):
                    raise ValueError(f"{key} is not zero: Hugging Face {self.family} has no expert bias, so the "
                                     "exported model would route differently; export a model trained with "
                                     "bias_update_rate=0")
            else:
                raise self._misplaced(key, key, i)
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> dict[str, torch.Tensor]:
        """HF names (per-expert or transformers 5's fused experts) -> ours; an expert bias without an HF name is
        set to zero. With tied embeddings output.weight maps to the embedding tensor; a saved lm_head.weight must
        equal it."""
        self._check_representable()
        tied = self.args.tie_word_embeddings
        ours: dict[str, torch.Tensor] = {}
        experts = PerExpertCollector(self.args.moe.num_experts)
        lm_head = None
        for hf_key, tensor in hf_state_dict.items():
            top = next((k for k, v in hf_names.TOP_LEVEL.items() if v == hf_key), None)
            if top is not None:
                if top == "output.weight" and tied:
                    lm_head = tensor
                else:
                    ours[top] = self._checked(top, tensor, hf_key)
                continue
            i, name = self._layer(hf_names.HF_LAYER_KEY.match(hf_key), hf_key, "Hugging Face")
            prefix = f"layers.{i}."
            ours_name = self._from_hf_names.get(name)
            expert = HF_EXPERT_KEY.match(name)
            if ours_name is not None:
                ours[prefix + ours_name] = self._from_hf_tensor(
                    ours_name, self._checked(prefix + ours_name, tensor, hf_key))
            elif expert is not None:
                self._check_expert_layer(i, hf_key)
                experts.add(i, expert, tensor)
            elif name in HF_FUSED:
                for part, value in split_fused(name, tensor, self.args.moe.hidden_dim, hf_key).items():
                    ours[prefix + part] = self._checked(prefix + part, value, hf_key)
            else:
                raise KeyError(f"unexpected Hugging Face key {hf_key!r} for a {self.family} model")
        for key, tensor in experts.stacked().items():
            ours[key] = self._checked(key, tensor, key)
        if EXPERT_BIAS not in self.per_layer:
            for i in {int(k.split(".")[1]) for k in ours if k.startswith("layers.")}:
                if EXPERT_BIAS in self._block_names(i):
                    ours[f"layers.{i}.{EXPERT_BIAS}"] = torch.zeros(self.args.moe.num_experts, dtype=torch.float32)
        if tied:
            hf_names.tie_output(ours, lm_head)
        if strict:
            hf_names.check_complete(set(ours), self.our_keys(), "Hugging Face state dict", names=" (our names)")
        return ours
