"""DCP checkpoint -> Hugging Face Llama folder (config.json + model.safetensors).

    python scripts/convert_to_hf.py --checkpoint outputs/checkpoint/step-1000 --config llama3_8b \
        --dtype bfloat16 --output llama3_8b_hf

The result loads with ``transformers.LlamaForCausalLM.from_pretrained(output)``. Any saved layout
works (FSDP, TP, 1 process); only the model weights are read.
"""
from __future__ import annotations

import argparse
import logging

import config_registry
import models  # noqa: F401  (registers the model families)
from torchtitan_lite.components.checkpoint.convert import checkpoint_vocab_size, dcp_to_hf, resolve_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="DCP checkpoint folder, e.g. <dump>/checkpoint/step-N")
    parser.add_argument("--config", required=True, help="registered config the checkpoint was trained with")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the exported weights")
    parser.add_argument("--output", required=True, help="folder to write config.json and model.safetensors to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec, model_args = resolve_model(config_registry.get(args.config), vocab_size=checkpoint_vocab_size(args.checkpoint))
    dcp_to_hf(args.checkpoint, spec, model_args, args.output, args.dtype)


if __name__ == "__main__":
    main()
