"""Conversion and generation scripts refuse bad input in one ``error:`` line (exit 2), not with a traceback."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torchtitan_lite.components.checkpoint.verify import CheckpointError

REFUSALS = (ValueError, KeyError, OSError, CheckpointError)
"""What the conversion code raises for input it cannot use (a config.json, weights, tokenizer or checkpoint it
cannot read or build): each names the file and the fix. Other errors keep their traceback."""


def refusing_in_one_line(run: Callable[[], Any]) -> None:
    """``run()``; a refusal it raises is printed as one line on stderr and exits 2."""
    try:
        run()
    except REFUSALS as e:
        # KeyError's str() is the repr of its argument: print the message itself.
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
        raise SystemExit(2) from None
