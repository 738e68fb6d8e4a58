"""Module names as the model built them, looked through the wrappers activation checkpointing and compile insert.

``checkpoint_wrapper`` holds a block as its ``_checkpoint_wrapped_module`` and ``torch.compile(module)`` as its
``_orig_mod``, so a wrapped block's parameters and submodules gain that name component (``layers.3.
_checkpoint_wrapped_module.moe``). Whatever names a part of the model by the name the family gave it (the plan's
block-relative names, MoE facts, router and FP8 statistics tags) looks through them here, with this one rule.
Plain ``torch.nn`` only, so the models and the core can both import it.
"""
from __future__ import annotations

from torch import nn

CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module"
"""The attribute under which torch's ``checkpoint_wrapper`` holds the module it checkpoints."""

WRAPPERS = (CHECKPOINT_WRAPPER, "_orig_mod")
"""Name components that wrappers insert: activation checkpointing's, then ``torch.compile``'s ``OptimizedModule``."""


def unwrapped_name(name: str) -> str:
    """``name`` (a dotted module or parameter name) without its wrapper components:
    'layers.3._checkpoint_wrapped_module.moe.experts' -> 'layers.3.moe.experts'."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside ``module``'s wrappers (``module`` itself when it has none)."""
    while True:
        inner = next((m for name, m in module.named_children() if name in WRAPPERS), None)
        if inner is None:
            return module
        module = inner


def checkpointed(module: nn.Module) -> bool:
    """``module`` is an activation-checkpoint wrapper (its forward is recomputed in backward)."""
    return hasattr(module, CHECKPOINT_WRAPPER)


def named_submodules(module: nn.Module) -> dict[str, nn.Module]:
    """``module``'s submodules by their unwrapped names relative to it ('' is the unwrapped module itself)."""
    return {unwrapped_name(name): m for name, m in module.named_modules()}


def submodule(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule of ``module`` whose unwrapped name relative to it is ``name``; None when it has none."""
    return named_submodules(module).get(name)
