"""Hugging Face Llama folders: ``config.json`` + ``model.safetensors`` in and out.

Name mapping and the q/k rotary layout change belong to the model's state-dict adapter
(``to_hf`` / ``from_hf`` / ``hf_config_dict``); this module only moves tensors and files.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torchtitan_lite.components.checkpoint.hf_rope import ROPE_KEYS, read_rope, rope_difference

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# config.json fields that change neither the weights' meaning nor the function the model computes.
_NOT_ARCHITECTURE = ("torch_dtype", "architectures", "transformers_version", "initializer_range", "use_cache")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


logger = logging.getLogger(__name__)


def export_model_state(state: dict[str, Any], out_dir: str, adapter: Any, dtype: torch.dtype, *, write: bool,
                       extra: Callable[[str], None] | None = None) -> None:
    """Gather a (possibly sharded) model state and, where ``write``, save it as a Hugging Face folder
    (``extra(folder)`` adds files to it, see ``save_hf``).

    Every rank must call it: ``full_tensor`` is collective, each rank gathers each tensor in the same order.
    """
    full: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if write:
            full[key] = value.detach().to(device="cpu", dtype=export_dtype(adapter, key, dtype))
    if write:
        save_hf(out_dir, full, adapter, dtype, extra)
        logger.info("exported Hugging Face model to %s", out_dir)
    if dist.is_initialized():
        dist.barrier()


def model_keys(metadata: Metadata) -> list[str]:
    """The ``model.`` keys of a DCP checkpoint's metadata."""
    return [k for k in metadata.state_dict_metadata if k.startswith("model.")]


def load_dcp_model(path: str, metadata: Metadata) -> dict[str, torch.Tensor]:
    """The whole model state of DCP checkpoint ``path`` (this project's names, full tensors) read by this process
    alone, as saved (e.g. by pipeline stages that each wrote their own blocks)."""
    target: dict[str, Any] = {"model": {}}
    for key in model_keys(metadata):
        entry = metadata.state_dict_metadata[key]
        assert isinstance(entry, TensorStorageMetadata), f"{key} is not a tensor in {path}"
        target["model"][key.removeprefix("model.")] = torch.empty(entry.size, dtype=entry.properties.dtype)
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target["model"]


def save_hf(out_dir: str, state_dict: dict[str, torch.Tensor], adapter: Any, dtype: torch.dtype,
            extra: Callable[[str], None] | None = None, **config_fields: Any) -> None:
    """Write ``state_dict`` (this project's names, full unsharded tensors) as a Hugging Face folder.

    ``config_fields`` (e.g. bos_token_id) go to config.json; ``extra(folder)`` writes further files
    (tokenizer, generation config) before the folder is published. Files go to a temporary sibling
    folder that is renamed at the end, so ``out_dir`` is either absent or whole.
    """
    hf_state = adapter.to_hf(state_dict)
    tensors = {k: v.detach().to(device="cpu", dtype=export_dtype(adapter, k, dtype)).contiguous()
               for k, v in hf_state.items()}
    config = dict(adapter.hf_config_dict(**config_fields))
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    tmp = f"{out_dir.rstrip(os.sep)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
    if extra is not None:
        extra(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def export_dtype(adapter: Any, key: str, dtype: torch.dtype) -> torch.dtype:
    """float32 for a tensor whose name (ours or HF's) ends with one of the adapter's ``float32_suffixes`` (state
    that steers a discrete choice, such as DeepSeek-V3's expert bias, which transformers keeps in float32 too),
    ``dtype`` for every other."""
    return torch.float32 if key.endswith(tuple(getattr(adapter, "float32_suffixes", ()))) else dtype


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; a Hugging Face model folder needs {CONFIG_NAME} "
                                f"and {WEIGHTS_NAME}")
    with open(path) as f:
        return json.load(f)


def load_hf(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (one ``model.safetensors`` or an index of shards), HF names."""
    files = _weight_files(hf_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors reports truncation as several error types
            raise ValueError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    return tensors


def canonical_names(config: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``config`` with each alias key (transformers' ``attribute_map``: transformers 5 writes num_local_experts
    where 4 wrote num_experts) renamed to the name our adapter writes; a file giving both must agree."""
    out = dict(config)
    for alias, name in aliases.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ValueError(f"config.json gives {alias}={value!r} and {name}={out[name]!r}, two names of one "
                                 "field; keep one")
            out[name] = value
    return out


def check_hf_config(hf_dir: str, config: dict[str, Any], expected: dict[str, Any], *, ignore: tuple[str, ...] = (),
                    aliases: dict[str, str] | None = None, what: str = "the chosen model configuration has",
                    fix: str = "pick the --config that matches this model") -> None:
    """Fail on the first architecture field of ``config.json`` that differs from ``expected`` (a config.json our
    adapter writes), the message saying "<key>=<file's> but <what> <key>=<ours>; <fix>". The rotary settings are
    compared by the function they compute, whichever form (transformers 4's rope_theta / rope_scaling,
    transformers 5's rope_parameters) each side uses; other keys ``config`` lacks, and those in ``ignore``, are
    not compared; ``aliases`` (the adapter's ``hf_aliases``) name the other names of a field."""
    where = os.path.join(hf_dir, CONFIG_NAME)
    if config.get("model_type", expected.get("model_type")) != expected.get("model_type"):  # first: another family
        raise ValueError(f"{where}: model_type={config['model_type']!r} but {what} model_type="
                         f"{expected.get('model_type')!r}; pick the --config of the model's family")
    try:
        config = canonical_names(config, aliases or {})
        difference = rope_difference(read_rope(config), read_rope(expected))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if difference is not None:
        raise ValueError(f"{where}: the rotary settings differ from those {what}: {difference}; {fix}")
    for key, want in expected.items():
        if key in (*_NOT_ARCHITECTURE, *ROPE_KEYS, *ignore) or key not in config:
            continue
        if config[key] != want:
            raise ValueError(f"{where}: {key}={config[key]!r} but {what} {key}={want!r}; {fix}")


def _weight_files(hf_dir: str) -> list[str]:
    single = os.path.join(hf_dir, WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(hf_dir, WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(hf_dir, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {missing}")
        return files
    raise FileNotFoundError(f"{hf_dir} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
