"""models.common.init.trunc_normal_: one seed gives the same weights on every supported torch release."""
from __future__ import annotations

import torch

from models.common.init import TRUNCATION_STDS, trunc_normal_


def test_one_seed_gives_the_same_truncated_normal_weights_on_every_torch_release():
    torch.manual_seed(0)
    w = trunc_normal_(torch.empty(64, 64), std=0.02)
    # Measured identical with torch 2.11 and 2.13, and equal to torch 2.13's nn.init.trunc_normal_; torch 2.11's
    # nn.init draws other values from this seed (inverse CDF of a uniform draw; its first value is -1.87e-4).
    assert w[0, :4].tolist() == [-0.022516796365380287, -0.023047203198075294, -0.005011571571230888,
                                 -0.00867757573723793]
    assert round(w.double().sum().item(), 8) == -1.21611835


def test_values_outside_the_cut_are_drawn_again_and_the_others_kept():
    torch.manual_seed(1)
    first_draw = torch.empty(4096).normal_()
    torch.manual_seed(1)
    w = trunc_normal_(torch.empty(4096), std=1.0)
    outside = first_draw.abs() > TRUNCATION_STDS
    assert 0 < int(outside.sum()) < 40  # 0.27% of 4096 expected
    assert torch.equal(w[~outside], first_draw[~outside])
    assert w.abs().max() <= TRUNCATION_STDS
