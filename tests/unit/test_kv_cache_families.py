"""Every family decodes with its KV cache: greedy output and logits equal recomputing the whole prefix, the
generator says the cache is on, and latent attention keeps only the compressed latent."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import config_registry
from models import build_model_args, get_model_spec
from models.deepseek_v3.kv_cache import LatentKVCache
from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.generation import GenerationModel, generate
from torchtitan_lite.config import apply_overrides, config_to_toml
from torchtitan_lite.config.overrides import Override
from torchtitan_lite.tools import generate as generate_tool

MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")
FAMILIES = ("llama3", *MOE_FAMILIES)
PROMPT = [1, 17, 300, 42, 5, 99, 7]
ATTENTION_GAIN = 30.0


class _Tok:
    eos_id = -1  # never stops early: every test decodes the full length


def loaded(family: str, seed: int = 0) -> GenerationModel:
    """The family's debug flavor with 2 blocks (DeepSeek-V3: one dense, one MoE), random weights."""
    spec = get_model_spec(family)
    torch.manual_seed(seed)
    model = spec.model_cls(build_model_args(spec, "debug", n_layers=2, vocab_size=512)).eval()
    with torch.no_grad():  # attention outweighs the residual stream, so that what it reads decides the argmax
        for block in model.layers.values():
            block.attention.wo.weight.mul_(ATTENTION_GAIN)
    return GenerationModel(model, _Tok(), spec.kv_cache_cls)


@pytest.mark.parametrize("family", MOE_FAMILIES)  # llama3's: tests/unit/test_generation.py
def test_greedy_decoding_is_the_same_with_and_without_the_cache(family, caplog):
    m = loaded(family)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite.components.generation"):
        cached = generate(m, PROMPT, max_new_tokens=16, use_cache=True)
    assert "kv cache on" in caplog.text
    assert cached == generate(m, PROMPT, max_new_tokens=16, use_cache=False)
    assert len(set(cached)) > 1  # not a degenerate repetition of one token


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_logits_match_the_training_forward(family):
    # float32 throughout: the cached path computes the same products as the forward over other shapes (and,
    # for latent attention, sums them in another order: the absorbed W_uk / W_uv), so a logit of size ~4 may
    # differ by a few float32 roundings (measured <= 1.7e-6, a seventh of the allowance); a key cached at the
    # wrong position, or new tokens rotated one position off, moves them by 2e-2 to 6e-1.
    m = loaded(family)
    tokens = torch.tensor([PROMPT + [3, 4, 5, 6, 8, 9]])
    with torch.no_grad():
        full = m.model(tokens)
    assert m.kv_cache_cls is not None
    cache = m.kv_cache_cls(m.model, batch_size=1, max_len=tokens.shape[1])
    # A prompt, a chunk of three after it (the masked branch), then one token at a time.
    parts = [cache(tokens[:, :7], 0), cache(tokens[:, 7:10], 7)]
    parts += [cache(tokens[:, i:i + 1], i) for i in range(10, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_latent_attention_caches_the_compressed_latent_not_the_heads():
    m = loaded("deepseek_v3")
    args = m.model.args
    assert m.kv_cache_cls is not None
    cache = m.kv_cache_cls(m.model, batch_size=1, max_len=20)
    expanded = args.n_heads * (args.head_dim + args.v_head_dim)  # keys and values as the heads read them
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.cache.shape == (1, 20, args.kv_lora_rank + args.qk_rope_head_dim)
        assert layer.cache.shape[-1] < expanded


@pytest.mark.parametrize("config", ["qwen3_moe_debug", "deepseek_v3_debug"])
def test_generate_script_decodes_moe_checkpoints_with_the_cache(config, tmp_path, caplog):
    dump = tmp_path / "run"
    cfg = apply_overrides(config_registry.get(config),
                          [Override("model.n_layers", 2, "test"), Override("job.dump_folder", str(dump), "test")])
    os.makedirs(dump)
    spec = get_model_spec(cfg.model.name)
    torch.manual_seed(0)
    args = build_model_args(spec, cfg.model.flavor, n_layers=2, min_vocab_size=cfg.tokenizer.build().vocab_size)
    ckpt = CheckpointManager.Config(enable=True).build(
        dump_folder=str(dump), states={"model": ModelWrapper(spec.model_cls(args))}, model_args=args,
        model_spec=spec, run_config=config_to_toml(cfg))
    ckpt.save(1, last_step=True)
    ckpt.close()
    argv = ["--checkpoint", str(dump / "checkpoint" / "step-1"), "--prompt", "def main(", "--max-new-tokens", "6"]
    with caplog.at_level(logging.INFO, logger="torchtitan_lite.components.generation"):
        cached = generate_tool.main(argv, registry=config_registry.DEFAULT_REGISTRY)
    assert "kv cache on" in caplog.text
    assert cached == generate_tool.main([*argv, "--no-kv-cache"], registry=config_registry.DEFAULT_REGISTRY)
