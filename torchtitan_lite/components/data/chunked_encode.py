"""Tokenising very large documents in line-aligned chunks, streamed piece by piece.

SentencePiece encodes one text in one thread, in time that grows faster than its length: a 5 M
character document took 8.4 s whole and 4.5 s as 64 K-character chunks in one batched call on the
2-core reference CPU. Documents longer than ``LARGE_DOCUMENT_CHARS`` are therefore cut at line
breaks (at whitespace where a line is longer than a chunk, anywhere as a last resort) into chunks of
about ``CHUNK_CHARS``, encoded without specials, and framed by one BOS and one EOS like any other
document. Tokens next to a cut can differ from whole-document tokenisation (each chunk starts a new
SentencePiece "sentence"); everywhere else they are the same.

Such a document is not tokenised whole before its first window: ``encode_large`` hands out its
tokens in pieces of a growing number of chunks (1, 2, 4, ... up to ``MAX_CHUNKS_PER_CALL`` per
batched call), so the first window is ready after one chunk, and the full token list never exists.
Each piece ends at a chunk boundary, which the data loader records as a character offset; because a
chunk's end depends only on the text from its start on, encoding from that offset gives the very
chunks, hence tokens, that encoding from the start would have given there.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LARGE_DOCUMENT_CHARS = 1 << 20
CHUNK_CHARS = 1 << 16
MAX_CHUNKS_PER_CALL = 16
"""Chunks per batched tokenizer call once a document is under way (the call uses every core)."""


def is_large(text: str) -> bool:
    return len(text) > LARGE_DOCUMENT_CHARS


def chunk_ends(text: str, start: int = 0, chunk_chars: int | None = None) -> Iterator[int]:
    """End offsets of the consecutive chunks of ``text[start:]``: at most ``chunk_chars`` (default
    ``CHUNK_CHARS``) characters each, cut preferably after a line break, else after a space."""
    chunk_chars = chunk_chars or CHUNK_CHARS
    n = len(text)
    while start < n:
        end = min(start + chunk_chars, n)
        if end < n:
            cut = text.rfind("\n", start + 1, end)
            if cut < 0:
                cut = text.rfind(" ", start + 1, end)
            if cut > start:
                end = cut + 1
        yield end
        start = end


def split_text(text: str, chunk_chars: int | None = None) -> list[str]:
    """``text`` cut into its chunks."""
    pieces, start = [], 0
    for end in chunk_ends(text, 0, chunk_chars):
        pieces.append(text[start:end])
        start = end
    return pieces


def encode_large(tokenizer: Any, text: str, start: int = 0, *, chunk_chars: int | None = None,
                 max_chunks: int = MAX_CHUNKS_PER_CALL) -> Iterator[tuple[list[list[int]], int]]:
    """The tokens of ``text`` from character ``start`` (a chunk boundary) on, in pieces: ``(token lists,
    end offset)``. BOS leads the first piece when ``start`` is 0; EOS ends the piece that reaches the end."""
    bos, eos = specials(tokenizer)
    ends = chunk_ends(text, start, chunk_chars)
    per_call = 1
    while True:
        piece_start, chunks = start, []
        for end in ends:
            chunks.append(text[start:end])
            start = end
            if len(chunks) == per_call:
                break
        if not chunks:
            return
        tokens = tokenizer.encode_batch(chunks, bos=False, eos=False)
        if piece_start == 0:
            tokens.insert(0, bos)
        if start == len(text):
            tokens.append(eos)
        yield tokens, start
        per_call = min(per_call * 2, max_chunks)


def specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The tokens the tokenizer puts before and after a document (those of an empty one)."""
    with_specials = tokenizer.encode_batch([""])[0]
    before = len(tokenizer.encode_batch([""], bos=True, eos=False)[0])
    return with_specials[:before], with_specials[before:]
