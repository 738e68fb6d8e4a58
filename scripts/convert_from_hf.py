"""Hugging Face Llama folder -> DCP seed checkpoint for ``--checkpoint.initial_load_path``.

    python scripts/convert_from_hf.py --hf-dir Llama-3.1-8B --config llama3_8b --output seeds/llama3_8b
    python scripts/convert_from_hf.py --hf-dir llama3_debug_hf --output seeds/debug   # a folder convert_to_hf.py wrote
    ./run_train.sh --config llama3_8b --checkpoint.enable --checkpoint.initial_load_path seeds/llama3_8b

Reads config.json plus model.safetensors (or the shards listed in model.safetensors.index.json),
checks the architecture against the config, and writes a model-only step-0 DCP checkpoint. The config
is --config NAME, or the run's config.toml that scripts/convert_to_hf.py copies into its folders.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
import config_registry
import models  # noqa: F401  (registers the model families)
from torchtitan_lite.components.checkpoint.convert import hf_to_dcp, resolve_model
from torchtitan_lite.components.checkpoint.hf_io import read_hf_config
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--config", help="registered config to train this model with (default: the folder's config.toml)")
    parser.add_argument("--output", required=True, help="DCP folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    vocab_size = read_hf_config(args.hf_dir)["vocab_size"]
    cfg = config_for_checkpoint(args.hf_dir, registry=config_registry.DEFAULT_REGISTRY, config_name=args.config)
    spec, model_args = resolve_model(cfg, vocab_size=vocab_size)
    hf_to_dcp(args.hf_dir, spec, model_args, args.output)


if __name__ == "__main__":
    main()
