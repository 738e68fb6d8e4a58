"""Hugging Face tokenizer.json and model folders as tokenizer.path: encoding equals the ``tokenizers``
library's own, BOS/EOS/pad come from the folder's token files, packing separates documents with them,
and every unusable file or folder is reported with the fix."""
from __future__ import annotations

import json

import numpy as np
import pytest
import sentencepiece as spm
from _hf_tokenizer import BOS, EOS, PAD, llama3_style_tokenizer, training_texts, write_model_folder
from tokenizers import Tokenizer as LibTokenizer

from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.tokenizer import Tokenizer, train_tokenizer
from torchtitan_lite.components.tokenizer_files import TokenizerError, TokenizerNotFoundError

CODE = 'def f(x):\n\t"""Doc."""\n    return {"a": [1, 2.5e-3]}  # comment\n\n\n'
UNICODE = "naïve café — 日本語のテキスト, Ελληνικά, emoji 🤖🧪, combining e\u0301"
ODD_BYTES = "\x00\x01\x7f\u200b\ufeff\r\n\r\x1b[31mred\x1b[0m  trailing   \t"
TEXTS = [CODE, UNICODE, ODD_BYTES, "", " leading space", "\n"]


@pytest.fixture(scope="module")
def lib_tokenizer() -> LibTokenizer:
    return llama3_style_tokenizer(600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, lib_tokenizer):
    return write_model_folder(tmp_path_factory.mktemp("hf") / "Tiny-Llama", lib_tokenizer)


@pytest.fixture(scope="module")
def tokenizer(folder) -> Tokenizer:
    return Tokenizer.Config(path=str(folder)).build()


def test_folder_loads_tokenizer_json_with_ids_named_by_tokenizer_config(tokenizer, lib_tokenizer, folder):
    assert tokenizer.kind == "hf" and tokenizer.path == folder / "tokenizer.json"
    assert tokenizer.vocab_size == lib_tokenizer.get_vocab_size(with_added_tokens=True) == 600
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == tuple(
        lib_tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))
    assert tokenizer.unk_id == -1  # byte-level BPE has no unknown token
    assert (tokenizer.id_to_piece(tokenizer.bos_id), tokenizer.id_to_piece(tokenizer.eos_id)) == (BOS, EOS)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_the_library(tokenizer, lib_tokenizer, text):
    lib_ids = lib_tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, bos=False, eos=False) == lib_ids
    # BOS/EOS are the project's, once each: the file's own post-processor (which prepends BOS) is not applied.
    assert tokenizer.encode(text) == [tokenizer.bos_id, *lib_ids, tokenizer.eos_id]
    assert tokenizer.decode(tokenizer.encode(text)) == lib_tokenizer.decode(lib_ids) == text


def test_encode_batch_equals_encode(tokenizer):
    assert tokenizer.encode_batch(TEXTS, bos=True, eos=False) == [tokenizer.encode(t, eos=False) for t in TEXTS]


def test_special_tokens_spelled_in_a_document_stay_text(tokenizer, lib_tokenizer):
    text = f"a web page that quotes {EOS} and {BOS}"
    assert lib_tokenizer.token_to_id(EOS) in lib_tokenizer.encode(text, add_special_tokens=False).ids
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.eos_id not in ids and tokenizer.bos_id not in ids
    assert tokenizer.decode(ids) == text


def test_packing_separates_documents_with_the_tokenizers_bos_and_eos(tmp_path, tokenizer, lib_tokenizer):
    docs = [CODE, f"quoting {EOS} inside", UNICODE, "short"] * 3
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    loader = TextDataLoader.Config(dataset=str(data), shuffle="none").build(
        tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=15, local_batch_size=2, infinite=False)
    stream = np.concatenate([np.concatenate([inputs[:, :1], labels], axis=1).reshape(-1) for inputs, labels in loader])
    as_text = LibTokenizer.from_str(lib_tokenizer.to_str())
    as_text.encode_special_tokens = True  # the library's switch for "special tokens in the input are text"
    expected = [t for d in docs for t in (tokenizer.bos_id, *as_text.encode(d, add_special_tokens=False).ids,
                                          tokenizer.eos_id)]
    assert len(stream) == len(expected) // 16 * 16  # whole windows of seq_len + 1; the partial tail is dropped
    assert stream.tolist() == expected[:len(stream)]
    # EOS appears exactly at document ends, never from the quoted one.
    ends = np.flatnonzero(stream == tokenizer.eos_id)
    assert ends.tolist() == [i for i, t in enumerate(expected[:len(stream)]) if t == tokenizer.eos_id]
    assert all(stream[i + 1] == tokenizer.bos_id for i in ends if i + 1 < len(stream))


def test_tokenizer_json_file_reads_the_token_names_of_its_folder(folder, tokenizer):
    direct = Tokenizer.Config(path=str(folder / "tokenizer.json")).build()
    assert (direct.vocab_size, direct.bos_id, direct.eos_id) == (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id)


def test_special_tokens_map_with_added_token_dicts(tmp_path, lib_tokenizer):
    config = {"bos_token": {"content": BOS, "lstrip": False}, "eos_token": {"content": EOS, "special": True}}
    folder = write_model_folder(tmp_path / "m", lib_tokenizer, config=config, config_file="special_tokens_map.json")
    tok = Tokenizer.Config(path=str(folder)).build()
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (lib_tokenizer.token_to_id(BOS), lib_tokenizer.token_to_id(EOS), -1)


def test_tokenizer_config_without_names_falls_back_to_special_tokens_map(tmp_path, lib_tokenizer):
    folder = write_model_folder(tmp_path / "m", lib_tokenizer, config={"tokenizer_class": "PreTrainedTokenizerFast"})
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    assert Tokenizer.Config(path=str(folder)).build().eos_id == lib_tokenizer.token_to_id(EOS)


def test_folder_with_a_sentencepiece_model(tmp_path):
    (tmp_path / "m").mkdir()
    train_tokenizer(training_texts()[:20], tmp_path / "m" / "tokenizer.model", vocab_size=512)
    tok = Tokenizer.Config(path=str(tmp_path / "m")).build()
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("sentencepiece", 512, 1, 2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m" / "tokenizer.model"))
    assert tok.encode(UNICODE, bos=False, eos=False) == sp.encode(UNICODE)


# --------------------------------------------------------------------------------------------------
# Errors


def test_missing_default_asset_folder_names_the_download_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer.path='assets/hf/Llama-3.1-8B' does not exist .*"
                                                     r"`python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B`"
                                                     r".*accept the licence.*`--data.dataset embedded --tokenizer.path none`"):
        Tokenizer.Config(path="assets/hf/Llama-3.1-8B").build()


def test_folder_without_a_tokenizer_lists_what_it_holds(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match=r"is a folder without tokenizer.json or tokenizer.model "
                                                     r"\(it holds \['config.json'\]\); fetch a hub tokenizer"):
        Tokenizer.Config(path=str(tmp_path)).build()


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', ""])
def test_corrupt_tokenizer_json_is_named(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    with pytest.raises(TokenizerError, match=r"tokenizer.json is not a Hugging Face tokenizer file .*re-download"):
        Tokenizer.Config(path=str(tmp_path)).build()


def test_corrupt_sentencepiece_model_is_named(tmp_path):
    (tmp_path / "tok.model").write_bytes(b"\x08\x01garbage")
    with pytest.raises(TokenizerError, match=r"tok.model is not a SentencePiece model"):
        Tokenizer.Config(path=str(tmp_path / "tok.model")).build()


def test_tiktoken_rank_file_is_recognised(tmp_path):
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")
    with pytest.raises(TokenizerError, match=r"is a tiktoken rank file \(like Llama 3's original/tokenizer.model\)"):
        Tokenizer.Config(path=str(tmp_path / "tokenizer.model")).build()


def test_tokenizer_without_bos_and_eos_says_what_to_write(tmp_path, lib_tokenizer):
    lib_tokenizer.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json / special_tokens_map.json
    with pytest.raises(TokenizerError, match=r"comes without a BOS and an EOS token: .*tokenizer_config.json names "
                                             r"bos_token=None, eos_token=None.*\"bos_token\": \"<\|begin_of_text\|>\""):
        Tokenizer.Config(path=str(tmp_path)).build()


def test_eos_only_config_is_rejected(tmp_path, lib_tokenizer):
    write_model_folder(tmp_path, lib_tokenizer, config={"bos_token": None, "eos_token": EOS})
    with pytest.raises(TokenizerError, match=r"names bos_token=None, eos_token='<\|end_of_text\|>'"):
        Tokenizer.Config(path=str(tmp_path)).build()


def test_token_name_outside_the_vocabulary_is_rejected(tmp_path, lib_tokenizer):
    write_model_folder(tmp_path, lib_tokenizer, config={"bos_token": "<s>", "eos_token": EOS})
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json names bos_token='<s>', which is not in the "
                                             r"vocabulary of the tokenizer.json next to it"):
        Tokenizer.Config(path=str(tmp_path)).build()


def test_path_to_the_token_file_points_at_its_folder(folder):
    with pytest.raises(TokenizerError, match=r"names the special-token file, not the tokenizer; point tokenizer.path "
                                             r"at its folder"):
        Tokenizer.Config(path=str(folder / "tokenizer_config.json")).build()


def test_vocab_size_contradicting_the_tokenizer_json_is_rejected(folder):
    with pytest.raises(ValueError, match=r"tokenizer.vocab_size=1024 contradicts .*tokenizer.json, which has 600 pieces"):
        Tokenizer.Config(path=str(folder), vocab_size=1024).build()
