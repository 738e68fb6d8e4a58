"""The logic behind the command-line tools in ``scripts/`` (benchmarks, numerics comparisons, tokenizer
training), importable and testable; each script is a thin entry point that wires in the model families
and the config registry and calls the ``main(argv)`` of its module here."""
