"""Offline conversion between DCP checkpoints and Hugging Face folders (used by scripts/convert_*_hf.py).

Both directions run on CPU in one process and never instantiate real weights beyond the ones
converted: the expected keys and shapes come from a model built on the ``meta`` device.
"""
from __future__ import annotations

import dataclasses
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
from torchtitan_lite.config.toml_io import config_to_toml
from torchtitan_lite.protocols.model_spec import ModelSpec, build_model_args, get_model_spec

logger = logging.getLogger(__name__)

VOCAB_KEY = "tok_embeddings.weight"
IMPORTED_HF_CONFIG = "hf_config.json"
"""The copy of config.json an imported folder keeps when its model is no flavor's (its model.hf_config)."""


def resolve_model(cfg: Any, *, vocab_size: int) -> tuple[ModelSpec, Any]:
    """(model spec, model args) of root config ``cfg``, with the vocabulary size the weights have.

    The vocabulary comes from the weights rather than the tokenizer: training grows the flavor's
    vocabulary to the tokenizer's, and the weights record the outcome.
    """
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=vocab_size,
                            hf_config=cfg.model.hf_config)
    return spec, args


def checkpoint_vocab_size(checkpoint_dir: str) -> int:
    shape = saved_tensor_shape(read_metadata(checkpoint_dir), f"model.{VOCAB_KEY}")
    if shape is None:
        raise ValueError(f"{checkpoint_dir} holds no model.{VOCAB_KEY}; it is not a Llama-style model checkpoint")
    return shape[0]


def check_export_tokenizer(tokenizer: Any, cfg: Any, spec: ModelSpec, args: Any) -> None:
    """Refuses to attach ``tokenizer`` to an export of a model whose vocabulary is another's.

    Its ids must number the model's embedding rows, or fewer where the rows are explained without it: the
    flavor's own vocabulary (training keeps a flavor's larger vocabulary), or, for a model built from a
    config.json (model.hf_config), a tokenizer kept beside that file (the one the model came with)."""
    rows, ids = args.vocab_size, tokenizer.vocab_size
    if ids == rows:
        return
    if ids < rows:
        if cfg.model.hf_config is None:
            flavor_rows = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers).vocab_size
            if rows == flavor_rows:
                return
        elif os.path.dirname(os.path.abspath(tokenizer.path)) == os.path.dirname(os.path.abspath(cfg.model.hf_config)):
            return
    raise ValueError(f"the tokenizer {tokenizer.path} has {ids} ids but the model's embedding has {rows} rows: it is "
                     "not this model's tokenizer, and the export would pair them; pass --config with a config whose "
                     "tokenizer.path is the model's, or --no-tokenizer to export the weights alone")


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


def resolve_hf_model(hf_dir: str, cfg: Any) -> tuple[ModelSpec, Any]:
    """(model spec, model args) of the Hugging Face folder ``hf_dir`` under root config ``cfg``.

    A family that reads config.json (``spec.args_from_hf``: qwen3_moe, deepseek_v3) builds the folder's model
    whatever its size, the flavor of ``cfg`` giving only what the file has no field for; the others (llama3)
    build the flavor. Either way config.json is then compared with the config.json of the args, rotary settings
    included, so the model is the one the file describes or the conversion is refused.
    """
    config = hf_io.read_hf_config(hf_dir)
    spec = get_model_spec(cfg.model.name)
    if spec.state_dict_adapter_cls is None:
        raise ValueError(f"model family {spec.name!r} has no Hugging Face adapter, so {hf_dir} cannot be read")
    if not isinstance(config.get("vocab_size"), int):
        raise ValueError(f"{os.path.join(hf_dir, hf_io.CONFIG_NAME)} has no vocab_size; it is not the config.json "
                         "of a Hugging Face causal language model")
    if spec.args_from_hf is None:
        args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, vocab_size=config["vocab_size"],
                                hf_config=cfg.model.hf_config)
        check_hf_folder(hf_dir, config, spec, args, from_file=False)
    else:
        args = build_model_args(spec, cfg.model.flavor, hf_config=os.path.join(hf_dir, hf_io.CONFIG_NAME))
        check_hf_folder(hf_dir, config, spec, args, from_file=True)
    return spec, args


def check_hf_folder(hf_dir: str, config: dict[str, Any], spec: ModelSpec, args: Any, *, from_file: bool) -> None:
    """config.json against the config.json ``args`` give: a field that differs is a feature the family cannot
    build (``from_file``: the args were derived from this file) or a --config of another model."""
    adapter = spec.state_dict_adapter_cls(args)  # type: ignore[misc]  # callers checked it is not None
    if from_file:
        what, fix = f"the {spec.name} model built from it has", "such a model cannot be converted"
    else:
        what, fix = "the chosen model configuration has", "pick the --config that matches this model"
    hf_io.check_hf_config(hf_dir, config, adapter.hf_config_dict(), ignore=getattr(adapter, "hf_unused_keys", ()),
                          aliases=getattr(adapter, "hf_aliases", None), what=what, fix=fix)


def import_config(cfg: Any, spec: ModelSpec, args: Any, out_dir: str) -> Any:
    """The root config that builds ``args`` and trains with ``cfg``'s other settings, for the config.toml of
    an imported folder: ``cfg`` itself where its flavor has this shape, else ``cfg`` with model.hf_config
    naming the copy of config.json the folder keeps (``IMPORTED_HF_CONFIG``)."""
    model = dataclasses.replace(cfg.model, hf_config=None)
    flavor_args = build_model_args(spec, model.flavor, n_layers=model.n_layers, vocab_size=args.vocab_size)
    if flavor_args == args:
        return dataclasses.replace(cfg, model=model)
    path = os.path.abspath(os.path.join(out_dir, IMPORTED_HF_CONFIG))
    return dataclasses.replace(cfg, model=dataclasses.replace(model, hf_config=path, n_layers=None))


def hf_to_dcp(hf_dir: str, spec: Any, args: Any, out_dir: str, run_config: Any | None = None) -> None:
    """Hugging Face folder -> model-only DCP checkpoint (with its completeness marker), usable as
    ``checkpoint.initial_load_path``. Tensors keep the dtype they have in the safetensors files.

    ``run_config`` (``import_config``'s root config) is saved as the folder's config.toml, with the copy of
    config.json it names, so the folder converts back and generates without --config."""
    adapter = spec.state_dict_adapter_cls(args)
    hf_io.check_hf_config(hf_dir, hf_io.read_hf_config(hf_dir), adapter.hf_config_dict(),
                          ignore=getattr(adapter, "hf_unused_keys", ()), aliases=getattr(adapter, "hf_aliases", None))
    state = adapter.from_hf(hf_io.load_hf(hf_dir))
    with torch.device("meta"):
        expected = spec.model_cls(args).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{hf_dir} converts to a state without {missing[:5]}; pick the --config of this model")
    dcp.save({"model": state}, checkpoint_id=out_dir, no_dist=True)
    if run_config is not None:
        if run_config.model.hf_config is not None:
            shutil.copyfile(os.path.join(hf_dir, hf_io.CONFIG_NAME), run_config.model.hf_config)
        with open(os.path.join(out_dir, RUN_CONFIG_NAME), "w") as f:
            f.write(config_to_toml(run_config))
    new_marker(0, 1, ["model"], model_only=True).write(out_dir)
    logger.info("wrote DCP seed checkpoint %s", out_dir)
