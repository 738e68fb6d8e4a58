"""A batch's sequence layout: head-tail chunks per context-parallel rank, positions restarting per document, the
keyword tensors the model reads and the share of attention a document mask leaves."""
from __future__ import annotations

import pytest
import torch

from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.sequence_layout import (
    document_positions,
    load_balanced_index,
    model_batch,
)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_head_tail_chunks_partition_the_window_and_balance_causal_work(cp):
    seq_len, chunk = 64, 64 // (2 * cp)
    indices = [load_balanced_index(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(indices).tolist()) == list(range(seq_len))
    assert indices[1].tolist() == [*range(chunk, 2 * chunk), *range((2 * cp - 2) * chunk, (2 * cp - 1) * chunk)]
    # Causal pairs per rank: a query at window position i sees i + 1 keys; every rank sees as many.
    assert len({int((index + 1).sum()) for index in indices}) == 1


def test_a_window_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 equal chunks"):
        load_balanced_index(36, 4, 0)


def test_positions_restart_at_each_document_and_the_lead_counts_from_zero():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]


def _batch() -> Batch:
    tokens = torch.arange(2 * 9).view(2, 9)
    return Batch(tokens[:, :-1], tokens[:, 1:], [torch.tensor([0, 3, 5]), torch.tensor([2])])


def test_causal_on_one_rank_passes_nothing_to_the_model():
    layout = model_batch(_batch(), document_mask=False)
    assert layout.model_kwargs == {} and layout.attention_share == 1.0
    assert torch.equal(layout.inputs, _batch().inputs)


@pytest.mark.parametrize("cp", [1, 2])
def test_the_keyword_tensors_allow_exactly_the_document_causal_pairs(cp):
    batch = _batch()
    ids = batch.document_ids()
    want = (torch.arange(8)[None, :, None] >= torch.arange(8)[None, None, :]) & (ids[:, :, None] == ids[:, None, :])
    for rank in range(cp):
        kw = model_batch(batch, document_mask=True, cp=cp, cp_rank=rank).model_kwargs
        allowed = (kw["kv_index"][:, None, :] <= kw["q_index"][:, :, None]) & \
            (kw["kv_doc"][:, None, :] == kw["q_doc"][:, :, None])
        # Back in window order: row q_index, column kv_index.
        got = torch.zeros_like(want)
        for b in range(2):
            got[b, kw["q_index"][b][:, None], kw["kv_index"][b][None, :]] = allowed[b]
        rows = kw["q_index"][0]
        assert torch.equal(got[:, rows], want[:, rows])


def test_the_attention_share_counts_the_pairs_a_document_mask_keeps():
    # Row 0: documents of 3, 2 and 3 tokens; row 1: 2 and 6 (its lead continues an earlier document).
    share = model_batch(_batch(), document_mask=True).attention_share
    kept = (6 + 3 + 6) + (3 + 21)
    assert share == pytest.approx(kept / (2 * 36))


def test_plain_pairs_pass_only_under_the_causal_mask():
    from torchtitan_lite.components.data.sequence_layout import SequenceLayout

    pair = (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64))
    assert SequenceLayout()(pair).model_kwargs == {}
    with pytest.raises(TypeError, match="needs batches that carry their document starts"):
        SequenceLayout(document_mask=True)(pair)


class _Tokenizer:
    def __init__(self, bos: bool) -> None:
        self.bos = bos

    def encode_batch(self, texts, bos=True, eos=True):
        return [([1] if bos and self.bos else []) + ([2] if eos else []) for _ in texts]

    def describe(self) -> str:
        return "a test tokenizer"


def test_a_stream_without_a_bos_token_cannot_be_document_masked():
    from torchtitan_lite.components.data.sequence_layout import check_document_starts

    check_document_starts(True, streaming=True, tokenizer=_Tokenizer(bos=True))
    check_document_starts(True, streaming=False, tokenizer=_Tokenizer(bos=False))  # a store keeps its own index
    check_document_starts(False, streaming=True, tokenizer=_Tokenizer(bos=False))
    with pytest.raises(ValueError, match=r"a test tokenizer puts 0 token\(s\) before a document.*pre-tokenize"):
        check_document_starts(True, streaming=True, tokenizer=_Tokenizer(bos=False))
