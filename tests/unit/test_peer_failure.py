"""A rank whose peer died says so in one line, instead of the backend's traceback."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from torchtitan_lite.peer_failure import peer_lost

ROOT = Path(__file__).resolve().parents[2]
# What the surviving rank of a PP 2 run got from its pipeline receive when the other rank was SIGKILLed.
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:50102: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error.")
MESSAGE = ("another rank of this run died (Connection reset by peer: the communication backend lost its connection "
           "to it), so this rank stops too; the cause is that rank's failure, which the launcher names (the rank "
           "that failed first)")


def test_a_lost_peer_is_told_from_other_errors():
    assert peer_lost(RuntimeError(GLOO_RESET)) == MESSAGE
    assert peer_lost(RuntimeError("[pair.cc:589] Connection closed by peer [10.0.0.2]:4242")) is not None
    assert peer_lost(RuntimeError("CUDA out of memory")) is None
    assert peer_lost(ValueError("Connection reset by peer")) is None  # not the backend's


def test_train_py_prints_one_line_for_a_lost_peer_and_lets_other_errors_through(tmp_path, monkeypatch, caplog):
    sys.path.insert(0, str(ROOT))
    import train
    from torchtitan_lite.trainer import Trainer

    class DiesWithItsPeer:
        def train(self):
            raise RuntimeError(GLOO_RESET)

    monkeypatch.setattr(Trainer.Config, "build", lambda self, **kw: DiesWithItsPeer())
    argv = ["--job.dump_folder", str(tmp_path / "run")]
    with caplog.at_level(logging.ERROR, logger="torchtitan_lite"):
        assert train.main(argv) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [MESSAGE]

    class Crashes:
        def train(self):
            raise RuntimeError("a bug")

    monkeypatch.setattr(Trainer.Config, "build", lambda self, **kw: Crashes())
    with pytest.raises(RuntimeError, match="a bug"):
        train.main(argv)
