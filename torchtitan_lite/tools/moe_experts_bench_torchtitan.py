"""torchtitan's side of scripts/moe_experts_bench.py: its MoE layer and its Qwen3 MoE model (torchtitan 0.3.0)
at our shapes, timed by the same steps. Runs inside torchtitan's environment (scripts/_torchtitan_cpu.py
moe-bench SPEC_JSON) and prints its rows as one JSON line.

Built from torchtitan's own Qwen3 MoE builder (``_build_qwen3_moe_layers``: softmax router with normalised
top-k, no shared experts, QK-norm GQA, its expert-bias balancing on) with one substitution: its language-model
attention backends are FlexAttention, which has no CPU backward (``NotImplementedError: FlexAttention does not
support backward on CPU``), and varlen (CUDA); each block's inner attention is its ``ScaledDotProductAttention``
(causal), which our model runs too.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import torch
from torch import nn

from torchtitan_lite.tools.moe_experts_bench import Row, Shape, layer_step, median_tokens_per_s, model_step

# qwen3_moe debug flavor's non-expert shapes (models/qwen3_moe/flavors.py).
N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, VOCAB_SIZE, ROPE_THETA = 4, 4, 2, 32, 2048, 1000000.0


def build_model(shape: Shape, n_layers: int = N_LAYERS) -> nn.Module:
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention.grouped_query import ScaledDotProductAttention
    from torchtitan.models.common.attention.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    layers = _build_qwen3_moe_layers(
        n_layers=n_layers, dim=shape.dim, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM,
        moe_hidden_dim=shape.hidden_dim, num_experts=shape.num_experts, top_k=shape.top_k, attn_backend="flex",
        moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=2048, theta=ROPE_THETA))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Qwen3Model.Config(
        vocab_size=VOCAB_SIZE, dim=shape.dim, norm=_qwen3_norm(shape.dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB_SIZE, embedding_dim=shape.dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=shape.dim, out_features=VOCAB_SIZE, param_init=_LINEAR_INIT), layers=layers)
    # As torchtitan's trainer builds it: on meta, then materialised and initialised.
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model.train()


def run(spec: dict) -> list[Row]:
    torch.manual_seed(0)
    rows = []
    for fields in spec["shapes"]:
        shape = Shape(**fields)
        for dtype in spec["dtypes"]:
            layer = build_model(shape, n_layers=1).get_submodule("layers.0.moe")
            rate, ms = median_tokens_per_s(layer_step(layer, shape, dtype), shape.tokens, warmup=spec["warmup"],
                                           repeats=spec["repeats"])
            rows.append(Row("MoE layer", "torchtitan 0.3.0", shape.name, dtype, rate, ms))
            if shape.name == "debug":
                model = build_model(shape)
                rate, ms = median_tokens_per_s(model_step(model, VOCAB_SIZE, shape, dtype), shape.tokens,
                                               warmup=spec["warmup"], repeats=spec["repeats"])
                rows.append(Row("qwen3_moe debug model", "torchtitan 0.3.0", shape.name, dtype, rate, ms))
    return rows


def main(spec_json: str) -> None:
    print(json.dumps([asdict(row) for row in run(json.loads(spec_json))]))
