"""Record the collectives a piece of code issues, with the dtype and byte size of what each one sends."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_COLLECTIVES = frozenset({
    "all_to_all_single",
    "_allgather_base_", "allgather_", "all_gather_into_tensor", "allreduce_", "all_reduce",
    "_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor", "broadcast_", "broadcast",
})


@dataclass(frozen=True)
class Call:
    op: str
    """Op name without namespace and overload, e.g. '_allgather_base_', 'allreduce_', 'all_gather_into_tensor'."""
    dtype: torch.dtype
    """dtype of the tensor handed to the backend."""
    numel: int
    nbytes: int


class CollectiveLog(TorchDispatchMode):
    """Every c10d / functional collective dispatched while active, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses; stepping aside for DTensor and the float8 wrappers lets them
        # lower the op into the collectives (on plain tensors) that actually run, which then come back here.
        if any(hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES and func._opname in _COLLECTIVES:
            for t in _sent_tensors(func, args):
                self.calls.append(Call(func._opname, t.dtype, t.numel(), t.numel() * t.element_size()))
        return func(*args, **kwargs)

    def of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]


def _sent_tensors(func, args) -> list[torch.Tensor]:
    if func._opname == "_allgather_base_":  # (output, input, group, ...)
        return [args[1]]
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    if isinstance(first, (list, tuple)):
        return [t for t in first if isinstance(t, torch.Tensor)]
    return []
