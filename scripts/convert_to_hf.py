"""DCP checkpoint -> Hugging Face Llama folder (config.json, model.safetensors, tokenizer, generation_config.json).

    python scripts/convert_to_hf.py --checkpoint outputs/llama3_debug/checkpoint/step-200 --output llama3_debug_hf
    python scripts/convert_to_hf.py --checkpoint ckpt/step-1000 --config llama3_8b --dtype bfloat16 --output llama3_8b_hf

The model and tokenizer come from the config.toml saved in the checkpoint (overrides included; for
older checkpoints the run's <dump_folder>/config.toml; a folder scripts/convert_from_hf.py wrote holds
one too); --config NAME uses a registered config instead. A tokenizer whose ids do not match the model's
vocabulary is refused (--no-tokenizer exports the weights alone).
The weights are written in that config's checkpoint.export_dtype (float32 by default, as for
checkpoint.last_save_in_hf) unless --dtype says otherwise. The result loads with
``transformers.LlamaForCausalLM.from_pretrained(output)`` and ``AutoTokenizer.from_pretrained(output)``.
Any saved layout works (FSDP, TP, 1 process); only the model weights are read.
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
from torchtitan_lite.components.checkpoint.convert import (
    check_export_tokenizer,
    checkpoint_vocab_size,
    dcp_to_hf,
    resolve_model,
)
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint, find_run_config
from torchtitan_lite.tools.one_line_refusal import refusing_in_one_line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="DCP checkpoint folder, e.g. <dump>/checkpoint/step-N")
    parser.add_argument("--config", help="registered config to use instead of the run's config.toml")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="dtype of the exported weights (default: the config's checkpoint.export_dtype, float32 "
                             "unless the run set it)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="write the weights and config.json alone, without the config's tokenizer")
    parser.add_argument("--output", required=True, help="folder to write the Hugging Face model to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def convert() -> None:
        cfg = config_for_checkpoint(args.checkpoint, registry=config_registry.DEFAULT_REGISTRY,
                                    config_name=args.config)
        spec, model_args = resolve_model(cfg, vocab_size=checkpoint_vocab_size(args.checkpoint))
        tokenizer = None if args.no_tokenizer else cfg.tokenizer.build()
        if tokenizer is not None:
            check_export_tokenizer(tokenizer, cfg, spec, model_args)
        run_config = None if args.config else find_run_config(args.checkpoint)
        dcp_to_hf(args.checkpoint, spec, model_args, args.output, args.dtype or cfg.checkpoint.export_dtype,
                  tokenizer=tokenizer, run_config=None if run_config is None else str(run_config))

    refusing_in_one_line(convert)


if __name__ == "__main__":
    main()
