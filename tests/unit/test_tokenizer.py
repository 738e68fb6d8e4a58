import json
from pathlib import Path

import pytest
import sentencepiece as spm

from torchtitan_lite.components.tokenizer import (
    Tokenizer,
    default_tokenizer_path,
    sample_lines,
    train_tokenizer,
)
from torchtitan_lite.tools import train_tokenizer as train_tokenizer_tool

ROOT = Path(__file__).resolve().parents[2]

CODE = 'def f(x):\n\t"""Doc."""\n    return {"a": [1, 2.5e-3]}  # comment\n\n\n'
UNICODE = "naïve café — 日本語のテキスト, Ελληνικά, emoji 🤖🧪, combining e\u0301"
ODD_BYTES = "\x00\x01\x7f\u200b\ufeff\r\n\r\x1b[31mred\x1b[0m  trailing   \t"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.Config().build()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few thousand lines of real text, enough to train a 512-piece model in well under a second."""
    from torchtitan_lite.components.data.corpus import embedded_corpus

    lines = open(embedded_corpus().train_files[0], encoding="utf-8").readlines()[:40]
    return [json.loads(line)["text"] for line in lines]


def test_default_tokenizer_ids_and_size(tokenizer):
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2, -1)
    assert tokenizer.path == default_tokenizer_path(2048)
    assert tokenizer.path.name.endswith("-bpe2048-v1.model")


def test_encode_places_bos_and_eos_on_request(tokenizer):
    ids = tokenizer.encode("import os")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
    assert tokenizer.encode("import os", bos=False, eos=False) == ids[1:-1]
    assert tokenizer.encode("import os", bos=False) == ids[1:]
    assert tokenizer.encode_batch(["import os", "x"]) == [ids, tokenizer.encode("x")]


@pytest.mark.parametrize("text", [CODE, UNICODE, ODD_BYTES, "", " leading space", "\n"])
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_unseen_characters_fall_back_to_bytes(tokenizer):
    ids = tokenizer.encode("🧪", bos=False, eos=False)
    # U+1F9EA is four UTF-8 bytes; the stdlib never uses it, so it is spelled as byte pieces.
    assert [tokenizer.id_to_piece(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0xA7>", "<0xAA>"]
    assert tokenizer.unk_id not in tokenizer.encode(UNICODE + ODD_BYTES)


def test_newline_and_indentation_are_single_pieces(tokenizer):
    ids = tokenizer.encode("\n    return", bos=False, eos=False)
    assert [tokenizer.id_to_piece(i) for i in ids] == ["\n", "▁▁▁▁", "return"]


def test_code_compresses_to_a_few_bytes_per_token(tokenizer):
    source = (ROOT / "torchtitan_lite" / "components" / "tokenizer.py").read_text()
    ids = tokenizer.encode(source)
    assert 2.3 < len(source.encode()) / len(ids) < 5  # a 2k BPE on Python code: ~3 bytes/token


def test_decode_accepts_tensors(tokenizer):
    import torch

    ids = tokenizer.encode(CODE)
    assert tokenizer.decode(torch.tensor(ids)) == CODE


def test_training_is_deterministic(small_corpus, tmp_path):
    for name in ("a.model", "b.model"):
        train_tokenizer(small_corpus, tmp_path / name, vocab_size=512, max_sentences=2000)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    tok = Tokenizer.Config(path=str(tmp_path / "a.model"), vocab_size=512).build()
    assert tok.vocab_size == 512 and tok.decode(tok.encode(CODE + UNICODE)) == CODE + UNICODE


def test_sample_lines_caps_skips_blanks_and_is_seeded():
    texts = [f"line {i}\n\n   \nother {i}" for i in range(100)]
    assert sample_lines(texts[:2], 10, seed=0) == ["line 0", "other 0", "line 1", "other 1"]
    sample = sample_lines(texts, 50, seed=0)
    assert len(sample) == 50 and len(set(sample)) == 50 and all(s.strip() for s in sample)
    assert sample == sample_lines(texts, 50, seed=0) and sample != sample_lines(texts, 50, seed=1)
    assert any(s.endswith(("98", "99")) for s in sample)  # late lines get in, it is not a prefix


def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer.path='.*nope.model' does not exist \(.*\); fetch a hub "
                                                r"tokenizer .* or train one with `python scripts/train_tokenizer.py --output"):
        Tokenizer.Config(path=str(tmp_path / "nope.model")).build()


def test_vocab_size_must_fit_byte_fallback():
    with pytest.raises(ValueError, match="tokenizer.vocab_size=300 is too small.*at least 512"):
        Tokenizer.Config(vocab_size=300)


def test_vocab_size_contradicting_the_file_is_rejected(small_corpus, tmp_path):
    path = tmp_path / "t.model"
    train_tokenizer(small_corpus, path, vocab_size=512, max_sentences=2000)
    assert Tokenizer.Config(path=str(path)).build().vocab_size == 512  # default vocab_size: not a contradiction
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=1024 contradicts .* which has 512 pieces"):
        Tokenizer.Config(path=str(path), vocab_size=1024).build()


def test_model_without_bos_is_rejected(small_corpus, tmp_path):
    prefix = tmp_path / "nobos"
    spm.SentencePieceTrainer.train(sentence_iterator=iter("\n".join(small_corpus).splitlines()), model_prefix=str(prefix),
                                   vocab_size=100, model_type="char", hard_vocab_limit=False,
                                   bos_id=-1, eos_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match=r"defines no BOS or EOS piece \(bos_id=-1, eos_id=-1\)"):
        Tokenizer.Config(path=f"{prefix}.model").build()


def test_train_tokenizer_script_on_local_files(small_corpus, tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in small_corpus))
    out = tmp_path / "out" / "tok.model"
    argv = ["--vocab-size", "512", "--output", str(out), "--input", str(data), "--text-field", "body",
            "--max-sentences", "2000"]
    assert train_tokenizer_tool.main(argv) == 0
    assert "512 pieces (unk=0, bos=1, eos=2, pad=-1)" in capsys.readouterr().out
    tok = Tokenizer.Config(path=str(out), vocab_size=512).build()
    assert tok.decode(tok.encode(CODE)) == CODE


def test_train_tokenizer_script_rejects_a_tiny_vocabulary(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tokenizer_tool.main(["--vocab-size", "100", "--output", str(tmp_path / "t.model")])
    assert "--vocab-size 100 is too small; byte fallback needs at least 512" in capsys.readouterr().err
