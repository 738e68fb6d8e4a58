"""The balance-loss weight of one forward: 1 / (batches x pipeline micro-batches x data-parallel ranks), times
the FP16 loss scale. (The parallel layouts' router gradients against one process: tests/distributed, whose
harnesses weight the balance loss through the same function.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchtitan_lite.aux_loss_weight import set_aux_loss_weight


class Part:
    def __init__(self) -> None:
        self.scale: float | None = None

    def set_aux_loss_scale(self, scale: float) -> None:
        self.scale = scale


@pytest.mark.parametrize("pipeline_microbatches, dp_degree, want", [(None, 1, 8 / 3), (4, 1, 8 / 12),
                                                                    (None, 2, 8 / 6), (4, 2, 8 / 24)])
def test_every_part_weights_its_balance_loss_by_its_share_of_the_step(pipeline_microbatches, dp_degree, want):
    parts = [Part(), Part()]
    weight = set_aux_loss_weight(parts, n_batches=3, forwards_per_batch=pipeline_microbatches or 1,
                                 parallel_dims=SimpleNamespace(dp_degree=dp_degree), loss_scale=8.0)  # type: ignore[arg-type]
    assert weight == pytest.approx(want, rel=1e-15)
    assert [part.scale for part in parts] == [weight, weight]
