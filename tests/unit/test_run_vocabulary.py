"""The model's vocabulary comes from the tokenizer: grown to it, fixed by initial weights (a larger tokenizer is
then an error), and planned with the flavor's published size while the tokenizer is not fetched yet."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer as LibTokenizer
from tokenizers import models, pre_tokenizers

import config_registry
from torchtitan_lite.resolved_run import resolve_run


def _word_tokenizer(folder, size: int) -> str:
    """A word-level tokenizer.json of exactly ``size`` ids (0 = <s>, 1 = </s>), written in milliseconds."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, size)}
    tokenizer = LibTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "unk_token": "<unk>"}))
    return str(folder)


def _debug(tokenizer_path: str, **checkpoint) -> object:
    cfg = config_registry.get("llama3_debug")
    cfg.tokenizer.path = tokenizer_path
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def _weights(path, rows: int) -> str:
    dcp.save({"model": {"tok_embeddings.weight": torch.zeros(rows, 4)}}, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_model_grows_to_a_larger_tokenizer_and_keeps_its_own_rows_for_a_smaller_one(tmp_path):
    large = resolve_run(_debug(_word_tokenizer(tmp_path / "large", 3000)), world_size=1, device_type="cpu")
    small = resolve_run(_debug(_word_tokenizer(tmp_path / "small", 600)), world_size=1, device_type="cpu")
    assert (large.model_args.vocab_size, small.model_args.vocab_size) == (3000, 2048)  # debug flavor: 2048


def test_initial_weights_fix_the_embedding_rows(tmp_path):
    cfg = _debug(_word_tokenizer(tmp_path / "tok", 600), initial_load_path=_weights(tmp_path / "seed", 2500))
    assert resolve_run(cfg, world_size=1, device_type="cpu").model_args.vocab_size == 2500


def test_tokenizer_larger_than_the_initial_weights_embedding_is_an_error(tmp_path):
    cfg = _debug(_word_tokenizer(tmp_path / "tok", 3000), initial_load_path=_weights(tmp_path / "seed", 2048))
    with pytest.raises(ValueError, match=r"the tokenizer \(.*tok\) has 3000 ids, more than the 2048 embedding rows of "
                                         r"the initial weights checkpoint.initial_load_path='.*seed': ids from 2048 on "
                                         r"would have no embedding"):
        resolve_run(cfg, world_size=1, device_type="cpu")


def test_planning_without_the_fetched_tokenizer_uses_the_published_vocabulary(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # no assets/hf/Llama-3.1-8B here
    cfg = config_registry.get("llama3_8b_fp8")
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        run = resolve_run(cfg, world_size=8, device_type="cuda", cuda_available=False)
    assert run.model_args.vocab_size == 128256
    planning = [r.getMessage() for r in caplog.records if "does not exist yet" in r.getMessage()]
    assert planning == ["tokenizer.path='assets/hf/Llama-3.1-8B' does not exist yet: planning with the 8B flavor's "
                        "vocabulary of 128256; a training launch needs the tokenizer (--check-config says how to fetch it)"]


def test_a_training_launch_requires_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"download_hf_assets.py --repo meta-llama/Llama-3.1-8B"):
        config_registry.get("llama3_8b").tokenizer.build()
