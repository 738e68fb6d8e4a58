"""Whether a forward is an activation-checkpointing recomputation (run by autograd during backward)."""
from __future__ import annotations

import torch


def recomputing() -> bool:
    """True while autograd runs a backward pass, i.e. when activation checkpointing recomputes this forward:
    what the original forward recorded (the MoE loads and balance loss, the expert-parallel exchanges) must
    not be recorded or communicated again. A compiled region never re-runs its Python forward (the compiled
    backward recomputes inside the graph)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
