"""Hugging Face adapter: names, q/k permutation against HF's rotate_half rotary, tying, config.json."""
import math

import pytest
import torch

from models import get_model_spec
from models.common.attention.rope import apply_rotary_emb, rope_cache
from models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, RopeScaling, Transformer
from models.llama3.state_dict_adapter import Llama3StateDictAdapter, hf_config_dict, permute_from_hf, permute_to_hf

SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32,
                       rope_theta=500000.0, rope_scaling=SCALING, max_seq_len=64)


def _hf_rope(x: torch.Tensor, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """transformers' Llama rotary (rotate_half convention, llama3 rope_type) on x [batch, seq, heads, head_dim]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * llama / scaling.factor + smooth * llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, llama)
    freqs = torch.arange(x.shape[1]).float()[:, None] @ inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    rotate_half = torch.cat((-x[..., dim // 2:], x[..., : dim // 2]), dim=-1)
    return x * cos + rotate_half * sin


def _model(args=ARGS) -> Transformer:
    torch.manual_seed(0)
    return Transformer(args)


def test_roundtrip_is_identity():
    model = _model()
    adapter = Llama3StateDictAdapter(ARGS)
    ours = model.state_dict()
    back = adapter.from_hf(adapter.to_hf(ours))
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_hf_names():
    hf = Llama3StateDictAdapter(ARGS).to_hf(_model().state_dict())
    assert set(hf) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.down_proj", "mlp.up_proj", "input_layernorm", "post_attention_layernorm")
    }
    assert all(t.is_contiguous() for t in hf.values())  # safetensors refuses strided views


@pytest.mark.parametrize("proj,n_heads", [("wq", 4), ("wk", 2)])
def test_permutation_makes_hf_rotary_agree_with_ours(proj, n_heads):
    model = _model()
    w = getattr(model.layers["0"].attention, proj).weight.detach()
    head_dim = ARGS.head_dim
    x = torch.randn(2, 64, ARGS.dim)
    ours = apply_rotary_emb((x @ w.T).view(2, 64, n_heads, head_dim),
                            rope_cache(head_dim, 64, ARGS.rope_theta, ARGS.rope_scaling))
    hf = _hf_rope((x @ permute_to_hf(w, n_heads).T).view(2, 64, n_heads, head_dim), ARGS.rope_theta, ARGS.rope_scaling)
    # Same channels, listed per head as [pairs, 2] in ours and [2, pairs] in HF's order.
    ours_in_hf_order = ours.unflatten(-1, (head_dim // 2, 2)).transpose(-1, -2).flatten(-2)
    torch.testing.assert_close(hf, ours_in_hf_order, atol=1e-6, rtol=0)  # fp32, the same products summed alike


def test_attention_scores_agree_after_conversion():
    model = _model()
    attn = model.layers["1"].attention
    hf = Llama3StateDictAdapter(ARGS).to_hf(model.state_dict())
    x = torch.randn(1, 48, ARGS.dim)
    cache = rope_cache(ARGS.head_dim, 48, ARGS.rope_theta, ARGS.rope_scaling)
    with torch.no_grad():
        q = apply_rotary_emb(attn.wq(x).view(1, 48, 4, 16), cache)[:, :, 0]
        k = apply_rotary_emb(attn.wk(x).view(1, 48, 2, 16), cache)[:, :, 0]
        hq = _hf_rope((x @ hf["model.layers.1.self_attn.q_proj.weight"].T).view(1, 48, 4, 16), 500000.0, SCALING)
        hk = _hf_rope((x @ hf["model.layers.1.self_attn.k_proj.weight"].T).view(1, 48, 2, 16), 500000.0, SCALING)
    # fp32 dot products of ~16 terms of size ~0.1: reordering costs ~1e-8
    torch.testing.assert_close(q @ k.transpose(1, 2), hq[:, :, 0] @ hk[:, :, 0].transpose(1, 2), atol=1e-6, rtol=0)


def test_permutations_are_inverse():
    w = torch.randn(8 * 16, 24)
    assert torch.equal(permute_from_hf(permute_to_hf(w, 8), 8), w)
    assert not torch.equal(permute_to_hf(w, 8), w)


def test_tied_embeddings_write_no_lm_head_and_load_both_names():
    args = Llama3ModelArgs(**{**ARGS.__dict__, "tie_word_embeddings": True})
    model = _model(args)
    adapter = Llama3StateDictAdapter(args)
    hf = adapter.to_hf(model.state_dict())
    assert "lm_head.weight" not in hf
    ours = adapter.from_hf(hf)
    assert ours["output.weight"] is ours["tok_embeddings.weight"]
    fresh = Transformer(args)
    fresh.load_state_dict(ours)  # strict: every key present
    assert torch.equal(fresh.output.weight, model.tok_embeddings.weight)
    # A saved lm_head equal to the embedding is accepted; a different one means the args are wrong.
    adapter.from_hf({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        adapter.from_hf({**hf, "lm_head.weight": torch.zeros(100, 64)})


def test_from_hf_errors_name_the_problem():
    adapter = Llama3StateDictAdapter(ARGS)
    hf = adapter.to_hf(_model().state_dict())
    with pytest.raises(KeyError, match=r"lacks 1 expected key\(s\): lm_head.weight"):
        adapter.from_hf({k: v for k, v in hf.items() if k != "lm_head.weight"})
    assert "output.weight" not in adapter.from_hf({k: v for k, v in hf.items() if k != "lm_head.weight"}, strict=False)
    with pytest.raises(KeyError, match="unexpected Hugging Face key 'model.layers.2.mlp.up_proj.weight'"):
        adapter.from_hf({**hf, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(32,\), expected \(64,\)"):
        adapter.from_hf({**hf, "model.norm.weight": torch.ones(32)})
    stale = {**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}  # old transformers saves
    assert adapter.from_hf(stale).keys() == adapter.from_hf(hf).keys()


def test_to_hf_rejects_foreign_keys():
    adapter = Llama3StateDictAdapter(ARGS)
    with pytest.raises(KeyError, match="no Hugging Face name for 'layers.0.attention.wq.bias'"):
        adapter.to_hf({"layers.0.attention.wq.bias": torch.zeros(64)}, strict=False)


def test_hf_config_for_8b():
    config = hf_config_dict(LLAMA3_FLAVORS["8B"], bos_token_id=1)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size",
                                   "tie_word_embeddings", "max_position_embeddings", "torch_dtype")} == {
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
        "tie_word_embeddings": False, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["bos_token_id"] == 1 and "eos_token_id" not in config


def test_hf_config_debug_has_no_rope_scaling_and_spec_links_adapter():
    spec = get_model_spec("llama3")
    adapter = spec.state_dict_adapter_cls(LLAMA3_FLAVORS["1B"])
    assert adapter.hf_config_dict(torch_dtype="float32")["tie_word_embeddings"] is True
    assert hf_config_dict(LLAMA3_FLAVORS["debug"])["rope_scaling"] is None
