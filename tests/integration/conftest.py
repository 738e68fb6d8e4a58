import pytest
from _cli import Launch, run_cli


@pytest.fixture
def cli():
    """Runs ./run_train.sh (or train.py) in a subprocess and returns the CompletedProcess."""
    return run_cli


@pytest.fixture(autouse=True)
def _no_launch_outlives_its_test():
    """A test that fails while a background launch runs must not leave training processes behind."""
    yield
    for launch in list(Launch.running):
        launch.kill()
