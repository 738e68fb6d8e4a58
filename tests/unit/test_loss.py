import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum


def _batch(dtype=torch.float32, vocab: int = 11):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (3, 5), generator=gen)
    return logits, labels


def test_equals_torch_cross_entropy_sum():
    logits, labels = _batch()
    loss_sum, n_tokens = cross_entropy_sum(logits, labels)
    expected = F.cross_entropy(logits.view(-1, 11), labels.view(-1), reduction="sum")
    # Same float32 kernel on the same values: only summation order can differ.
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-6)
    assert n_tokens.item() == 15 and loss_sum.dtype == torch.float32


def test_ignored_labels_add_no_loss_and_no_tokens():
    logits, labels = _batch()
    masked = labels.clone()
    masked[0, :3] = IGNORE_INDEX
    masked[2, 4] = IGNORE_INDEX
    loss_sum, n_tokens = cross_entropy_sum(logits, masked)
    keep = masked != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-6)  # summation order only
    assert n_tokens.item() == 11


def test_low_precision_logits_are_upcast_before_log_softmax():
    logits, labels = _batch(dtype=torch.bfloat16)
    loss_sum, _ = cross_entropy_sum(logits, labels)
    assert loss_sum.dtype == torch.float32
    expected = F.cross_entropy(logits.float().view(-1, 11), labels.view(-1), reduction="sum")
    # The bf16 inputs are exactly representable in fp32, so the result is the fp32 loss of those values.
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=1e-6)


def test_all_ignored_gives_zero_loss_and_zero_tokens():
    logits, labels = _batch()
    loss_sum, n_tokens = cross_entropy_sum(logits, torch.full_like(labels, IGNORE_INDEX))
    assert loss_sum.item() == pytest.approx(0.0) and n_tokens.item() == 0
