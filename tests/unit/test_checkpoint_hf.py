"""Hugging Face export/import: last_save_in_hf, DCP -> HF -> DCP round trip, conversion errors."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from _transformers import import_transformers
from safetensors import safe_open

from models import build_model_args, get_model_spec
from torchtitan_lite.components.checkpoint import CheckpointError, CheckpointManager, ModelWrapper, convert, hf_io

SPEC = get_model_spec("llama3")
ARGS = build_model_args(SPEC, "debug", n_layers=1, vocab_size=512)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model(seed: int, args=ARGS) -> torch.nn.Module:
    torch.manual_seed(seed)
    return SPEC.model_cls(args)


def save_dcp(dump, m, **cfg) -> str:
    cfg = {"enable": True, "interval": 1, **cfg}
    ckpt = CheckpointManager.Config(**cfg).build(dump_folder=str(dump), states={"model": ModelWrapper(m)},
                                                 model_args=m.args, model_spec=SPEC)
    ckpt.save(3, last_step=True)
    ckpt.close()
    return os.path.join(dump, "checkpoint", "step-3")


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_last_save_in_hf_writes_adapter_names_and_config(tmp_path):
    m = model(0)
    save_dcp(tmp_path, m, last_save_in_hf=True, export_dtype="bfloat16")
    out = tmp_path / "checkpoint" / "step-3-hf"
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["torch_dtype"]) == (1, 256, "bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
        assert len(list(f.keys())) == len(m.state_dict())
    back = SPEC.state_dict_adapter_cls(ARGS).from_hf(hf_io.load_hf(str(out)))
    for key, value in m.state_dict().items():
        assert torch.equal(back[key], value.bfloat16()), key


def test_last_save_in_hf_needs_an_adapter(tmp_path):
    no_adapter = dataclasses.replace(SPEC, state_dict_adapter_cls=None)
    with pytest.raises(ValueError, match="has none, set checkpoint.last_save_in_hf=False"):
        CheckpointManager.Config(enable=True, last_save_in_hf=True).build(
            dump_folder=str(tmp_path), states={"model": ModelWrapper(model(0))}, model_args=ARGS,
            model_spec=no_adapter)


def test_dcp_to_hf_to_dcp_round_trip_is_exact(tmp_path):
    original = model(0)
    ckpt = save_dcp(tmp_path / "run", original)
    assert convert.checkpoint_vocab_size(ckpt) == ARGS.vocab_size
    convert.dcp_to_hf(ckpt, SPEC, ARGS, str(tmp_path / "hf"), "float32")
    convert.hf_to_dcp(str(tmp_path / "hf"), SPEC, ARGS, str(tmp_path / "seed"))
    fresh = model(1)
    loader = CheckpointManager.Config(enable=True, initial_load_path=str(tmp_path / "seed")).build(
        dump_folder=str(tmp_path / "next"), states={"model": ModelWrapper(fresh)})
    assert loader.load() == 0
    assert_same_state(original, fresh)


def test_dcp_to_hf_with_the_wrong_flavor_names_the_mismatch(tmp_path):
    ckpt = save_dcp(tmp_path, model(0))
    wider = dataclasses.replace(ARGS, dim=128, n_heads=4, n_kv_heads=2)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.tok_embeddings\.weight': checkpoint "
                                              r"has \(512, 256\), this run expects \(512, 128\)"):
        convert.dcp_to_hf(ckpt, SPEC, wider, str(tmp_path / "hf"), "float32")
    assert not os.path.exists(tmp_path / "hf")


def test_hf_to_dcp_rejects_a_config_of_another_model(tmp_path):
    convert.dcp_to_hf(save_dcp(tmp_path, model(0)), SPEC, ARGS, str(tmp_path / "hf"), "float32")
    deeper = dataclasses.replace(ARGS, n_layers=2)
    with pytest.raises(ValueError, match=r"hf/config\.json: num_hidden_layers=1 but the chosen model "
                                         r"configuration has num_hidden_layers=2"):
        convert.hf_to_dcp(str(tmp_path / "hf"), SPEC, deeper, str(tmp_path / "seed"))


def test_truncated_safetensors_is_named(tmp_path):
    convert.dcp_to_hf(save_dcp(tmp_path, model(0)), SPEC, ARGS, str(tmp_path / "hf"), "float32")
    weights = tmp_path / "hf" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match=r"hf/model\.safetensors is not a readable safetensors file"):
        convert.hf_to_dcp(str(tmp_path / "hf"), SPEC, ARGS, str(tmp_path / "seed"))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scripts_convert_both_ways(tmp_path, monkeypatch):
    # The registry config resolves to the debug flavor with 1 layer; the vocabulary comes from the weights.
    seen = []

    def resolve(cfg, *, vocab_size):
        seen.append((cfg.model.flavor, vocab_size))
        return SPEC, build_model_args(SPEC, "debug", n_layers=1, vocab_size=vocab_size)

    def resolve_hf(hf_dir, cfg):  # the import reads config.json: the same model, with the 1-layer override
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=1))
        spec, args = convert.resolve_hf_model(hf_dir, cfg)
        seen.append((cfg.model.flavor, args.vocab_size))
        return spec, args

    original = model(0)
    ckpt = save_dcp(tmp_path / "run", original)
    to_hf, from_hf = _script("convert_to_hf"), _script("convert_from_hf")
    monkeypatch.setattr(to_hf, "resolve_model", resolve)
    monkeypatch.setattr(from_hf, "resolve_hf_model", resolve_hf)
    # The 512-row model has no tokenizer of its vocabulary (llama3_debug's has 2048 ids): weights alone.
    to_hf.main(["--checkpoint", ckpt, "--config", "llama3_debug", "--dtype", "float32", "--no-tokenizer",
                "--output", str(tmp_path / "hf")])
    from_hf.main(["--hf-dir", str(tmp_path / "hf"), "--config", "llama3_debug", "--output", str(tmp_path / "seed")])
    assert seen == [("debug", 512), ("debug", 512)]  # llama3_debug's flavor, the weights' vocabulary
    fresh = model(1)
    CheckpointManager.Config(enable=True, initial_load_path=str(tmp_path / "seed")).build(
        dump_folder=str(tmp_path / "next"), states={"model": ModelWrapper(fresh)}).load()
    assert_same_state(original, fresh)


def test_transformers_logits_match(tmp_path):
    # Enable with `pip install -e .[hf]`. fp32 on both sides; 1e-4 allows for the different (but
    # equivalent) rotary formulation and attention kernels reordering float32 sums.
    transformers = import_transformers()
    ours = model(0).eval()
    convert.dcp_to_hf(save_dcp(tmp_path, ours), SPEC, ARGS, str(tmp_path / "hf"), "float32")
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
