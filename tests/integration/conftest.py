import pytest
from _cli import run_cli


@pytest.fixture
def cli():
    """Runs ./run_train.sh (or train.py) in a subprocess and returns the CompletedProcess."""
    return run_cli
