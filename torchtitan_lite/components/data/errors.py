"""The error every data module raises for a source it cannot use (kept apart so that each can import it)."""
from __future__ import annotations


class DataSourceError(ValueError):
    """A data source is missing, empty or not shaped as configured; the message says how to fix it."""
