"""The model layout both trainers must share: parameter count and every Linear's kind and shape.

Our side is read off our model as the trainer builds it (meta device, converters applied); torchtitan's is
printed from inside its process by the generated config module. Names differ between the two code bases
(``attention.wq`` vs ``attention.qkv_linear.wq``, ``output`` vs ``lm_head``), so Linears are compared
as a multiset of (kind, in_features, out_features), kind being 'float8' or 'linear'.
"""
from __future__ import annotations

from collections import Counter
from typing import Any


def linear_kind(class_name: str) -> str:
    return "float8" if "Float8" in class_name else "linear"


def normalise(layout: dict[str, Any]) -> dict[str, Any]:
    """``{"params": n, "linears": [[class name, in, out], ...]}`` with class names reduced to kinds, sorted."""
    linears = sorted((linear_kind(name), int(i), int(o)) for name, i, o in layout["linears"])
    return {"params": int(layout["params"]), "linears": linears}


def our_layout(run: Any) -> dict[str, Any]:
    """Our model's layout for the resolved run: built on meta and converted, as the trainer does before parallelizing."""
    import torch
    from torch import nn

    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    run.converters.convert(model)
    linears = [[type(m).__name__, m.in_features, m.out_features] for m in model.modules() if isinstance(m, nn.Linear)]
    return normalise({"params": model.num_params(), "linears": linears})


def describe(layout: dict[str, Any]) -> str:
    """'57,… parameters, 43 Linears (36 float8)' style summary."""
    linears = layout["linears"]
    float8 = sum(1 for kind, _, _ in linears if kind == "float8")
    return (f"{layout['params']:,} parameters, {len(linears)} Linears"
            + (f" ({float8} float8)" if float8 else ""))


def layout_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why the two layouts differ, or None when they are the same."""
    if ours == theirs:
        return None
    problems = []
    if ours["params"] != theirs["params"]:
        problems.append(f"parameters: torchtitan_lite {ours['params']:,}, torchtitan {theirs['params']:,}")
    mine, other = Counter(map(tuple, ours["linears"])), Counter(map(tuple, theirs["linears"]))
    only_ours, only_theirs = mine - other, other - mine
    if only_ours or only_theirs:
        problems.append(f"Linears (kind, in, out) only in torchtitan_lite: {sorted(only_ours.elements())}; only in "
                        f"torchtitan: {sorted(only_theirs.elements())} ({len(ours['linears'])} vs "
                        f"{len(theirs['linears'])} Linears)")
    return "; ".join(problems)
