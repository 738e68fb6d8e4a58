"""A tokenizer of one token per character (ord + OFFSET between BOS and EOS), so data tests can read documents
and windows back from token ids."""
from __future__ import annotations

BOS, EOS, OFFSET = 1, 2, 10


class CharTokenizer:
    vocab_size = 200

    def encode_batch(self, texts, bos=True, eos=True):
        return [[BOS] * bos + [ord(c) + OFFSET for c in t] + [EOS] * eos for t in texts]
