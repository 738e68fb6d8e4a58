"""``train.py`` whose loss turns non-finite from step ``TTL_TEST_DIVERGE_AT`` on, and is 1e6 times too large
(finite: a blow-up the spike bounds see) at step ``TTL_TEST_SPIKE_AT`` where that is set.

A real divergence (a high learning rate) reaches a non-finite loss at a step that depends on the CPU's
matmul kernels: about step 25 at lr 5 on an AVX2 host, never within 100 steps on an AVX-512 one (the
loss peaks near 1e3 and recovers). The stop, the message and the checkpoints it keeps are what the tests
check, so the divergence is planted at a known step instead, after normal steps that make the earlier
checkpoints known good.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from torchtitan_lite.trainer import Trainer

DIVERGE_AT = int(os.environ["TTL_TEST_DIVERGE_AT"])
SPIKE_AT = int(os.environ.get("TTL_TEST_SPIKE_AT", "0"))
_init = Trainer.__init__


def _init_with_diverging_loss(self: Trainer, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    loss_fn = self.runner.loss_fn

    def diverging(logits, labels):
        loss_sum, count = loss_fn(logits, labels)
        if self.train_state.step >= DIVERGE_AT:
            loss_sum = loss_sum * float("nan")
        elif self.train_state.step == SPIKE_AT:
            loss_sum = loss_sum * 1e6
        return loss_sum, count

    self.runner.loss_fn = diverging


Trainer.__init__ = _init_with_diverging_loss
train_py = Path(__file__).resolve().parents[2] / "train.py"
sys.argv = [str(train_py), *sys.argv[1:]]
runpy.run_path(str(train_py), run_name="__main__")
