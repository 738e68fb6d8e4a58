"""Large documents are tokenised in line-aligned chunks, framed by one BOS and one EOS."""
from __future__ import annotations

from test_data_loader import BOS, EOS, CharTokenizer

from torchtitan_lite.components.data.chunked_encode import encode_documents, split_text


def test_split_prefers_line_breaks_then_spaces_and_loses_nothing():
    text = "aaaa\nbbbbbbbb cc\n" + "x" * 25
    pieces = split_text(text, chunk_chars=10)
    assert "".join(pieces) == text
    assert pieces[0] == "aaaa\n" and pieces[1] == "bbbbbbbb " and all(len(p) <= 10 for p in pieces)


def test_large_documents_match_whole_encoding_for_a_context_free_tokenizer():
    tok = CharTokenizer()
    texts = ["short", "line one\n" * 40, "tiny", "word " * 100]
    chunked = encode_documents(tok, texts, large=50, chunk_chars=16)
    assert chunked == tok.encode_batch(texts)
    assert chunked[1][0] == BOS and chunked[1][-1] == EOS and chunked[1].count(BOS) == 1


def test_real_tokenizer_chunks_only_differ_near_cuts():
    from torchtitan_lite.components.tokenizer import Tokenizer

    tok = Tokenizer.Config().build()
    doc = "def f(x):\n    return x + 1\n" * 400
    whole = tok.encode_batch([doc])[0]
    chunked = encode_documents(tok, [doc], large=1000, chunk_chars=2000)[0]
    assert chunked[0] == whole[0] == tok.bos_id and chunked[-1] == whole[-1] == tok.eos_id
    assert tok.decode(chunked) == tok.decode(whole)  # the same text; tokens may differ only at cuts
    # Within 1% in length: each of the ~6 cuts can change a token or two.
    assert abs(len(chunked) - len(whole)) <= len(whole) // 100
