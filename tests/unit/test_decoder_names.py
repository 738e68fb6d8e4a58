"""Every family's parallel plan names the decoder's parts as the skeleton registers them: the core finds the blocks,
the embedding, the final norm and the output projection through the plan alone."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import build_model_args, get_model_spec
from models.common.decoder_names import BLOCKS
from torchtitan_lite.protocols.model_size import param_counts

FAMILIES = ("llama3", "qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_names_the_parts_the_model_registers(family):
    spec = get_model_spec(family)
    plan = spec.parallel_plan
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, "debug", n_layers=2, vocab_size=512))
    blocks = getattr(model, plan.blocks)
    assert isinstance(blocks, nn.ModuleDict) and list(blocks) == ["0", "1"]
    assert plan.blocks == BLOCKS
    assert isinstance(model.get_submodule(plan.embedding), nn.Embedding)
    assert isinstance(model.get_submodule(plan.output), nn.Linear)
    assert model.get_submodule(plan.final_norm) is not None
    # The decoder counts its parameters with the names the plan gives everyone else.
    assert model.param_counts() == param_counts(model, model.moe_facts(), blocks=plan.blocks,
                                                embedding=plan.embedding)
