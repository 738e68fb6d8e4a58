"""Adapters that turn the trainer's objects into checkpointable state.

``ModelWrapper`` gives the model state of one or more model parts in any layout (plain, FSDP2, TP)
with every tensor a plain ``torch.Tensor`` or a ``DTensor`` over one: float8 training wrappers
(torchao's ``WeightWithDynamicFloat8CastTensor``) and other tensor subclasses are unwrapped, so a
saved checkpoint loads with ``weights_only=True`` and into a model without float8 conversion.

``PerRankState`` stores state that differs per rank and is not a sharded tensor (data loader
position, random number generators) as one serialized byte tensor under a rank-unique key.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


class ModelWrapper(Stateful):
    def __init__(self, model_parts: nn.Module | Sequence[nn.Module]) -> None:
        self.model_parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            for key, value in get_model_state_dict(part).items():
                state[key] = plain_tensor(key, value)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part (a pipeline stage) gets exactly its own keys and must take all of them: a key absent for
        # one stage is an error, not a weight left at its initial value. That every key of the checkpoint is
        # loaded by some stage is checked across the ranks before (key_accounting.py).
        for index, part in enumerate(self.model_parts):
            own = get_model_state_dict(part).keys()
            missing = sorted(own - state_dict.keys())
            if missing:
                raise KeyError(f"model part {index} holds {len(missing)} key(s) the loaded state lacks, first "
                               f"{missing[:5]}")
            set_model_state_dict(part, {k: state_dict[k] for k in own}, options=StateDictOptions(strict=True))


def plain_tensor(key: str, value: Any) -> Any:
    """``value`` with tensor subclasses other than DTensor removed (DTensor locals included)."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        local = value.to_local()
        inner = _unwrap(key, local)
        if inner is local:
            return value
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return _unwrap(key, value)


def _unwrap(key: str, t: torch.Tensor) -> torch.Tensor:
    if type(t) in (torch.Tensor, nn.Parameter):
        return t.detach() if isinstance(t, nn.Parameter) else t
    if not hasattr(t, "__tensor_flatten__"):
        raise TypeError(f"model state {key!r} is a {type(t).__name__}, a tensor subclass the checkpoint "
                        f"cannot reduce to a plain tensor; convert it before saving")
    # Wrapper subclasses keep the real data in the inner tensor of the same shape (float8 training
    # weights call it "_tensor"; a precomputed scale is a second, scalar inner tensor).
    names, _ = t.__tensor_flatten__()
    candidates = [getattr(t, name) for name in names if getattr(t, name).shape == t.shape]
    if len(candidates) != 1:
        raise TypeError(f"model state {key!r} is a {type(t).__name__} whose data tensor is ambiguous "
                        f"(inner tensors {names}); cannot save it as a plain tensor")
    return _unwrap(key, candidates[0])


PER_RANK_STATES = ("dataloader", "train_state", "spike_guard")
"""States that are not sharded tensors; each rank saves and restores its own copy (the data position and
RNGs differ per rank; the spike guard's statistics are the same on every rank but vary in size)."""


class PerRankState(Stateful):
    """One rank's copy of a ``Stateful`` stored as ``{f"rank{r}": uint8 tensor}``.

    Serialising with ``torch.save`` keeps any structure the inner object returns, and reading it back
    with ``torch.load(weights_only=True)`` keeps loading free of arbitrary code execution.
    """

    def __init__(self, inner: Stateful, rank: int) -> None:
        self.inner = inner
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.key: encode(self.inner.state_dict())}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(decode(state_dict[self.key]))


def encode(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
