"""Document masking: a window packing three documents gives each document the logits it has alone, in our
model and in transformers (which reads restarting ``position_ids`` as packed sequences), for every family."""
from __future__ import annotations

import json

import pytest
import torch
from _transformers import import_transformers
from safetensors.torch import save_file

from models.common.attention.grouped_query import masked_attention
from models.common.attention.mask import build_mask
from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from models.deepseek_v3 import state_dict_adapter as deepseek_hf
from models.llama3 import LLAMA3_FLAVORS, Transformer
from models.llama3 import state_dict_adapter as llama_hf
from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel
from models.qwen3_moe import state_dict_adapter as qwen_hf
from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.sequence_layout import model_batch

transformers = import_transformers()

LENGTHS = (7, 13, 12)
STARTS = (0, 7, 20)
LOGITS_TOL = 1e-5
"""float32: packed and alone differ only in the attention kernel's masked path (explicit mask vs is_causal) and
the summation order over the masked-out keys (exact zeros); HF and ours differ by rounding (the families' HF
tests hold them to 1e-5)."""

FAMILIES = {
    "llama3": (Transformer, LLAMA3_FLAVORS["debug"], llama_hf.Llama3StateDictAdapter, llama_hf.hf_config_dict,
               "LlamaForCausalLM"),
    "qwen3_moe": (Qwen3MoeModel, QWEN3_MOE_FLAVORS["debug"], qwen_hf.Qwen3MoeStateDictAdapter, qwen_hf.hf_config_dict,
                  "Qwen3MoeForCausalLM"),
    "deepseek_v3": (DeepSeekV3Model, DEEPSEEK_V3_FLAVORS["debug"], deepseek_hf.DeepSeekV3StateDictAdapter,
                    deepseek_hf.hf_config_dict, "DeepseekV3ForCausalLM"),
}


def _model(family: str) -> torch.nn.Module:
    cls, args = FAMILIES[family][:2]
    torch.manual_seed(0)
    model = cls(args).eval()
    with torch.no_grad():  # norms, router and expert bias away from their init, so that every path is exercised
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.2))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias") and family == "deepseek_v3":  # HF Qwen3-MoE has none
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model


def _packed(vocab_size: int) -> Batch:
    tokens = torch.randint(0, vocab_size, (1, sum(LENGTHS) + 1), generator=torch.Generator().manual_seed(1))
    return Batch(tokens[:, :-1], tokens[:, 1:], [torch.tensor(STARTS)])


def _pieces(logits: torch.Tensor) -> list[torch.Tensor]:
    return list(logits[0].split(LENGTHS))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


def test_each_packed_document_gets_the_logits_it_has_alone(family):
    model = _model(family)
    batch = _packed(FAMILIES[family][1].vocab_size)
    layout = model_batch(batch, document_mask=True)
    assert layout.model_kwargs["positions"][0].tolist() == [*range(7), *range(13), *range(12)]
    with torch.no_grad():
        packed = _pieces(model(layout.inputs, **layout.model_kwargs))
        alone = [model(piece) for piece in batch.inputs.split(LENGTHS, dim=1)]
        causal = _pieces(model(batch.inputs))
    for got, want in zip(packed, alone):
        assert (got - want[0]).abs().max() <= LOGITS_TOL
    # Not vacuous: without the mask the later documents read the earlier ones (O(1) apart), the first does not.
    assert (causal[1] - alone[1][0]).abs().max() > 100 * LOGITS_TOL
    assert (causal[0] - alone[0][0]).abs().max() <= LOGITS_TOL


def test_transformers_with_restarting_positions_gives_the_same_logits(family, tmp_path):
    _, args, adapter, config_dict, hf_class = FAMILIES[family]
    model = _model(family)
    save_file(adapter(args).to_hf(model.state_dict()), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config_dict(args, torch_dtype="float32")))
    hf = getattr(transformers, hf_class).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    batch = _packed(args.vocab_size)
    layout = model_batch(batch, document_mask=True)
    with torch.no_grad():
        # use_cache=False: with a cache transformers skips its packed-sequence detection and attends causally.
        theirs = hf(layout.inputs, position_ids=layout.model_kwargs["positions"], use_cache=False).logits
        ours = model(layout.inputs, **layout.model_kwargs)
        alone = torch.cat([hf(piece, use_cache=False).logits for piece in batch.inputs.split(LENGTHS, dim=1)], 1)
    assert (ours - theirs).abs().max() <= LOGITS_TOL
    assert (theirs - alone).abs().max() <= LOGITS_TOL


def test_positions_restart_in_the_rotation_not_only_in_the_logits():
    # RoPE scores depend on relative positions only, so logits cannot tell a restart from a shift: the rotated
    # query of the third document must be the one it has alone.
    model = _model("llama3")
    batch = _packed(LLAMA3_FLAVORS["debug"].vocab_size)
    layout = model_batch(batch, document_mask=True)
    queries = []
    attention = model.layers["0"].attention
    hook = attention.register_forward_hook(lambda m, inputs, out: queries.append(m.project(*inputs)[0]))
    with torch.no_grad():
        model(layout.inputs, **layout.model_kwargs)
        model(batch.inputs[:, STARTS[2]:])
    hook.remove()
    assert (queries[0][:, STARTS[2]:] - queries[1]).abs().max() <= 1e-6


@pytest.mark.parametrize("n_heads,kv_heads,v_dim", [(4, 2, 8), (4, 4, 6)], ids=["gqa", "v_dim_differs"])
def test_flex_attention_and_the_dense_mask_attend_the_same_pairs(n_heads, kv_heads, v_dim):
    # On CUDA the mask is a FlexAttention BlockMask; on CPU its eager form checks the same mask function.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, n_heads, 32, 8, generator=g)
    k = torch.randn(2, kv_heads, 32, 8, generator=g)
    v = torch.randn(2, kv_heads, 32, v_dim, generator=g)
    index = torch.arange(32).expand(2, 32)
    docs = torch.tensor([[0] * 7 + [1] * 13 + [2] * 12, [0] * 32])
    gqa = n_heads != kv_heads
    dense = masked_attention(q, k, v, build_mask(index, index, docs, docs, kind="dense"), enable_gqa=gqa)
    flex = masked_attention(q, k, v, build_mask(index, index, docs, docs, kind="flex"), enable_gqa=gqa)
    assert (dense - flex).abs().max() <= 1e-5
    # The one-document row is plain causal attention.
    causal = masked_attention(q, k, v, None, enable_gqa=gqa)
    assert (dense[1] - causal[1]).abs().max() <= 1e-6
    assert (dense[0] - causal[0]).abs().max() > 1e-2
