"""torchao 0.18's pure-torch reference quantizers of its blockwise FP8 training kernels
(``torchao/prototype/blockwise_fp8_training/kernels.py``: ``torch_blockwise_scale_act_quant_lhs`` / ``_rhs`` and
``torch_blockwise_scale_weight_quant``), loaded from the installed source without importing that module: it imports
triton at the top, which CPU-only environments lack. The functions run as torchao wrote them; only their module's
constants (EPS, FP8_E4M3_DTYPES) and imports are supplied."""
from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

NAMES = ("torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
         "torch_blockwise_scale_weight_quant")


def load() -> dict[str, Callable[..., Any]]:
    spec = importlib.util.find_spec("torchao")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "prototype" / "blockwise_fp8_training" / "kernels.py"
    tree = ast.parse(source.read_text())
    constants = {"EPS", "FP8_E4M3_DTYPES"}
    body = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in NAMES)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in constants for t in node.targets))]
    found = {getattr(node, "name", None) for node in body} | {
        t.id for node in body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    assert found >= set(NAMES) | constants, f"torchao's kernels.py no longer defines {set(NAMES) - found}"
    namespace: dict[str, Any] = {"torch": torch, "Tuple": tuple, "e4m3_dtype": torch.float8_e4m3fn}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), namespace)  # noqa: S102
    assert namespace["EPS"] == 1e-12
    return {name: namespace[name] for name in NAMES}
