"""A Qwen3-MoE or DeepSeek-V3 config.json of a size no flavor has imports with its model args read from the file;
the imported folder carries its config.toml, so it trains, exports back and generates without --config; an export
never pairs the model with a tokenizer of another vocabulary; refusals are one line."""
from __future__ import annotations

import os

import pytest
import torch
from _hf_import import (
    RELATIVE_TOL,
    assert_one_line_refusal,
    hf_model,
    import_folder,
    imported_model,
    read_config,
    relative_error,
    save,
    script,
    write_config,
)
from _transformers import import_transformers

import config_registry
from torchtitan_lite.components.checkpoint.convert import IMPORTED_HF_CONFIG
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.resolved_run import resolve_run

transformers = import_transformers()

# A custom Qwen3-MoE: head_dim 16 with 4 heads over dim 48 (n_heads * head_dim != dim, as Qwen3's published
# shapes), 6 experts top-2, unnormalised top-k (transformers' default), rope theta 1e4.
QWEN3 = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "moe_intermediate_size": 32, "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": False,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# Moonlight / DeepSeek-V2-Lite's form: full-rank queries, one expert group, 2 shared experts, no YaRN.
MOONLIGHT = {"model_type": "deepseek_v3", "vocab_size": 112, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
             "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
             "num_experts_per_tok": 3, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 2.446, "norm_topk_prob": True, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}


@pytest.mark.parametrize("config,base", [(QWEN3, "qwen3_moe_debug"), (MOONLIGHT, "deepseek_v3_debug")],
                         ids=["qwen3_moe", "moonlight"])
def test_a_size_no_flavor_has_imports_from_its_config_json(tmp_path, capsys, config, base):
    hf = hf_model(config)
    save(hf, tmp_path / "hf")
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", base, capsys)
    assert status == 0, err
    assert (tmp_path / "seed" / IMPORTED_HF_CONFIG).is_file()
    cfg = config_for_checkpoint(str(tmp_path / "seed"), registry=config_registry.DEFAULT_REGISTRY)
    assert cfg.model.hf_config == str(tmp_path / "seed" / IMPORTED_HF_CONFIG)
    ours = imported_model(tmp_path / "seed").model
    assert ours.args.dim == config["hidden_size"] and ours.args.vocab_size == config["vocab_size"]
    assert relative_error(ours, hf, config["vocab_size"]) <= RELATIVE_TOL
    # Training from the seed builds the same model: the run's config.toml names the file.
    run = resolve_run(cfg, world_size=1, device_type="cpu", vocab_size=config["vocab_size"])
    assert run.model_args == ours.args


def test_export_back_needs_no_config_and_refuses_a_tokenizer_of_another_vocabulary(tmp_path, capsys):
    hf = hf_model(QWEN3)
    save(hf, tmp_path / "hf")
    assert import_folder(tmp_path / "hf", tmp_path / "seed", "qwen3_moe_debug", capsys)[0] == 0
    export = script("convert_to_hf")
    capsys.readouterr()
    # The seed's config.toml names the debug config's tokenizer (2048 ids): not this 96-row model's.
    with pytest.raises(SystemExit) as refused:
        export.main(["--checkpoint", str(tmp_path / "seed"), "--output", str(tmp_path / "back")])
    assert_one_line_refusal(int(refused.value.code), capsys.readouterr().err, "has 2048 ids",
                            "embedding has 96 rows", "--no-tokenizer")
    assert not os.path.exists(tmp_path / "back")
    export.main(["--checkpoint", str(tmp_path / "seed"), "--no-tokenizer", "--output", str(tmp_path / "back")])
    assert not (tmp_path / "back" / "tokenizer_config.json").exists()
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert relative_error(back, hf, QWEN3["vocab_size"]) <= RELATIVE_TOL
    # ... and imports again without --config (the export carries the seed's config.toml), bitwise the same.
    assert import_folder(tmp_path / "back", tmp_path / "again", None, capsys)[0] == 0
    first, second = imported_model(tmp_path / "seed").model, imported_model(tmp_path / "again").model
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.mark.parametrize("change,config_name,needles", [
    ({"mlp_only_layers": [1]}, "qwen3_moe_debug", ["mlp_only_layers=[1]", "such a model cannot be converted"]),
    ({"use_sliding_window": True}, "qwen3_moe_debug", ["use_sliding_window=True"]),
    ({"num_experts": None}, "qwen3_moe_debug", ["has no num_experts"]),
    ({}, "deepseek_v3_debug", ["model_type='qwen3_moe' is not a DeepSeek-V3 model"]),
    ({}, "llama3_debug", ["model_type='qwen3_moe'", "pick the --config"]),
], ids=["dense_layer", "sliding_window", "no_experts", "other_family", "llama3"])
def test_what_the_family_cannot_build_is_refused_in_one_line(tmp_path, capsys, change, config_name, needles):
    save(hf_model(QWEN3), tmp_path / "hf")
    config = {**read_config(tmp_path / "hf"), **change}
    if "num_experts" in change:
        del config["num_local_experts"]  # transformers 5's name for it
    write_config(tmp_path / "hf", {k: v for k, v in config.items() if v is not None})
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", config_name, capsys)
    assert_one_line_refusal(status, err, "config.json", *needles)
    assert not os.path.exists(tmp_path / "seed")


def test_deepseek_softmax_router_is_refused(tmp_path, capsys):
    save(hf_model(MOONLIGHT), tmp_path / "hf")
    write_config(tmp_path / "hf", {**read_config(tmp_path / "hf"), "scoring_func": "softmax"})
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", "deepseek_v3_debug", capsys)
    assert_one_line_refusal(status, err, "scoring_func='softmax'", "sigmoid")
    assert not os.path.exists(tmp_path / "seed")
