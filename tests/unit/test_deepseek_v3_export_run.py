"""A deepseek_v3 run through the conversion scripts: convert_to_hf writes a folder that DeepseekV3ForCausalLM loads and
that greedily continues a prompt as we do, convert_from_hf brings the weights back bitwise, generate.py reads the
checkpoint. The expert bias is exported in float32 whatever the weights' dtype, as transformers keeps it."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from _transformers import import_transformers

import config_registry
from models import build_model_args, get_model_spec
from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.components.generation import generate, load_from_dcp, load_from_hf
from torchtitan_lite.config import apply_overrides, config_to_toml
from torchtitan_lite.config.overrides import Override
from torchtitan_lite.tools import generate as generate_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = get_model_spec("deepseek_v3")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save_run(dump) -> str:
    """A run folder as train.py leaves it (deepseek_v3_debug with 2 blocks: one dense, one MoE), with a moved
    expert bias, as training leaves it."""
    cfg = apply_overrides(config_registry.get("deepseek_v3_debug"),
                          [Override("model.n_layers", 2, "test"), Override("job.dump_folder", str(dump), "test")])
    os.makedirs(dump, exist_ok=True)
    (dump / "config.toml").write_text(config_to_toml(cfg))
    torch.manual_seed(0)
    args = build_model_args(SPEC, "debug", n_layers=2, min_vocab_size=cfg.tokenizer.build().vocab_size)
    model = SPEC.model_cls(args)
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.linspace(-3e-3, 3e-3, 8) + 1e-5)  # not bf16-representable
    ckpt = CheckpointManager.Config(enable=True).build(dump_folder=str(dump), states={"model": ModelWrapper(model)},
                                                       model_args=args, model_spec=SPEC, run_config=config_to_toml(cfg))
    ckpt.save(5, last_step=True)
    ckpt.close()
    return str(dump / "checkpoint" / "step-5")


def test_scripts_export_import_and_generate(tmp_path, capsys):
    transformers = import_transformers()
    safetensors = pytest.importorskip("safetensors")
    ckpt = _save_run(tmp_path / "run")
    ours = load_from_dcp(ckpt, config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY))
    out = tmp_path / "hf"
    _script("convert_to_hf").main(["--checkpoint", ckpt, "--dtype", "float32", "--output", str(out)])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt_ids = ours.tokenizer.encode("def main(", bos=True, eos=False)
    expected = generate(ours, prompt_ids, max_new_tokens=12)
    theirs = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert len(expected) == 12 and theirs[0, len(prompt_ids):].tolist() == expected

    from_hf = load_from_hf(str(out), config_for_checkpoint(str(out), registry=config_registry.DEFAULT_REGISTRY))
    state, back = ours.model.state_dict(), from_hf.model.state_dict()
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    _script("convert_from_hf").main(["--hf-dir", str(out), "--output", str(tmp_path / "seed")])
    assert (tmp_path / "seed" / ".metadata").is_file()

    text = generate_tool.main(["--checkpoint", ckpt, "--prompt", "def main(", "--max-new-tokens", "4"],
                              registry=config_registry.DEFAULT_REGISTRY)
    assert capsys.readouterr().out == text + "\n" and len(text) > len("def main(")

    bf16 = tmp_path / "hf_bf16"
    _script("convert_to_hf").main(["--checkpoint", ckpt, "--dtype", "bfloat16", "--output", str(bf16)])
    with safetensors.safe_open(str(bf16 / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert bias.dtype == torch.float32 and torch.equal(bias, state["layers.1.moe.expert_bias"])
