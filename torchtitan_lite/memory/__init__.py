"""Parts of the memory estimate (torchtitan_lite/memory_estimate.py): parameter layout per rank,
optimizer-state bytes, activation bytes."""
