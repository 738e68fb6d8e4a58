"""SentencePiece BPE tokenizer, with a default one built from the embedded corpus on first use.

Special ids of tokenizers built here: ``unk=0``, ``bos=1``, ``eos=2``, no pad piece (``pad_id=-1``):
packing never pads, and ignored label positions use ``IGNORE_INDEX`` instead. ``"\\n"`` is its own
piece (SentencePiece trains on single lines, so it would otherwise never learn one) and
``byte_fallback`` spells every character outside the vocabulary as UTF-8 byte pieces, so
``decode(encode(s)) == s`` holds for any string: code, any script, control characters.

Training is deterministic: lines are sampled with a seeded reservoir in Python, never more than
``input_sentence_size``, so SentencePiece keeps them all and only shuffles them with its fixed seed
(its own sampling is not reproducible). The same corpus and vocabulary size give the same model file.
"""
from __future__ import annotations

import io
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from torchtitan_lite.config import Configurable

logger = logging.getLogger("torchtitan_lite")

DEFAULT_VOCAB_SIZE = 2048
MIN_VOCAB_SIZE = 512
"""Room for the 256 byte pieces, the specials and the characters the corpus needs."""
TOKENIZER_VERSION = 1
"""Bumped whenever the training recipe changes, so old default tokenizers are not reused."""
MAX_TRAINING_SENTENCES = 200_000
"""Lines sampled for training: ~2-5 s on 2 cores for the embedded corpus, with the same vocabulary
quality as all of its ~275k lines."""


class Tokenizer(Configurable):
    """Text <-> token ids with a SentencePiece model."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        path: str | None = None
        """SentencePiece .model file (e.g. from scripts/train_tokenizer.py); None uses the default BPE
        tokenizer of the embedded corpus, trained into the cache on first use."""
        vocab_size: int = DEFAULT_VOCAB_SIZE
        """Vocabulary size of the default tokenizer (when path is None). With path set it must equal
        the file's size or stay at its default."""

        def __post_init__(self) -> None:
            if self.vocab_size < MIN_VOCAB_SIZE:
                raise ValueError(f"tokenizer.vocab_size={self.vocab_size} is too small: byte fallback alone "
                                 f"needs 256 pieces; use at least {MIN_VOCAB_SIZE}")

    config: Tokenizer.Config

    def __init__(self, config: Tokenizer.Config) -> None:
        super().__init__(config)
        if config.path is None:
            self.path = default_tokenizer_path(config.vocab_size)
        else:
            self.path = Path(config.path).expanduser()
            if not self.path.is_file():
                raise FileNotFoundError(
                    f"tokenizer.path={config.path!r} does not exist; build one with "
                    f"`python scripts/train_tokenizer.py --output {config.path}` or leave tokenizer.path "
                    f"unset to use the default tokenizer")
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.unk_id: int = self._sp.unk_id()
        self.pad_id: int = self._sp.pad_id()
        if config.path is not None and config.vocab_size not in (self.vocab_size, DEFAULT_VOCAB_SIZE):
            raise ValueError(f"tokenizer.vocab_size={config.vocab_size} contradicts {self.path}, which has "
                             f"{self.vocab_size} pieces; remove tokenizer.vocab_size (it only sizes the "
                             f"default tokenizer)")
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{self.path} defines no BOS or EOS piece (bos_id={self.bos_id}, eos_id="
                             f"{self.eos_id}); documents are packed between them, so train the model with "
                             f"scripts/train_tokenizer.py or with --bos_id/--eos_id set")

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``encode`` of many texts in one SentencePiece call (multi-threaded, no Python loop)."""
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; BOS/EOS decode to nothing. Accepts lists and 1-D tensors."""
        return self._sp.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


def default_tokenizer_path(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """The embedded corpus' BPE tokenizer of ``vocab_size``, trained into the cache on first use."""
    from torchtitan_lite.components.data.cache import build_once, cache_root
    from torchtitan_lite.components.data.corpus import corpus_key

    target = cache_root() / "tokenizer" / f"{corpus_key()}-bpe{vocab_size}-v{TOKENIZER_VERSION}.model"
    return build_once(target, lambda out: train_tokenizer(embedded_training_texts(), out, vocab_size=vocab_size))


def embedded_training_texts() -> Iterable[str]:
    """Documents of the embedded corpus' train split, read through the data pipeline like any source."""
    from torchtitan_lite.components.data import TextDataLoader
    from torchtitan_lite.components.data.sources import load_split

    return iter_texts(load_split(TextDataLoader.Config(dataset="embedded"), "train"), "text")


def iter_texts(dataset: Any, field: str, batch_size: int = 256) -> Iterable[str]:
    """Texts of a map-style or streaming dataset, read in batches."""
    for batch in dataset.iter(batch_size=batch_size):
        yield from batch[field]


def train_tokenizer(
    texts: Iterable[str],
    output: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_sentences: int = MAX_TRAINING_SENTENCES,
    num_threads: int = 2,
    seed: int = 0,
) -> None:
    """Train a byte-fallback BPE SentencePiece model on the non-blank lines of ``texts``."""
    start = time.perf_counter()
    lines = sample_lines(texts, max_sentences, seed)
    if not lines:
        raise ValueError("no text to train the tokenizer on: every document is empty or blank")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        # Identity normalisation and no whitespace rewriting: what is encoded decodes back verbatim.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,  # indentation runs become single pieces
        split_digits=True,
        user_defined_symbols=["\n"],
        character_coverage=0.9995,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=8192,
        num_threads=num_threads,
        minloglevel=2,
    )
    Path(output).write_bytes(model.getvalue())
    logger.info("trained a %s-piece BPE tokenizer on %s lines in %.1fs -> %s",
                vocab_size, len(lines), time.perf_counter() - start, output)


def sample_lines(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """Up to ``k`` non-blank lines of ``texts``: all of them if there are few, else a seeded uniform
    reservoir sample, in a reproducible order."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip():
                continue
            if len(sample) < k:
                sample.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    sample[j] = line
            seen += 1
    return sample
