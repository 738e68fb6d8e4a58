"""Content hashes of every file of a checkpoint, taken at save and checked at load.

DCP has no checksums: a flipped byte in a shard loads silently. ``ChecksummingWriter`` is DCP's
``FileSystemWriter`` that, on each rank, hashes the files that rank just wrote (they are still in
the page cache) and hands the digests to the coordinator with its write results; the coordinator
strips them before writing ``.metadata``, hashes ``.metadata`` too, and the manager stores all of
them in the ``.complete`` marker. Each file gets one hash over all its bytes plus one per tensor
(or byte blob) it holds, so a mismatch names the file and the byte range and tensor that changed.

xxh3_128 rather than BLAKE2b: both detect accidental corruption equally well (nobody forges a
shard), and on the benchmark CPU xxh3_128 hashes a 1 GB checkpoint several times faster (numbers
in BENCHMARKS.md, "Checkpoint checksums").
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20
_DIGEST_KEY = "__torchtitan_lite_checksum__"
"""Prefix of the pseudo write results that carry a rank's digests to the coordinator."""

FileDigest = dict[str, Any]
"""{"size": bytes, "hash": hex, "items": [[label, offset, length, hex], ...]} for one file."""


def item_label(index: MetadataIndex) -> str:
    """The state key of a stored item, with the shard's position when it is one shard of a tensor."""
    offset = tuple(index.offset) if index.offset is not None else ()
    return f"{index.fqn}@{offset}" if any(offset) else index.fqn


def hash_file(path: str, items: Iterable[tuple[str, int, int]] = ()) -> FileDigest:
    """Hash ``path`` whole and each ``(label, offset, length)`` range of it, in one sequential read."""
    ranges = sorted(items, key=lambda item: item[1])
    whole = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    digests = []
    with open(path, "rb") as f:

        def feed(length: int, part: Any = None) -> None:
            while length > 0:
                got = f.readinto(view[:min(length, _CHUNK)])
                if not got:
                    raise OSError(f"{path} ended early while hashing")
                whole.update(view[:got])
                if part is not None:
                    part.update(view[:got])
                length -= got

        position = 0
        for label, offset, length in ranges:
            feed(offset - position)
            part = xxhash.xxh3_128()
            feed(length, part)
            digests.append([label, offset, length, part.hexdigest()])
            position = offset + length
        while True:
            got = f.readinto(view)
            if not got:
                break
            whole.update(view[:got])
            position += got
    return {"size": position, "hash": whole.hexdigest(), "items": digests}


def verify_file(folder: str, name: str, expected: FileDigest) -> str | None:
    """None when ``folder/name`` matches its recorded digest, else what differs (file and range)."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
        kind = "truncated" if size < expected["size"] else "longer than written"
        return f"{path} is {kind}: {size} bytes, {expected['size']} were written"
    items = [(label, offset, length) for label, offset, length, _ in expected["items"]]
    actual = hash_file(path, items)
    if actual["hash"] == expected["hash"]:
        return None
    bad = [f"bytes [{offset}, {offset + length}) of {label!r}"
           for (label, offset, length, want), (*_, got) in zip(expected["items"], actual["items"], strict=True)
           if want != got]
    where = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") if bad \
        else "bytes outside any tensor (file framing)"
    return f"{path} does not match its {ALGORITHM} checksum: {where} changed since it was written"


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` that hashes what each rank wrote; ``checksums`` is set on the coordinator
    after ``finish`` (relative file name -> digest, ``.metadata`` included)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.checksums: dict[str, FileDigest] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        by_file: dict[str, list[tuple[str, int, int]]] = {}
        for result in results:
            info = result.storage_data
            by_file.setdefault(info.relative_path, []).append((item_label(result.index), info.offset, info.length))
        carried = [WriteResult(index=MetadataIndex(f"{_DIGEST_KEY}{name}"), size_in_bytes=0,
                               storage_data=hash_file(os.path.join(str(self.path), name), items))
                   for name, items in by_file.items()]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results + carried)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        checksums: dict[str, FileDigest] = {}
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if not r.index.fqn.startswith(_DIGEST_KEY)])
            for r in rank_results:
                if r.index.fqn.startswith(_DIGEST_KEY):
                    checksums[r.index.fqn[len(_DIGEST_KEY):]] = r.storage_data
        super().finish(metadata, kept)
        checksums[".metadata"] = hash_file(os.path.join(str(self.path), ".metadata"))
        self.checksums = checksums
