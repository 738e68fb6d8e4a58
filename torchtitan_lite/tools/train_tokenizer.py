"""Train a byte-fallback BPE SentencePiece tokenizer for use as ``--tokenizer.path``.

    python scripts/train_tokenizer.py --vocab-size 8192 --output tok.model
    python scripts/train_tokenizer.py --vocab-size 32000 --output tok.model --input 'data/*.jsonl'
    python scripts/train_tokenizer.py --vocab-size 32000 --output tok.model --input my/hub-dataset \
        --streaming --max-sentences 2000000

``--input`` takes anything ``--data.dataset`` takes (``embedded``, a file or glob, a dataset folder,
a hub dataset name) and reads its training split through the same code. The recipe and special ids
(unk=0, bos=1, eos=2, no pad) match the default tokenizer; see torchtitan_lite/components/tokenizer.py.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import get_args

from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.sources import DataFormat, load_split
from torchtitan_lite.components.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    MAX_TRAINING_SENTENCES,
    MIN_VOCAB_SIZE,
    Tokenizer,
    iter_texts,
    train_tokenizer,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="Path of the .model file to write.")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="Number of pieces.")
    parser.add_argument("--input", default="embedded",
                        help="Text source: 'embedded', a file or glob, a dataset folder or a hub dataset name.")
    parser.add_argument("--text-field", default="text", help="Record field holding the text.")
    parser.add_argument("--data-format", default="auto", choices=get_args(DataFormat),
                        help="Format of local files; 'auto' infers it from the extension.")
    parser.add_argument("--split", default="train", help="Split of a hub dataset or dataset folder.")
    parser.add_argument("--dataset-config", default=None, help="Hub dataset configuration name.")
    parser.add_argument("--streaming", action="store_true", help="Stream the source instead of caching it.")
    parser.add_argument("--max-sentences", type=int, default=MAX_TRAINING_SENTENCES,
                        help="Lines sampled (seeded reservoir) for training.")
    parser.add_argument("--threads", type=int, default=2, help="SentencePiece training threads.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the line sample and its shuffle.")
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB_SIZE:
        parser.error(f"--vocab-size {args.vocab_size} is too small; byte fallback needs at least {MIN_VOCAB_SIZE}")
    return args


def main(argv: list[str]) -> int:
    """Train the tokenizer ``argv`` describes, write it and print its special ids."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    source = TextDataLoader.Config(
        dataset=args.input, dataset_config=args.dataset_config, data_format=args.data_format,
        text_field=args.text_field, train_split=args.split, streaming=args.streaming, shuffle="none",
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    texts = iter_texts(load_split(source, "train"), args.text_field)
    train_tokenizer(texts, output, vocab_size=args.vocab_size, max_sentences=args.max_sentences,
                    num_threads=args.threads, seed=args.seed)
    tokenizer = Tokenizer.Config(path=str(output), vocab_size=args.vocab_size).build()
    print(f"wrote {output}: {tokenizer.vocab_size} pieces (unk={tokenizer.unk_id}, bos={tokenizer.bos_id}, "
          f"eos={tokenizer.eos_id}, pad={tokenizer.pad_id}) in {time.perf_counter() - start:.1f}s")
    return 0

