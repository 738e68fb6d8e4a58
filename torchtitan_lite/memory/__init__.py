"""Per-rank memory of a training run, predicted before launch: the estimate (estimate.py) and its parts:
parameter layout per rank (layout.py), optimizer-state bytes, activation bytes, the step timeline."""
