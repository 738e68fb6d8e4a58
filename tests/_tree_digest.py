"""A digest of every file and folder under a folder, to show that a refused run changed nothing."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree_digest(folder: str | Path) -> dict[str, str]:
    """Relative path -> sha256 of every file, 'dir' for every folder (hidden ones included)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            found[os.path.relpath(os.path.join(dirpath, name), folder)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, folder)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found
