"""Helpers of the Hugging Face import tests: tiny random transformers models saved as transformers 5 saves them
(``save_pretrained``: ``rope_parameters``), the conversion scripts, and the logits comparison."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import torch
from _transformers import import_transformers

import config_registry
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.components.generation import load_from_dcp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config"}
# float32 on both sides; the models differ in rotary form, norm and attention kernels and the expert combine's
# summation order: rounding only (measured up to 3e-7 of the largest logit on these models). 1e-5 of the largest
# logit is the bound HF parity is held to; a rotary base or YaRN setting other than the file's moves the logits
# by 1e-2 to 1 of it.
RELATIVE_TOL = 1e-5


def script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_model(config: dict[str, Any], seed: int = 0) -> Any:
    """A random transformers model of ``config`` (config.json fields), float32, every weight and norm randomised
    (transformers starts norms at 1 and routers at 0). Weight noise stays small for deepseek_v3: larger weights
    grow the rounding of transformers' float32 cos / sin table (test_deepseek_v3_hf.py)."""
    transformers = import_transformers()
    kind = config["model_type"]
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_config = getattr(transformers, CONFIG_CLASSES[kind])(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[kind])(hf_config).float().eval()
    noise = 0.02 if kind == "deepseek_v3" else 0.15
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (noise if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model


def save(model: Any, folder: Any) -> dict[str, Any]:
    """``save_pretrained`` (transformers 5's config.json form); the config.json written."""
    model.save_pretrained(str(folder))
    return read_config(folder)


def read_config(folder: Any) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def write_config(folder: Any, config: dict[str, Any]) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))


def relative_error(ours: Any, hf: Any, vocab_size: int) -> float:
    """max |ours - transformers| over the logits of a random batch, relative to the largest logit (``ours`` may
    be a transformers model too)."""
    ids = tokens(vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    got = getattr(got, "logits", got)
    return float((got - expected).abs().max() / expected.abs().max())


def import_folder(hf_dir: Any, out: Any, config: str | None, capsys: Any) -> tuple[int, str]:
    """scripts/convert_from_hf.py on ``hf_dir``: (exit status, stderr)."""
    argv = ["--hf-dir", str(hf_dir), "--output", str(out)] + ([] if config is None else ["--config", config])
    capsys.readouterr()
    try:
        script("convert_from_hf").main(argv)
        status = 0
    except SystemExit as e:
        status = int(e.code or 0)
    return status, capsys.readouterr().err


def imported_model(folder: Any) -> Any:
    """The model of an imported DCP folder, built from the config.toml it holds (no --config)."""
    return load_from_dcp(str(folder), config_for_checkpoint(str(folder), registry=config_registry.DEFAULT_REGISTRY))


def assert_one_line_refusal(status: int, err: str, *needles: str) -> None:
    """Exit 2 and stderr ending in one ``error:`` line naming each of ``needles``, no traceback (log lines may
    come before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert lines and lines[-1].startswith("error: "), err
    assert "Traceback" not in err and sum(line.startswith("error") for line in lines) == 1, err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
