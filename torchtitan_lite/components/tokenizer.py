"""The tokenizer component: the tokenizer users have, or a default one built from the embedded corpus.

``tokenizer.path`` names a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` or a model folder
holding either (see ``tokenizer_files.py``); both kinds implement ``TokenizerModel``
(``tokenizer_models.py``) and BOS/EOS/pad ids come from the tokenizer itself. The vocabulary size is the
largest id + 1, and the model's embedding grows to it.

Without a path, the default is a SentencePiece BPE trained on the embedded corpus on first use. Its
special ids: ``unk=0``, ``bos=1``, ``eos=2``, no pad piece (``pad_id=-1``): packing never pads, and ignored
label positions use ``IGNORE_INDEX`` instead. ``"\\n"`` is its own piece (SentencePiece trains on single
lines, so it would otherwise never learn one) and ``byte_fallback`` spells every character outside the
vocabulary as UTF-8 byte pieces, so ``decode(encode(s)) == s`` holds for any string: code, any script,
control characters.

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

from torchtitan_lite.components.tokenizer_files import locate_tokenizer
from torchtitan_lite.components.tokenizer_models import HFTokenizerModel, SentencePieceModel, TokenizerModel
from torchtitan_lite.config import Configurable
from torchtitan_lite.hf_assets import tokenizer_fetch_hint

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
    """Text <-> token ids with a SentencePiece model or a Hugging Face tokenizer.json."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        path: str | None = None
        """SentencePiece .model file (e.g. from scripts/train_tokenizer.py), Hugging Face tokenizer.json, or
        a model folder holding either (e.g. assets/hf/Llama-3.1-8B from scripts/download_hf_assets.py; its
        tokenizer_config.json names BOS/EOS). None uses the default BPE tokenizer of the embedded corpus,
        trained into the cache on first use."""
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
        model: TokenizerModel
        if config.path is None:
            self.path = default_tokenizer_path(config.vocab_size)
            self.kind = "sentencepiece"
            model = SentencePieceModel(self.path)
        else:
            source = locate_tokenizer(config.path, missing_hint=tokenizer_fetch_hint(config.path))
            self.path, self.kind = source.file, source.kind
            model = SentencePieceModel(source.file) if source.kind == "sentencepiece" else HFTokenizerModel(source)
        self._model = model
        self.vocab_size: int = model.vocab_size
        self.bos_id: int = model.bos_id
        self.eos_id: int = model.eos_id
        self.unk_id: int = model.unk_id
        self.pad_id: int = model.pad_id
        if config.path is not None and config.vocab_size not in (self.vocab_size, DEFAULT_VOCAB_SIZE):
            raise ValueError(f"tokenizer.vocab_size={config.vocab_size} contradicts {self.path}, which has "
                             f"{self.vocab_size} pieces; remove tokenizer.vocab_size (it only sizes the "
                             f"default tokenizer)")

    def describe(self) -> str:
        """One line for the log: file, kind, vocabulary and the document delimiters."""
        return (f"{self.path} ({self.kind}, vocabulary {self.vocab_size}, bos={self.bos_id} "
                f"{self.id_to_piece(self.bos_id)!r}, eos={self.eos_id} {self.id_to_piece(self.eos_id)!r})")

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return self._model.encode_batch([text], bos, eos)[0]

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """``encode`` of many texts in one call into the tokenizer library (multi-threaded, no Python loop)."""
        return self._model.encode_batch(texts, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; BOS/EOS decode to nothing. Accepts lists and 1-D tensors."""
        return self._model.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._model.id_to_piece(token_id)


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
