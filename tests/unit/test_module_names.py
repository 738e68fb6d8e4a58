"""One rule looks through the activation-checkpoint and compile wrappers, for the names torch really gives them."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchtitan_lite.protocols.module_names import checkpointed, named_submodules, submodule, unwrapped, unwrapped_name


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = nn.Module()
        self.moe.experts = nn.Linear(2, 2)


def _wrapped_model() -> tuple[nn.ModuleDict, nn.Module]:
    """layers.0 checkpointed then compiled (wrapper objects, no graph is built), layers.1 plain."""
    inner = _Block()
    layers = nn.ModuleDict({"0": torch.compile(checkpoint_wrapper(inner)), "1": _Block()})
    return nn.ModuleDict({"layers": layers}), inner


def test_the_names_torch_gives_lose_their_wrapper_components():
    model, _ = _wrapped_model()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["layers.0._orig_mod._checkpoint_wrapped_module.moe.experts.weight",
                     "layers.0._orig_mod._checkpoint_wrapped_module.moe.experts.bias",
                     "layers.1.moe.experts.weight", "layers.1.moe.experts.bias"]
    assert [unwrapped_name(n) for n in names] == ["layers.0.moe.experts.weight", "layers.0.moe.experts.bias",
                                                  "layers.1.moe.experts.weight", "layers.1.moe.experts.bias"]
    # Only whole components go: a name that merely contains a wrapper's text keeps it.
    assert unwrapped_name("layers.0.my_orig_mod.w") == "layers.0.my_orig_mod.w"


def test_modules_are_found_by_their_unwrapped_names():
    model, inner = _wrapped_model()
    wrapped = model["layers"]["0"]
    assert unwrapped(wrapped) is inner and unwrapped(inner) is inner
    assert submodule(wrapped, "moe.experts") is inner.moe.experts
    assert named_submodules(wrapped)[""] is inner
    assert submodule(model["layers"]["1"], "moe.experts") is model["layers"]["1"].moe.experts
    assert submodule(wrapped, "moe.router") is None


def test_only_an_activation_checkpoint_wrapper_counts_as_checkpointed():
    inner = _Block()
    assert checkpointed(checkpoint_wrapper(inner))
    assert not checkpointed(inner)
    assert checkpointed(torch.compile(checkpoint_wrapper(_Block())))  # seen through compile's wrapper
