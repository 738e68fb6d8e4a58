"""Cost of checkpoint checksums: save time of a >= 1 GB checkpoint with and without hashing, and the
hash rate of xxh3_128 and BLAKE2b over its files.

    python scripts/checkpoint_hash_bench.py --params-millions 90 --folder /tmp/hash_bench

The state is a stack of Linear layers plus two AdamW moments (about 12 bytes per parameter), saved
through CheckpointManager as in training. Results go to stdout as one line each.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

# The repository root first: a script is started with only its own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_lite.tools.project_python  # noqa: E402, F401  (no torch in this Python: re-runs with the project's)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=90.0)
    parser.add_argument("--folder", default="/tmp/checkpoint_hash_bench")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp
    import xxhash

    from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
    from torchtitan_lite.components.checkpoint.checksums import hash_file

    width = 4096
    layers = max(1, round(args.params_millions * 1e6 / width / width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()

    class Optim:
        def state_dict(self):
            return opt.state_dict()

        def load_state_dict(self, state) -> None:
            opt.load_state_dict(state)

    shutil.rmtree(args.folder, ignore_errors=True)
    manager = CheckpointManager.Config(enable=True, interval=1).build(
        dump_folder=args.folder, states={"model": ModelWrapper(model), "optimizer": Optim()})
    with_hash, plain = [], []
    for i in range(args.repeats):
        start = time.perf_counter()
        manager.save(i + 1, force=True)
        with_hash.append(time.perf_counter() - start)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        path = os.path.join(args.folder, f"plain-{i}")
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=path, no_dist=True)
        plain.append(time.perf_counter() - start)
        shutil.rmtree(path)
    step_dir = os.path.join(args.folder, "checkpoint", f"step-{args.repeats}")
    files = [os.path.join(step_dir, n) for n in os.listdir(step_dir) if not n.startswith(".complete")]
    size = sum(os.path.getsize(f) for f in files)

    def rate(make) -> float:
        start = time.perf_counter()
        for f in files:
            h = make()
            with open(f, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            h.hexdigest()
        return time.perf_counter() - start

    xxh = min(rate(xxhash.xxh3_128) for _ in range(args.repeats))
    blake = min(rate(hashlib.blake2b) for _ in range(args.repeats))
    start = time.perf_counter()
    for f in files:
        hash_file(f)
    ours = time.perf_counter() - start
    save_plain, save_hashed = min(plain), min(with_hash)
    print(f"checkpoint: {size / 1e9:.2f} GB in {len(files)} files ({layers} x Linear({width}, {width}) + AdamW)")
    print(f"save without checksums: {save_plain:.2f}s (best of {args.repeats})")
    print(f"save with checksums:    {save_hashed:.2f}s (best of {args.repeats}); "
          f"ratio {save_hashed / save_plain:.3f}")
    print(f"hash only, xxh3_128: {xxh:.2f}s ({size / xxh / 1e9:.2f} GB/s); hash_file (whole + per tensor): {ours:.2f}s")
    print(f"hash only, blake2b:  {blake:.2f}s ({size / blake / 1e9:.2f} GB/s)")
    print(f"xxh3_128 share of a save: {xxh / save_plain:.1%}; blake2b would be {blake / save_plain:.1%}")
    shutil.rmtree(args.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
