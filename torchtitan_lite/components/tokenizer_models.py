"""The two kinds of tokenizer behind ``Tokenizer``: SentencePiece models and Hugging Face ``tokenizer.json``.

Both implement ``TokenizerModel``: a vocabulary size that covers every id the tokenizer can produce,
the BOS / EOS / pad / unk ids (-1 when absent), batched encoding with BOS/EOS added on request, and
decoding that drops BOS/EOS. Document text is always encoded as text: a literal ``<|end_of_text|>``
inside a web page becomes ordinary pieces, never the control id that separates packed documents.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path

from torchtitan_lite.components.tokenizer_files import TokenizerError, TokenizerSource

REFETCH_HINT = "re-download or rebuild it"


class TokenizerModel(abc.ABC):
    """Text <-> ids for one tokenizer file."""

    vocab_size: int
    """Embedding rows the ids need: the largest id + 1."""
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        """Ids of each text, with BOS / EOS around it on request."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; BOS/EOS (and other control tokens) decode to nothing."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id``."""


class SentencePieceModel(TokenizerModel):
    def __init__(self, file: Path) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(file))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(f"{file} is not a SentencePiece model ({type(error).__name__}: {error}); "
                                 f"{REFETCH_HINT}") from error
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        self.pad_id, self.unk_id = self._sp.pad_id(), self._sp.unk_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise TokenizerError(f"{file} defines no BOS or EOS piece (bos_id={self.bos_id}, eos_id={self.eos_id}); "
                                 f"documents are packed between them, so train the model with "
                                 f"scripts/train_tokenizer.py or with --bos_id/--eos_id set")

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


class HFTokenizerModel(TokenizerModel):
    """A ``tokenizers`` BPE/Unigram/WordPiece tokenizer; BOS/EOS/pad named by the folder's token files."""

    def __init__(self, source: TokenizerSource) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        file = source.file
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises plain Exception for unreadable or malformed JSON
            raise TokenizerError(f"{file} is not a Hugging Face tokenizer file ({error}); {REFETCH_HINT}") from error
        # Our own BOS/EOS are added around each document; the file's post-processor (Llama 3's adds BOS)
        # is skipped, and special tokens spelled inside the text stay text.
        self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"{file} has an empty vocabulary; {REFETCH_HINT}")
        self.vocab_size = max(vocab.values()) + 1
        names = source.special_tokens
        where = source.special_tokens_from or file.parent / "tokenizer_config.json"
        if "bos_token" not in names or "eos_token" not in names:
            raise TokenizerError(
                f"{file} comes without a BOS and an EOS token: {where} names bos_token={names.get('bos_token')!r}, "
                f"eos_token={names.get('eos_token')!r}. Documents are packed between them: write both into "
                f"{file.parent / 'tokenizer_config.json'} (Llama 3: \"bos_token\": \"<|begin_of_text|>\", "
                f"\"eos_token\": \"<|end_of_text|>\")")
        self.bos_id = self._required_id(names["bos_token"], "bos_token", where, vocab)
        self.eos_id = self._required_id(names["eos_token"], "eos_token", where, vocab)
        self.pad_id = vocab.get(names.get("pad_token", ""), -1)
        self.unk_id = vocab.get(names.get("unk_token", ""), -1)

    @staticmethod
    def _required_id(token: str, key: str, where: Path, vocab: dict[str, int]) -> int:
        if token not in vocab:
            raise TokenizerError(f"{where} names {key}={token!r}, which is not in the vocabulary of the "
                                 f"tokenizer.json next to it; the files belong to different tokenizers, "
                                 f"{REFETCH_HINT}")
        return vocab[token]

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        head, tail = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        return [head + e.ids + tail for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})")
        return piece
