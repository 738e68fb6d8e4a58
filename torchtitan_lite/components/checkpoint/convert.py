"""Offline conversion between DCP checkpoints and Hugging Face folders (used by scripts/convert_*_hf.py).

Both directions run on CPU in one process and never instantiate real weights beyond the ones
converted: the expected keys and shapes come from a model built on the ``meta`` device.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_lite.components.checkpoint import hf_io
from torchtitan_lite.components.checkpoint.hf_tokenizer import export_tokenizer
from torchtitan_lite.components.checkpoint.layout import new_marker
from torchtitan_lite.components.checkpoint.manager import EXPORT_DTYPES
from torchtitan_lite.components.checkpoint.run_config import RUN_CONFIG_NAME
from torchtitan_lite.components.checkpoint.verify import (
    WeightsOnlyLoadPlanner,
    check_compatible,
    read_metadata,
    saved_tensor_shape,
)
from torchtitan_lite.protocols.model_spec import ModelSpec, build_model_args, get_model_spec

logger = logging.getLogger(__name__)

VOCAB_KEY = "tok_embeddings.weight"


def resolve_model(cfg: Any, *, vocab_size: int) -> tuple[ModelSpec, Any]:
    """(model spec, model args) of root config ``cfg``, with the vocabulary size the weights have.

    The vocabulary comes from the weights rather than the tokenizer: training grows the flavor's
    vocabulary to the tokenizer's, and the weights record the outcome.
    """
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=vocab_size)
    return spec, args


def checkpoint_vocab_size(checkpoint_dir: str) -> int:
    shape = saved_tensor_shape(read_metadata(checkpoint_dir), f"model.{VOCAB_KEY}")
    if shape is None:
        raise ValueError(f"{checkpoint_dir} holds no model.{VOCAB_KEY}; it is not a Llama-style model checkpoint")
    return shape[0]


def dcp_to_hf(checkpoint_dir: str, spec: Any, args: Any, out_dir: str, dtype_name: str,
              tokenizer: Any | None = None, run_config: str | None = None) -> None:
    """Model weights of a DCP checkpoint (any layout it was saved with) -> Hugging Face folder.

    With ``tokenizer`` (a built components.tokenizer.Tokenizer) the folder also gets the tokenizer files,
    BOS/EOS in config.json and a generation_config.json, so transformers' pipelines load it whole;
    ``run_config`` (a run's config.toml) is copied in, so scripts/generate.py --hf-dir needs no --config.
    """
    metadata = read_metadata(checkpoint_dir)
    with torch.device("meta"):
        model = spec.model_cls(args)
    target = {"model": {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}}
    check_compatible(checkpoint_dir, metadata, target, exact_prefixes=("model.",))
    dcp.load(target, checkpoint_id=checkpoint_dir, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    token_ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}

    def extra_files(folder: str) -> None:
        if tokenizer is not None:
            export_tokenizer(tokenizer.path, folder, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                             model_max_length=args.max_seq_len)
            write_generation_config(folder, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        if run_config is not None:
            shutil.copyfile(run_config, os.path.join(folder, RUN_CONFIG_NAME))

    hf_io.save_hf(out_dir, target["model"], spec.state_dict_adapter_cls(args), EXPORT_DTYPES[dtype_name],
                  extra=extra_files, **token_ids)
    logger.info("wrote %s: %s", out_dir, ", ".join(sorted(os.listdir(out_dir))))


def write_generation_config(folder: str, *, bos_id: int, eos_id: int) -> None:
    """generation_config.json: greedy decoding that stops at EOS (pads with it: the tokenizer has no pad)."""
    config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def hf_to_dcp(hf_dir: str, spec: Any, args: Any, out_dir: str) -> None:
    """Hugging Face folder -> model-only DCP checkpoint (with its completeness marker), usable as
    ``checkpoint.initial_load_path``. Tensors keep the dtype they have in the safetensors files."""
    adapter = spec.state_dict_adapter_cls(args)
    hf_io.check_hf_config(hf_dir, hf_io.read_hf_config(hf_dir), adapter.hf_config_dict())
    state = adapter.from_hf(hf_io.load_hf(hf_dir))
    with torch.device("meta"):
        expected = spec.model_cls(args).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{hf_dir} converts to a state without {missing[:5]}; pick the --config of this model")
    dcp.save({"model": state}, checkpoint_id=out_dir, no_dist=True)
    new_marker(0, 1, ["model"], model_only=True).write(out_dir)
    logger.info("wrote DCP seed checkpoint %s", out_dir)

