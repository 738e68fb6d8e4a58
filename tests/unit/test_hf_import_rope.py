"""Hugging Face import reads the rotary settings of config.json in both forms transformers writes (transformers 5's
``rope_parameters``, transformers 4's ``rope_theta`` / ``rope_scaling``, DeepSeek-V3's ``"type": "yarn"``), and
builds the model the file describes or refuses it: never the flavor's rotary table under another model's weights.

Each case saves a tiny random transformers model of the registered debug flavor's shape with ``save_pretrained``
(so the flavor alone would also fit its weights), imports it with scripts/convert_from_hf.py and compares the
logits with transformers'."""
from __future__ import annotations

import os

import pytest
from _hf_import import (
    RELATIVE_TOL,
    assert_one_line_refusal,
    hf_model,
    import_folder,
    imported_model,
    read_config,
    relative_error,
    save,
    write_config,
)
from _transformers import import_transformers

import config_registry
from torchtitan_lite.components import generation
from torchtitan_lite.components.checkpoint.convert import resolve_model

import_transformers()

FLAVOR_VOCAB = 2048  # the debug flavors' vocabulary


def flavor_config(config_name: str, **changes) -> dict:
    """config.json of the registered config's flavor (our adapter's), with ``changes`` (rope_parameters...)."""
    spec, args = resolve_model(config_registry.get(config_name), vocab_size=FLAVOR_VOCAB)
    config = spec.state_dict_adapter_cls(args).hf_config_dict(torch_dtype="float32")
    for key in ("rope_theta", "rope_scaling"):
        config.pop(key)
    return {**config, **changes}


def saved(tmp_path, config: dict):
    model = hf_model(config)
    save(model, tmp_path / "hf")
    return model


@pytest.fixture
def no_tokenizer(monkeypatch):
    """load_from_hf without the folder's tokenizer (these folders hold weights and config.json only)."""
    monkeypatch.setattr(generation, "folder_tokenizer", lambda folder: None)


def assert_imports_as_transformers(tmp_path, capsys, hf, config_name: str) -> None:
    # generate.py --hf-dir with the registered config: the model of the file, not the flavor's rotary table.
    loaded = generation.load_from_hf(str(tmp_path / "hf"), config_registry.get(config_name)).model
    assert relative_error(loaded, hf, FLAVOR_VOCAB) <= RELATIVE_TOL
    # convert_from_hf.py: the seed and the config.toml it holds build the same model.
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", config_name, capsys)
    assert status == 0, err
    assert relative_error(imported_model(tmp_path / "seed").model, hf, FLAVOR_VOCAB) <= RELATIVE_TOL


QWEN_THETA = {"rope_type": "default", "rope_theta": 777.0}
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "original_max_position_embeddings": 256,
                 "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def test_qwen3_moe_rope_parameters_theta_is_the_files(tmp_path, capsys, no_tokenizer):
    hf = saved(tmp_path, flavor_config("qwen3_moe_debug", rope_parameters=QWEN_THETA))
    assert read_config(tmp_path / "hf")["rope_parameters"]["rope_theta"] == 777.0  # transformers 5's form
    assert_imports_as_transformers(tmp_path, capsys, hf, "qwen3_moe_debug")


@pytest.mark.parametrize("rope", [DEEPSEEK_YARN, {"rope_type": "default", "rope_theta": 3000.0}],
                         ids=["yarn", "plain"])
def test_deepseek_v3_rope_parameters_are_the_files(tmp_path, capsys, no_tokenizer, rope):
    hf = saved(tmp_path, flavor_config("deepseek_v3_debug", rope_parameters=rope))
    assert read_config(tmp_path / "hf")["rope_parameters"]["rope_type"] == rope["rope_type"]
    assert_imports_as_transformers(tmp_path, capsys, hf, "deepseek_v3_debug")


# The debug flavor's own YaRN settings, as DeepSeek-V3 publishes its file (no beta_fast / beta_slow: defaults).
FLAVOR_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
               "mscale": 1.0, "mscale_all_dim": 1.0}


def test_deepseek_v3_published_type_yarn_form_is_accepted(tmp_path, capsys, no_tokenizer):
    # DeepSeek-V3's own config.json: top-level rope_theta and rope_scaling {"type": "yarn", ...}, no rope_type,
    # with the flavor's values (other values in transformers 5's form: the test above).
    hf = saved(tmp_path, flavor_config("deepseek_v3_debug", rope_parameters=FLAVOR_YARN))
    config = read_config(tmp_path / "hf")
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    write_config(tmp_path / "hf", config)
    assert_imports_as_transformers(tmp_path, capsys, hf, "deepseek_v3_debug")


def test_old_form_rope_theta_is_the_files(tmp_path, capsys, no_tokenizer):
    hf = saved(tmp_path, flavor_config("qwen3_moe_debug", rope_parameters=QWEN_THETA))
    config = read_config(tmp_path / "hf")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    write_config(tmp_path / "hf", config)
    assert_imports_as_transformers(tmp_path, capsys, hf, "qwen3_moe_debug")


def test_llama3_keeps_its_flavors_rope_in_either_form(tmp_path, capsys):
    # Llama 3 builds its flavor: the flavor's rotary settings written in transformers 5's form import...
    hf = saved(tmp_path, flavor_config("llama3_debug", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", "llama3_debug", capsys)
    assert status == 0, err
    assert relative_error(imported_model(tmp_path / "seed").model, hf, FLAVOR_VOCAB) <= RELATIVE_TOL


LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("config_name,rope,needle", [
    ("llama3_debug", {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta=10000.0 (ours: 500000.0)"),
    ("llama3_debug", LLAMA31, "rope_type='llama3' (ours: 'default')"),
    ("qwen3_moe_debug", {**DEEPSEEK_YARN, "rope_theta": 1e6}, "rope_type='yarn' is not supported"),
    ("deepseek_v3_debug", {**DEEPSEEK_YARN, "truncate": False}, "yarn truncate=false is not supported"),
    ("deepseek_v3_debug", {**DEEPSEEK_YARN, "attention_factor": 1.5}, "attention_factor=1.5"),
    ("deepseek_v3_debug", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "rope_type='linear'"),
], ids=["llama3_theta", "llama3_scaling", "qwen3_yarn", "yarn_untruncated", "yarn_attention_factor", "linear"])
def test_rotary_settings_the_model_cannot_build_are_refused(tmp_path, capsys, config_name, rope, needle):
    transformers_config = flavor_config(config_name, rope_parameters=rope)
    saved(tmp_path, transformers_config)
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", config_name, capsys)
    assert_one_line_refusal(status, err, "config.json", needle)
    assert not os.path.exists(tmp_path / "seed")


def test_two_forms_that_disagree_are_refused(tmp_path, capsys):
    saved(tmp_path, flavor_config("qwen3_moe_debug", rope_parameters=QWEN_THETA))
    config = read_config(tmp_path / "hf")
    config["rope_theta"] = 1e6  # transformers 5 would read rope_parameters' 777: ambiguous, refused
    write_config(tmp_path / "hf", config)
    status, err = import_folder(tmp_path / "hf", tmp_path / "seed", "qwen3_moe_debug", capsys)
    assert_one_line_refusal(status, err, "rope_parameters", "disagree")
    assert not os.path.exists(tmp_path / "seed")
