"""Fetch a Hugging Face model's tokenizer (and with --weights its safetensors) into assets/hf/<name>.

    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B
    HF_TOKEN=hf_... python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --weights
    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --output /shared/tokenizers/llama3

The published-size configs (llama3_1b ... llama3_405b_fp8) read the tokenizer from
assets/hf/Llama-3.1-8B, the default output for meta-llama/Llama-3.1-8B; run this from the repository
root. Llama repositories are gated: log in on the model page (https://huggingface.co/meta-llama/Llama-3.1-8B),
accept the licence, create a read token at https://huggingface.co/settings/tokens and pass it with HF_TOKEN
or --hf-token. The fetched folder is loaded as a tokenizer before this script reports success.
Weights are imported with scripts/convert_from_hf.py (the command is printed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.components.tokenizer_files import TokenizerError
from torchtitan_lite.hf_assets import LLAMA3_TOKENIZER_REPO, HubAccessError, default_output, download


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=LLAMA3_TOKENIZER_REPO, help="hub model repository (default: %(default)s)")
    parser.add_argument("--output", default=None, help="folder to write (default: assets/hf/<repository name>)")
    parser.add_argument("--weights", action="store_true", help="also fetch config.json and the *.safetensors weights")
    parser.add_argument("--hf-token", default=None, help="hub read token (default: the HF_TOKEN environment variable "
                                                         "or a token saved by `hf auth login`)")
    args = parser.parse_args(argv)
    output = Path(args.output) if args.output else default_output(args.repo)
    print(f"fetching {'tokenizer and weights' if args.weights else 'tokenizer'} of {args.repo} into {output}")
    try:
        folder = download(args.repo, output, weights=args.weights, token=args.hf_token)
        tokenizer = Tokenizer.Config(path=str(folder)).build()
    except (HubAccessError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"tokenizer: {tokenizer.describe()}")
    print(f"use it with --tokenizer.path {output}")
    if args.weights:
        print(f"import the weights with: python scripts/convert_from_hf.py --hf-dir {output} --config CONFIG "
              f"--output seeds/{output.name}, then train with --checkpoint.initial_load_path seeds/{output.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
