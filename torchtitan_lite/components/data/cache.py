"""The on-disk cache for artefacts built on first use (embedded corpus, default tokenizer).

Every rank of every job on a machine may ask for the same artefact at once, so building happens under
an exclusive ``fcntl`` lock, into a temporary path next to the target that is moved into place with
one ``os.replace``: a reader sees either nothing or the complete artefact, never a half-written one,
and a build killed halfway leaves only a temporary path that the next build ignores.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "TORCHTITAN_LITE_CACHE"


def cache_root() -> Path:
    """``$TORCHTITAN_LITE_CACHE`` if set, else ``~/.cache/torchtitan_lite``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "torchtitan_lite"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first creating it with ``build(tmp_path)`` if it does not exist yet.

    ``build`` writes a file or a directory at the path it is given; that path is then renamed to
    ``target``. Concurrent callers wait on the lock and find the finished target.
    """
    if target.exists():
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.exists():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            built = scratch / target.name
            build(built)
            os.replace(built, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target
