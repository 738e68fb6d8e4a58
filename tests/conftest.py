"""Wiring for the tests, as train.py does it for a run: importing `models` registers the model families
with the core, which looks them up by name."""
import models  # noqa: F401
