"""Text from a trained model: load a DCP checkpoint (any saved layout) or a Hugging Face folder into a
plain single-process model, then decode a prompt token by token.

FP8-trained checkpoints load as they are: Float8Linear keeps its weights in high precision under the
plain Linear names, so the weights go into an unconverted model. Decoding uses the model family's key/
value cache (``ModelSpec.kv_cache_cls``) when it has one; without it every step reruns the whole prefix.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_lite.components.checkpoint import hf_io
from torchtitan_lite.components.checkpoint.convert import checkpoint_vocab_size, resolve_hf_model, resolve_model
from torchtitan_lite.components.checkpoint.verify import WeightsOnlyLoadPlanner, check_compatible, read_metadata
from torchtitan_lite.components.sampling import SamplingConfig, sample_next
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.protocols.model_spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class GenerationModel:
    """A model ready to decode, with the tokenizer it was trained with."""

    model: Any
    """The family's model (an nn.Module with ``args``), in eval mode."""
    tokenizer: Any
    """encode(text, bos, eos) / decode(ids) / bos_id / eos_id, like components.tokenizer.Tokenizer."""
    kv_cache_cls: type | None


def load_from_dcp(checkpoint_dir: str, cfg: Any) -> GenerationModel:
    """The model weights of ``checkpoint_dir`` in a float32 model built from root config ``cfg``."""
    spec, args = resolve_model(cfg, vocab_size=checkpoint_vocab_size(checkpoint_dir))
    model = _empty_model(spec, args)
    target = {"model": model.state_dict()}
    check_compatible(checkpoint_dir, read_metadata(checkpoint_dir), target, exact_prefixes=("model.",))
    dcp.load(target, checkpoint_id=checkpoint_dir, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return GenerationModel(model.eval(), cfg.tokenizer.build(), spec.kv_cache_cls)


def load_from_hf(hf_dir: str, cfg: Any) -> GenerationModel:
    """A Hugging Face folder (e.g. from scripts/convert_to_hf.py) in a float32 model: the architecture as
    convert.resolve_hf_model reads it (config.json checked, rotary settings included), the folder's own tokenizer."""
    spec, args = resolve_hf_model(hf_dir, cfg)
    adapter = spec.state_dict_adapter_cls(args)  # type: ignore[misc]  # resolve_hf_model checked it is not None
    model = _empty_model(spec, args)
    state = adapter.from_hf(hf_io.load_hf(hf_dir))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return GenerationModel(model.eval(), folder_tokenizer(hf_dir), spec.kv_cache_cls)


def _empty_model(spec: ModelSpec, args: Any) -> Any:
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")  # the rotary table; every weight is then overwritten
    return model


def folder_tokenizer(folder: str) -> Tokenizer:
    """The tokenizer of an exported folder: its SentencePiece ``tokenizer.model`` (the ids the run trained
    with), else its ``tokenizer.json`` with the special tokens its tokenizer_config.json names."""
    sp_model = os.path.join(folder, "tokenizer.model")
    path = sp_model if os.path.isfile(sp_model) else folder
    if not os.path.isfile(sp_model) and not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise FileNotFoundError(f"{folder} has neither tokenizer.model nor tokenizer.json; export it with "
                                f"scripts/convert_to_hf.py, which writes the run's tokenizer")
    return Tokenizer.Config(path=path).build()


@torch.no_grad()
def generate(loaded: GenerationModel, prompt_ids: Sequence[int], *, max_new_tokens: int,
             sampling: SamplingConfig | None = None, seed: int | None = None, use_cache: bool = True,
             stop_at_eos: bool = True) -> list[int]:
    """``max_new_tokens`` new token ids after ``prompt_ids`` (fewer if EOS comes first and ``stop_at_eos``)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token (a BOS is added by default)")
    sampling = sampling or SamplingConfig()
    model = loaded.model
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = torch.tensor([list(prompt_ids)], dtype=torch.long)
    total = tokens.shape[1] + max_new_tokens
    max_seq_len = model.args.max_seq_len
    if total > max_seq_len:
        raise ValueError(f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"the model's max_seq_len={max_seq_len}; shorten the prompt or --max-new-tokens")
    cache = loaded.kv_cache_cls(model, batch_size=1, max_len=total) if use_cache and loaded.kv_cache_cls else None
    new: list[int] = []
    start = time.perf_counter()
    position = 0
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = cache(tokens[:, position:], position)
            position = tokens.shape[1]
        else:
            logits = model(tokens)
        next_id = sample_next(logits[:, -1], sampling, generator)
        new.append(int(next_id))
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
        if stop_at_eos and new[-1] == loaded.tokenizer.eos_id:
            break
    elapsed = time.perf_counter() - start
    logger.info("generated %d tokens in %.2fs (%.1f tokens/s, kv cache %s)", len(new), elapsed,
                len(new) / max(elapsed, 1e-9), "on" if cache is not None else "off")
    return new
