"""Sample text from a trained model (scripts/generate.py): a DCP checkpoint of a run, or a Hugging Face folder.

    python scripts/generate.py --checkpoint outputs/llama3_debug/checkpoint/step-200 --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py --hf-dir llama3_debug_hf --prompt "def main(" --temperature 0.8 --top-p 0.9 --seed 0

The architecture and tokenizer come from the config.toml saved in the checkpoint or exported folder (for
older checkpoints the run's <dump_folder>/config.toml); --config NAME uses a registered config instead. Greedy by default.
"""
from __future__ import annotations

import argparse
import logging
import sys

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.library_notices import silence_known_library_notices


def main(argv: list[str], *, registry: ConfigRegistry) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="DCP checkpoint folder, e.g. <dump>/checkpoint/step-N (any layout)")
    source.add_argument("--hf-dir", help="Hugging Face folder written by scripts/convert_to_hf.py")
    parser.add_argument("--config", help="registered config to build the model from instead of the run's config.toml")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; >0 samples")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens summing to p")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--no-kv-cache", action="store_true", help="rerun the whole prefix for each token (slow)")
    parser.add_argument("--no-bos", action="store_true", help="do not start the prompt with the BOS token")
    args = parser.parse_args(argv)
    silence_known_library_notices()
    from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
    from torchtitan_lite.components.generation import generate, load_from_dcp, load_from_hf
    from torchtitan_lite.components.sampling import SamplingConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    source_dir = args.checkpoint or args.hf_dir
    cfg = config_for_checkpoint(source_dir, registry=registry, config_name=args.config)
    loaded = load_from_dcp(args.checkpoint, cfg) if args.checkpoint else load_from_hf(args.hf_dir, cfg)
    prompt_ids = loaded.tokenizer.encode(args.prompt, bos=not args.no_bos, eos=False)
    new_ids = generate(loaded, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                       use_cache=not args.no_kv_cache)
    text = args.prompt + loaded.tokenizer.decode(new_ids)
    print(text)
    return text


def cli(argv: list[str], *, registry: ConfigRegistry) -> None:
    """scripts/generate.py: ``main``, a checkpoint, folder or prompt it cannot use refused in one line."""
    from torchtitan_lite.tools.one_line_refusal import refusing_in_one_line

    refusing_in_one_line(lambda: main(argv, registry=registry))
