"""Time to the first batch of a data loader whose first document is huge (50 MB by default).

    python scripts/first_window_bench.py --megabytes 50 --folder /tmp/first_window_bench

Writes one JSON-lines file holding the huge document (Python-like source lines) and a small one after
it, then for each repeat builds a streaming ``TextDataLoader`` over it (a stream tokenises as it reads; a
random-access source is tokenised into its store whole before the first batch) with the default tokenizer
(``seq_len`` 256, 8 windows a batch, as ``llama3_debug``) and times: building the loader (``datasets``
reading the file into its Arrow cache, the bad-record scan), the first batch, and the next ten. Then,
once, a finite pass over the whole file (every batch of the document). The peak resident memory of the
process is printed at the end (Linux ``ru_maxrss``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="first_window_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=50.0, help="size of the huge document")
    parser.add_argument("--folder", default="/tmp/first_window_bench", help="scratch folder (replaced)")
    parser.add_argument("--repeats", type=int, default=2, help="loaders built and timed; the best is kept")
    args = parser.parse_args(argv)

    import datasets

    from torchtitan_lite.components.data import TextDataLoader
    from torchtitan_lite.components.tokenizer import Tokenizer

    shutil.rmtree(args.folder, ignore_errors=True)
    os.makedirs(args.folder)
    datasets.config.HF_DATASETS_CACHE = os.path.join(args.folder, "hf-cache")
    datasets.disable_progress_bars()
    path = os.path.join(args.folder, "huge.jsonl")
    chars = _write_document(path, int(args.megabytes * 1e6))
    tokenizer = Tokenizer.Config().build()
    build_s, first_s, next_s = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        loader = TextDataLoader.Config(dataset=path, streaming=True, shuffle="none").build(
            tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=256, local_batch_size=8)
        built = time.perf_counter()
        batches = iter(loader)
        next(batches)
        first = time.perf_counter()
        for _ in range(10):
            next(batches)
        build_s.append(built - start)
        first_s.append(first - built)
        next_s.append(time.perf_counter() - first)
    start = time.perf_counter()
    finite = TextDataLoader.Config(dataset=path, streaming=True, shuffle="none").build(
        tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=256, local_batch_size=8, infinite=False)
    n_batches = sum(1 for _ in finite)
    whole_s = time.perf_counter() - start
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1024**3
    print(f"document: {chars / 1e6:.1f} M characters in {path}")
    print(f"build loader:  {min(build_s):.2f}s (best of {args.repeats}: {_list(build_s)})")
    print(f"first batch:   {min(first_s):.2f}s (best of {args.repeats}: {_list(first_s)})")
    print(f"next 10:       {min(next_s):.3f}s (best of {args.repeats}: {_list(next_s)})")
    print(f"whole file:    {whole_s:.2f}s ({n_batches} batches, one finite pass)")
    print(f"peak RSS:      {peak_gib:.2f} GiB")
    shutil.rmtree(args.folder, ignore_errors=True)
    return 0


def _write_document(path: str, size: int) -> int:
    block = "".join(f"    value_{i} = compute({i}, other={i * 7})  # step {i}\n" for i in range(200))
    document = block * (size // len(block) + 1)
    with open(path, "w") as f:
        f.write(json.dumps({"text": document}) + "\n" + json.dumps({"text": "a small document after it"}) + "\n")
    return len(document)


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)
