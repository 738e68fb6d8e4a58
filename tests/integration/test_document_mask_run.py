"""`--model.attention_mask document` trains on a corpus of short documents: its losses differ from the causal
run's from the same seed (the mask is in effect), and a 2-stage pipeline, whose every stage builds the mask from
the micro-batch's layout, reproduces the one-process losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import read_scalars, run_cli, train_cmd

STEPS = 4
FP32_RTOL = 1e-5
"""float32, 1F1B sums micro-batch losses and gradients one by one (test_train_pipeline.py measured 3.7e-6)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    # ~20-token documents: a 64-token window holds three or four of them.
    folder = tmp_path_factory.mktemp("short_docs")
    texts = [f"Note {i}: the {'north' if i % 3 else 'south'} gate opens at {i % 12} and shuts at {i % 5}."
             for i in range(400)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder / "docs.jsonl"


def _args(corpus: Path, folder: Path, *extra: str) -> list[str]:
    return ["--config", "llama3_debug", "--data.dataset", str(corpus), "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.steps", str(STEPS), "--validation.enable", "false",
            "--metrics.log_freq", "1", "--job.dump_folder", str(folder), *extra]


@pytest.fixture(scope="module")
def seed(corpus, tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("seed")
    result = run_cli([*_args(corpus, folder), "--checkpoint.enable", "true",
                      "--checkpoint.create_seed_checkpoint", "true"], launcher="train.py")
    assert result.returncode == 0, result.stderr[-3000:]
    return ["--checkpoint.enable", "true", "--checkpoint.interval", "1000",
            "--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-0")]


def _losses(cmd: list[str], folder: Path) -> dict[int, float]:
    import subprocess

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return read_scalars(folder / "tb")["train/loss"]


def test_document_masking_trains_and_changes_the_losses(corpus, seed, tmp_path):
    document = _losses(train_cmd(_args(corpus, tmp_path / "doc", *seed, "--model.attention_mask", "document")),
                       tmp_path / "doc")
    causal = _losses(train_cmd(_args(corpus, tmp_path / "causal", *seed)), tmp_path / "causal")
    assert set(document) == set(range(1, STEPS + 1))
    assert all(abs(document[s] - causal[s]) > 1e-3 for s in document), (document, causal)


def test_a_pipeline_masks_documents_as_one_process_does(corpus, seed, tmp_path):
    doc = ("--model.attention_mask", "document")
    one = _losses(train_cmd(_args(corpus, tmp_path / "one", *seed, *doc)), tmp_path / "one")
    pp = _losses(train_cmd(_args(corpus, tmp_path / "pp", *seed, *doc, "--parallelism.pp", "2"), nproc=2),
                 tmp_path / "pp")
    assert set(pp) == set(one)
    assert max(abs(pp[s] - one[s]) / one[s] for s in one) <= FP32_RTOL, (pp, one)
