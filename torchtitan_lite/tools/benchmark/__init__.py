"""Training throughput of registry configs side by side (``scripts/benchmark.py``): the runner starts one
worker process per config, the worker measures, the report turns measurements into rates and tables."""
