"""Tokenise a source once into a token store that training reads with ``--data.token_store``.

    python scripts/pretokenize.py --output data/tokens                  # the embedded corpus, default tokenizer
    python scripts/pretokenize.py --dataset 'data/train-*.jsonl' --validation-files data/val.jsonl \
        --tokenizer assets/hf/Llama-3.1-8B --output data/tokens --workers 8
    ./run_train.sh --data.token_store data/tokens --tokenizer.path assets/hf/Llama-3.1-8B

``--dataset`` takes anything ``--data.dataset`` takes that can be read map-style (``embedded``, a file or glob,
a dataset folder, a hub dataset name), through the same code. ``OUTPUT/train`` and ``OUTPUT/validation``
(when the source has a validation split or ``--validation-files`` is given) each get memory-mapped token
shards (uint16 up to 65,536 ids, uint32 above), every document's start offset and an ``index.json`` with
the tokenizer's fingerprint and a checksum per file (see torchtitan_lite/components/data/token_store.py).
Shards are tokenised in ``--workers`` processes. A run without ``--data.token_store`` writes the same store
into its cache on first use: the windows it trains on are the same bytes.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import get_args

from torchtitan_lite.components.data import DataSourceError, TextDataLoader
from torchtitan_lite.components.data.sources import DataFormat, check_options
from torchtitan_lite.components.data.token_store import open_store
from torchtitan_lite.components.data.tokenize_store import write_store
from torchtitan_lite.components.tokenizer import DEFAULT_VOCAB_SIZE, Tokenizer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="Folder to write train/ and validation/ stores into.")
    parser.add_argument("--dataset", default="embedded",
                        help="Text source: 'embedded', a file or glob, a dataset folder or a hub dataset name.")
    parser.add_argument("--dataset-config", default=None, help="Hub dataset or dataset folder configuration.")
    parser.add_argument("--data-format", default="auto", choices=get_args(DataFormat),
                        help="Format of local files; 'auto' infers it from the extension.")
    parser.add_argument("--text-field", default="text", help="Record field holding the text.")
    parser.add_argument("--train-split", default="train", help="Split to train on.")
    parser.add_argument("--validation-split", default="validation", help="Split to validate on.")
    parser.add_argument("--validation-files", default=None, help="File or glob of held-out validation documents.")
    parser.add_argument("--on-bad-record", default="error", choices=["error", "skip"],
                        help="A record without a string text: stop ('error') or leave it out ('skip').")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.path of the runs that will read the store (default: the default tokenizer).")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="Vocabulary of the default tokenizer (without --tokenizer).")
    parser.add_argument("--splits", default="train,validation",
                        help="Comma-separated roles to write; validation is left out when the source has none.")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Tokenising processes.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    source = TextDataLoader.Config(
        dataset=args.dataset, dataset_config=args.dataset_config, data_format=args.data_format,
        text_field=args.text_field, train_split=args.train_split, validation_split=args.validation_split,
        validation_files=args.validation_files, on_bad_record=args.on_bad_record, shuffle="none")
    tokenizer_config = Tokenizer.Config(path=args.tokenizer, vocab_size=args.vocab_size)
    tokenizer = tokenizer_config.build()
    output = Path(args.output)
    for role in [r.strip() for r in args.splits.split(",") if r.strip()]:
        if role not in ("train", "validation"):
            raise SystemExit(f"--splits: {role!r} is not 'train' or 'validation'")
        target = output / role
        if target.exists():
            raise SystemExit(f"{target} already exists; remove it or choose another --output")
        if role == "validation":
            try:
                check_options(source, validation=True)
            except DataSourceError as error:
                print(f"no validation store: {error}")
                continue
        output.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # Written beside the target and moved into place at once: a killed run leaves no half store.
        scratch = Path(tempfile.mkdtemp(prefix=f".{role}.", dir=output))
        try:
            write_store(scratch / role, source, role, tokenizer, tokenizer_config=tokenizer_config,
                        workers=args.workers, progress=True)
            os.replace(scratch / role, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        store = open_store(target, what=str(target))
        seconds = time.perf_counter() - start
        print(f"wrote {target}: {store.n_documents} documents, {store.n_tokens} tokens ({store.index['dtype']}) in "
              f"{len(store.index['shards'])} shard(s), {seconds:.1f}s ({store.n_tokens / seconds:,.0f} tokens/s); "
              f"tokenizer {store.tokenizer['name']} (fingerprint {store.tokenizer['fingerprint']})")
    return 0
