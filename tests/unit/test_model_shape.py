"""Every family's args provide the shape the core reads (protocols/model_shape.py), and the one training-FLOPs
formula (protocols/model_size.py) reads the value heads' width from it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import models  # noqa: F401  (registers the model families)
from torchtitan_lite.protocols.model_shape import ModelShape
from torchtitan_lite.protocols.model_size import ParamCounts, attention_flops_per_token, training_flops_per_token
from torchtitan_lite.protocols.model_spec import build_model_args, model_specs

INTS = ("dim", "n_layers", "n_heads", "kv_heads", "head_dim", "v_head_dim", "vocab_size", "max_seq_len")
FLAVORS = [(name, flavor) for name, spec in sorted(model_specs().items()) for flavor in spec.flavors]


@pytest.mark.parametrize("family, flavor", FLAVORS)
def test_every_flavor_has_the_shape_the_core_reads(family, flavor):
    shape: ModelShape = build_model_args(model_specs()[family], flavor)
    for name in INTS:
        value = getattr(shape, name)
        assert isinstance(value, int) and value > 0, (name, value)
    assert shape.n_heads % shape.kv_heads == 0
    assert isinstance(shape.ffn_hidden_dim, int) and shape.ffn_hidden_dim >= 0
    assert isinstance(shape.tie_word_embeddings, bool)


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_the_dense_feed_forward_width_is_the_built_blocks(family):
    """ffn_hidden_dim is the width of the dense blocks the model builds (0 when it has none): not an MoE
    block's active width, which the estimate reads from the MoE facts."""
    spec = model_specs()[family]
    args = build_model_args(spec, "debug")
    with torch.device("meta"):
        model = spec.model_cls(args)
    widths = {block.feed_forward.w1.out_features for block in model.layers.values() if hasattr(block, "feed_forward")}
    assert widths == ({args.ffn_hidden_dim} if args.ffn_hidden_dim else set())


def test_training_flops_count_the_scores_over_head_dim_and_the_values_over_v_head_dim():
    counts = ParamCounts(total=20, active=15, routed_experts=0, embedding_lookup=5)
    shape = SimpleNamespace(n_layers=2, n_heads=4, head_dim=3, v_head_dim=1)
    # 6 x 10 active matmul parameters + 6 x 2 layers x 4 heads x (3 + 1) x seq 5.
    assert training_flops_per_token(counts, shape, 5) == 60 + 960
    equal = SimpleNamespace(n_layers=2, n_heads=4, head_dim=3, v_head_dim=3)
    assert training_flops_per_token(counts, equal, 5) == 60 + 12 * 2 * 4 * 3 * 5


def test_the_attention_part_is_what_the_window_length_adds():
    # MFU scales this part by a document mask's share: it must be exactly the seq_len-dependent term.
    counts = ParamCounts(total=20, active=15, routed_experts=0, embedding_lookup=5)
    shape = SimpleNamespace(n_layers=2, n_heads=4, head_dim=3, v_head_dim=1)
    assert attention_flops_per_token(shape, 5) == 6 * 2 * 4 * (3 + 1) * 5
    assert attention_flops_per_token(shape, 5) == \
        training_flops_per_token(counts, shape, 5) - training_flops_per_token(counts, shape, 0)
