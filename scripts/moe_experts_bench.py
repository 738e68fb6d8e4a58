"""Routed experts forward + backward: grouped GEMMs against the per-expert loop, the MoE layer and the qwen3_moe
debug model (optionally torchtitan's beside them); logic in torchtitan_lite.tools.moe_experts_bench, the model
parts built here (the tools package does not import the models)."""
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
from models.common.moe.experts import GroupedExperts  # noqa: E402
from models.common.moe.layer import MoE  # noqa: E402
from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel  # noqa: E402
from torchtitan_lite.tools.moe_experts_bench import Shape, main  # noqa: E402

DEBUG = QWEN3_MOE_FLAVORS["debug"]


def build_experts(shape: Shape, use_grouped_mm: bool) -> GroupedExperts:
    experts = GroupedExperts(shape.dim, shape.hidden_dim, shape.num_experts, use_grouped_mm=use_grouped_mm)
    experts.init_weights(out_proj_std=0.02)
    return experts


def build_layer(shape: Shape) -> MoE:
    """The debug flavor's router (softmax, normalised top-k, balance loss 1e-3) at the shape's sizes."""
    import dataclasses

    args = dataclasses.replace(DEBUG.moe, num_experts=shape.num_experts, top_k=shape.top_k, hidden_dim=shape.hidden_dim)
    layer = MoE(shape.dim, args)
    layer.init_weights(out_proj_std=0.02)
    return layer.train()


def build_model() -> tuple[Qwen3MoeModel, int]:
    model = Qwen3MoeModel(DEBUG)
    model.init_weights()
    return model.train(), DEBUG.vocab_size


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], experts=build_experts, layer=build_layer, model=build_model))
