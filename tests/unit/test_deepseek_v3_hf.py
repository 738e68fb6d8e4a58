"""DeepSeek-V3 against Hugging Face transformers: the debug flavor exported loads in DeepseekV3ForCausalLM with the
same float32 logits, a random HF model converted to ours matches, and conversions round-trip bitwise."""
import dataclasses
import json

import pytest
import torch
from _transformers import import_transformers
from safetensors.torch import save_file

from models import get_model_spec
from models.common.attention.yarn import YarnScaling
from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model, DeepSeekV3ModelArgs
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter, hf_config_dict

transformers = import_transformers()

DEBUG = DEEPSEEK_V3_FLAVORS["debug"]
# The other branches: full-rank Q (16B's form), one expert group, a YaRN table factor != 1 (mscale differs from
# mscale_all_dim, as DeepSeek-V2-Lite's 0.707 / 0.707 does not but 0.707 / 1.0 does), two dense blocks.
PLAIN_Q = dataclasses.replace(
    DEBUG, n_layers=3, q_lora_rank=0, n_dense_layers=2, vocab_size=96,
    rope_scaling=YarnScaling(factor=8.0, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=1.0),
    moe=dataclasses.replace(DEBUG.moe, num_groups=1, topk_groups=1, num_shared_experts=2))
# float32 end to end; the two models differ in rotary form (complex multiply vs interleaved cos/sin), RMSNorm
# kernel, attention kernel and the summation order of the expert combine: rounding only (measured max abs 1.2e-6
# on the debug flavor's logits up to 5.0, 9.5e-7 on PLAIN_Q's). 1e-5 is the bound HF parity is held to. Weights
# stay at the init's scale (std 0.02 noise on top): ten times larger weights grow the rounding tenfold (5.5e-5),
# mostly from transformers' float32 cos / sin table, which a float64 run of both models keeps.
LOGITS_TOL = 1e-5
WEIGHT_NOISE, VECTOR_NOISE = 0.02, 0.2


def _randomised(args: DeepSeekV3ModelArgs, seed: int) -> DeepSeekV3Model:
    """Our model with non-trivial norms, router and expert bias (init leaves norms at 1 and the bias at 0)."""
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (WEIGHT_NOISE if p.dim() > 1 else VECTOR_NOISE))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model


def _tokens(args: DeepSeekV3ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))


def _export(model: DeepSeekV3Model, folder) -> dict[str, torch.Tensor]:
    hf_state = DeepSeekV3StateDictAdapter(model.args).to_hf(model.state_dict())
    save_file(hf_state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config_dict(model.args, torch_dtype="float32")))
    return hf_state


@pytest.mark.parametrize("args", [DEBUG, PLAIN_Q], ids=["debug", "plain_q"])
def test_our_export_loads_in_transformers_with_the_same_logits(tmp_path, args):
    ours = _randomised(args, seed=3)
    hf_state = _export(ours, tmp_path)
    assert f"model.layers.{args.n_layers - 1}.mlp.experts.7.down_proj.weight" in hf_state  # per-expert layout
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = _tokens(args)
    moe = ours.layers[str(args.n_dense_layers)].moe
    moe_input = []
    moe.register_forward_pre_hook(lambda module, inputs: moe_input.append(inputs[0]))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert (got - expected).abs().max() <= LOGITS_TOL
    if args.moe.num_groups > 1:  # the group limit decided the experts of some tokens (measured 25 of 96)
        x = moe_input[0].reshape(-1, args.dim)
        grouped = moe.router(x, moe.expert_bias).experts.sort(dim=-1).values
        moe.router.num_groups = 1
        ungrouped = moe.router(x, moe.expert_bias).experts.sort(dim=-1).values
        assert (grouped != ungrouped).any(dim=-1).sum() >= 5
    # The comparison is not vacuous: the logits are far from each other across tokens, and the loaded HF model
    # kept our expert bias (it changes which experts are chosen).
    assert expected.std() > 0.8
    bias = hf.model.layers[args.n_dense_layers].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, ours.layers[str(args.n_dense_layers)].moe.expert_bias)


def test_hf_model_converted_to_ours_gives_the_same_logits():
    config = transformers.DeepseekV3Config(**{k: v for k, v in hf_config_dict(DEBUG, torch_dtype="float32").items()
                                              if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to 1 and the router to zero: randomise all to test the mapping
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (WEIGHT_NOISE if p.dim() > 1 else VECTOR_NOISE) + (p.dim() == 1))
    hf_state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf_state  # transformers 5's fused in-memory layout
    ours = DeepSeekV3Model(DEBUG).eval()
    ours.load_state_dict(DeepSeekV3StateDictAdapter(DEBUG).from_hf(hf_state), strict=True)
    tokens = _tokens(DEBUG)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= LOGITS_TOL


@pytest.mark.parametrize("args", [DEBUG, PLAIN_Q], ids=["debug", "plain_q"])
def test_round_trips_are_bitwise(args):
    adapter = DeepSeekV3StateDictAdapter(args)
    state = _randomised(args, seed=4).state_dict()
    back = adapter.from_hf(adapter.to_hf(state))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    hf_state = adapter.to_hf(state)
    again = adapter.to_hf(adapter.from_hf(hf_state))
    assert again.keys() == hf_state.keys() and all(torch.equal(again[k], hf_state[k]) for k in hf_state)


def test_refusals_name_the_problem():
    adapter = DeepSeekV3StateDictAdapter(DEBUG)
    hf_state = adapter.to_hf(DeepSeekV3Model(DEBUG).state_dict())
    del hf_state["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match=r"layer 2 up_proj: experts \[3\] are missing"):
        adapter.from_hf(hf_state)
    hf_state["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(128, 256)
    with pytest.raises(KeyError, match="layer 0 is one of the first n_dense_layers=1 dense blocks"):
        adapter.from_hf(hf_state)
    softmax = dataclasses.replace(DEBUG, moe=dataclasses.replace(DEBUG.moe, score_func="softmax"))
    with pytest.raises(ValueError, match="score_func='softmax'.*no Hugging Face DeepSeek-V3 form"):
        DeepSeekV3StateDictAdapter(softmax).hf_config_dict()
    low_rank_q = {k: v for k, v in adapter.to_hf(DeepSeekV3Model(DEBUG).state_dict()).items() if "q_a_proj" in k}
    with pytest.raises(KeyError, match=r"self_attn.q_a_proj.weight does not belong in layer 0.*q_lora_rank=0"):
        DeepSeekV3StateDictAdapter(PLAIN_Q).from_hf(low_rank_q, strict=False)


def test_family_is_registered_with_the_published_shapes():
    spec = get_model_spec("deepseek_v3")
    assert spec.state_dict_adapter_cls is DeepSeekV3StateDictAdapter
    v3 = spec.flavors["671B"]
    assert (v3.dim, v3.n_layers, v3.n_heads, v3.q_lora_rank, v3.kv_lora_rank, v3.vocab_size, v3.n_dense_layers) == (
        7168, 61, 128, 1536, 512, 129280, 3)
    m = v3.moe
    assert (m.num_experts, m.top_k, m.hidden_dim, m.num_groups, m.topk_groups, m.num_shared_experts, m.route_scale) == (
        256, 8, 2048, 8, 4, 1, 2.5)
    # softmax scale 192 ** -0.5 * (0.1 ln 40 + 1) ** 2, as DeepSeek's reference computes it for 163,840 positions.
    assert v3.softmax_scale == pytest.approx(192 ** -0.5 * 1.3688879454 ** 2, rel=1e-9)
    # The names' totals, counted on meta: 671B / 37B active (DeepSeek-V3), 16B / 3B active (Moonlight-16B-A3B).
    for flavor, total, active in (("671B", 671.03e9, 37.55e9), ("16B", 15.96e9, 2.915e9)):
        with torch.device("meta"):
            model = DeepSeekV3Model(spec.flavors[flavor])
        assert model.num_params() == pytest.approx(total, rel=1e-3)
        assert model.param_counts().active == pytest.approx(active, rel=1e-3)


def test_model_args_refuse_what_the_model_cannot_build():
    with pytest.raises(ValueError, match="q_lora_rank=-1 must be a non-negative integer"):
        dataclasses.replace(DEBUG, q_lora_rank=-1)
    with pytest.raises(ValueError, match="n_dense_layers=5 must be between 0 and n_layers=4"):
        dataclasses.replace(DEBUG, n_dense_layers=5)
    with pytest.raises(ValueError, match="qk_rope_head_dim=33 must be even"):
        dataclasses.replace(DEBUG, qk_rope_head_dim=33)
