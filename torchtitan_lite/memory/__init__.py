"""Per-rank memory of a training run, predicted before launch: the estimate (estimate.py; a rank's terms in
step_rank.py and pipeline_rank.py, the sizes both share in rank_sizes.py, the estimate's fields in terms.py and its
table in estimate_table.py) and its parts: parameter layout per rank (layout.py), optimizer-state bytes,
activation bytes, the step timeline."""
