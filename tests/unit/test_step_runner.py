"""The local step runner does what the trainer did inline before it had runners: the batch's summed loss over the
step's global target tokens, the objective differentiated, the logits not kept; eval gives the loss function's
(sum, tokens). The pipeline runner against one process: tests/integration/test_train_pipeline.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.components.validate import Validator
from torchtitan_lite.distributed.step_runner import LocalRunner, share_loss


def _model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    inputs = torch.randint(0, 32, (2, 6))
    labels = torch.randint(0, 32, (2, 6))
    return model, inputs, labels


def test_step_normalises_by_the_global_tokens_and_differentiates_the_objective():
    model, inputs, labels = _model_and_batch()
    global_tokens = torch.tensor(30.0)  # more than this batch's 12: other micro-batches / ranks hold the rest
    loss_sum, _ = cross_entropy_sum(model(inputs), labels)
    (loss_sum / global_tokens * 4.0).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss = LocalRunner(model, cross_entropy_sum).step(inputs, labels, global_tokens=global_tokens,
                                                       objective=lambda loss: loss * 4.0)
    # Exact: the same operations in the same order. A dropped division is off by 30x, a dropped objective by 4x.
    assert torch.equal(loss, (loss_sum / global_tokens).detach()) and not loss.requires_grad
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))


def test_eval_is_the_loss_functions_sum_and_tokens_and_a_runner_without_group_keeps_its_loss():
    model, inputs, labels = _model_and_batch()
    labels[0, :3] = -100  # ignored targets leave the token count
    with torch.no_grad():
        loss_sum, tokens = LocalRunner(model, cross_entropy_sum).eval(inputs, labels)
        expected_sum, expected_tokens = cross_entropy_sum(model(inputs), labels)
    assert torch.equal(loss_sum, expected_sum) and int(tokens) == int(expected_tokens) == 9
    loss = torch.tensor(2.5)
    assert share_loss(loss, LocalRunner(model, cross_entropy_sum)) is loss and loss.item() == 2.5


def test_validation_of_several_parts_needs_a_runner():
    validator = Validator.Config(enable=True, steps=1).build(loss_fn=cross_entropy_sum, device="cpu", dataloader=[])
    with pytest.raises(ValueError, match=r"got 2 model parts \(pipeline stages\) and no step runner to run them"):
        validator.validate([nn.Linear(2, 2), nn.Linear(2, 2)], step=1)
