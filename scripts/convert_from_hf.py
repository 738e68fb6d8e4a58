"""Hugging Face Llama folder -> DCP seed checkpoint for ``--checkpoint.initial_load_path``.

    python scripts/convert_from_hf.py --hf-dir Llama-3.1-8B --config llama3_8b --output seeds/llama3_8b
    python scripts/convert_from_hf.py --hf-dir llama3_debug_hf --output seeds/debug   # a folder convert_to_hf.py wrote
    ./run_train.sh --config llama3_8b --checkpoint.enable --checkpoint.initial_load_path seeds/llama3_8b

Reads config.json plus model.safetensors (or the shards listed in model.safetensors.index.json) and
writes a model-only step-0 DCP checkpoint. The config is --config NAME, or the run's config.toml that
scripts/convert_to_hf.py copies into its folders. qwen3_moe and deepseek_v3 take the architecture from
config.json, any size the family supports (the config's flavor gives only the training settings the file
has no field for); llama3 checks it against the config's flavor. Rotary settings are read in either form
(rope_theta / rope_scaling, or transformers 5's rope_parameters); what the model cannot compute is refused.
The output holds its config.toml (and, for a model of no flavor's shape, the copy of config.json its
model.hf_config names), so scripts/convert_to_hf.py and scripts/generate.py read it without --config.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
import torchtitan_lite.tools.script_start  # noqa: E402, F401  (before torchao prints its notices)

# isort: split
import config_registry
import models  # noqa: F401  (registers the model families)
from torchtitan_lite.components.checkpoint.convert import hf_to_dcp, import_config, resolve_hf_model
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.tools.one_line_refusal import refusing_in_one_line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--config", help="registered config to train this model with (default: the folder's config.toml)")
    parser.add_argument("--output", required=True, help="DCP folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def convert() -> None:
        cfg = config_for_checkpoint(args.hf_dir, registry=config_registry.DEFAULT_REGISTRY, config_name=args.config)
        spec, model_args = resolve_hf_model(args.hf_dir, cfg)
        run_config = import_config(cfg, spec, model_args, args.output)
        hf_to_dcp(args.hf_dir, spec, model_args, args.output, run_config=run_config)
        if run_config.model.hf_config is not None:
            logging.info("no %s flavor has this shape: its config.toml sets model.hf_config=%s; train from it with "
                         "--config-file %s --checkpoint.initial_load_path %s", spec.name, run_config.model.hf_config,
                         os.path.join(args.output, "config.toml"), args.output)

    refusing_in_one_line(convert)


if __name__ == "__main__":
    main()
