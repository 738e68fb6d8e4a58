"""clip_grad_norm_ on plain tensors (DTensors on mixed meshes: tests/distributed/test_grad_clip_dtensor.py)."""
from __future__ import annotations

import math

import pytest
import torch

from torchtitan_lite.distributed.grad_clip import clip_grad_norm_


def _params(scale: float = 1.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in [(4, 3), (5,), (2, 2)]:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * scale
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
def test_matches_torch_clip_grad_norm(norm_type, foreach):
    ours, theirs = _params(3.0), _params(3.0)
    total = clip_grad_norm_(ours, 1.0, norm_type=norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=norm_type)
    # Same reductions in float32 over 21 values: a few ulps at most.
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert type(total) is torch.Tensor and total.dtype == torch.float32


def test_max_norm_zero_only_measures_and_small_gradients_are_left_alone():
    params = _params(3.0)
    before = [p.grad.clone() for p in params]
    assert float(clip_grad_norm_(params, 0.0)) > 1.0
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    small = _params(1e-3)
    before = [p.grad.clone() for p in small]
    clip_grad_norm_(small, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(small, before))


def test_non_finite_norm_is_returned_and_gradients_are_not_scaled():
    params = _params()
    params[1].grad[0] = float("inf")
    before = [p.grad.clone() for p in params]
    assert math.isinf(float(clip_grad_norm_(params, 1.0)))
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_no_gradients_gives_zero_and_negative_max_norm_is_refused():
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0
    with pytest.raises(ValueError, match="training.max_norm=-1.0 must be >= 0"):
        clip_grad_norm_(_params(), -1.0)
