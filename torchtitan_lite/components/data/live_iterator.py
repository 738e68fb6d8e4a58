"""One live iterator per loader: a loader's position is its own state, so an older iterator that kept reading
after ``iter()`` was called again (or after ``load_state_dict``) would move it behind the newer one's back."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class SingleLiveIterator:
    """Mixin: ``__iter__`` hands out ``self._batches(token)``; only the newest token's iterator may read."""

    _live_iterator: object | None = None

    def __iter__(self) -> Iterator[Any]:
        """Batches from the current position on. Only the newest iterator of a loader is usable."""
        token = object()
        self._live_iterator = token
        return self._batches(token)

    def _batches(self, token: object) -> Iterator[Any]:
        raise NotImplementedError

    def _check_live(self, token: object) -> None:
        if self._live_iterator is not token:
            raise RuntimeError("this data loader iterator is stale: a newer iterator was created or "
                               "load_state_dict() was called; call iter(loader) again")
