"""Tokens per second of one process feeding training: tokenising into a store, reading a store, streaming.

    python scripts/data_loader_bench.py                                   # the embedded corpus, default tokenizer
    python scripts/data_loader_bench.py --dataset 'data/*.jsonl' --tokenizer assets/hf/Llama-3.1-8B --seq-len 8192

Three numbers for one process (one data-parallel rank): ``tokenise into a store`` is what a run without
``data.token_store`` spends once, at startup (``tokenize_store.write_store``, one process; scripts/pretokenize.py
runs it in several); ``read a store`` is the window loader handing out batches from a written store (every run
after that, and every run with ``data.token_store``), in ``data.shuffle`` order; ``stream`` is the streaming loader
tokenising as it reads (``data.streaming``). Each is the tokens handed out (or stored) over the wall time.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="embedded", help="Any --data.dataset that reads map-style.")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.path (default: the default tokenizer).")
    parser.add_argument("--seq-len", type=int, default=128, help="training.seq_len of the batches read.")
    parser.add_argument("--batch", type=int, default=16, help="training.local_batch_size of the batches read.")
    parser.add_argument("--shuffle", default="windows", choices=["windows", "documents", "none"],
                        help="data.shuffle of the store reader.")
    parser.add_argument("--read-tokens", type=int, default=20_000_000, help="Tokens to read from the store.")
    parser.add_argument("--stream-tokens", type=int, default=2_000_000, help="Tokens to read from the stream.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from torchtitan_lite.components.data import TextDataLoader
    from torchtitan_lite.components.data.token_store import open_store
    from torchtitan_lite.components.data.tokenize_store import write_store
    from torchtitan_lite.components.tokenizer import Tokenizer

    tokenizer = Tokenizer.Config(path=args.tokenizer).build()
    folder = Path(tempfile.mkdtemp(prefix="data_loader_bench."))
    try:
        source = TextDataLoader.Config(dataset=args.dataset, shuffle=args.shuffle)
        start = time.perf_counter()
        write_store(folder / "train", source, "train", tokenizer)
        seconds = time.perf_counter() - start
        store = open_store(folder / "train")
        print(f"tokenise into a store: {store.n_tokens / seconds:>12,.0f} tokens/s ({store.n_tokens:,} tokens, "
              f"{store.n_documents:,} documents in {seconds:.1f}s)")
        runtime = dict(tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=args.seq_len,
                       local_batch_size=args.batch, seed=0)
        reader = TextDataLoader.Config(dataset=args.dataset, token_store=str(folder), shuffle=args.shuffle)
        print(f"read a store ({args.shuffle}):  {_rate(reader.build(**runtime), args.read_tokens)}")
        stream = TextDataLoader.Config(dataset=args.dataset, streaming=True, shuffle="none")
        print(f"stream:                {_rate(stream.build(**runtime), args.stream_tokens)}")
        print(f"seq_len {args.seq_len}, batch {args.batch}, {os.cpu_count()} CPU(s), "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _rate(loader: Any, tokens: int) -> str:
    batches = iter(loader)
    next(batches)  # the first batch pays for opening files
    read, start = 0, time.perf_counter()
    while read < tokens:
        read += next(batches)[0].numel()
    seconds = time.perf_counter() - start
    return f"{read / seconds:>12,.0f} tokens/s ({read:,} tokens in {seconds:.2f}s)"
