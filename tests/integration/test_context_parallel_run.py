"""Training under context parallelism through the trainer, against one process from the same seed checkpoint, on a
corpus of ~20-token documents (a 64-token window holds three or four, so the document mask matters): CP 2 gives the
one-process training and validation losses for 10 steps under the causal and the document mask (Llama 3, and
DeepSeek-V3's latent attention with its MoE), as do PP 2 x CP 2, FSDP 2 x CP 2 and CP 4 on 4 ranks; a CP 2
checkpoint resumes on one process with the same data position and the continued losses.

Tolerance 1e-5 relative (float32): the layouts differ in summation order only (CP sums each chunk's gradients in
FSDP's reduce-scatter; the pipeline sums micro-batches one by one); measured <= 3e-7. Per-parameter gradients are
compared in tests/distributed/test_context_parallel_grads.py."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from _cli import read_scalars, run_cli, train_cmd

STEPS = 10
RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("short_docs")
    texts = [f"Entry {i}: the {'east' if i % 3 else 'west'} bridge lifts at {i % 12} and lowers at {i % 7}."
             for i in range(600)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:500]))
    (folder / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[500:]))
    return folder / "docs.jsonl"


def _args(family: str, corpus: Path, folder: Path, *extra: str) -> list[str]:
    return ["--config", f"{family}_debug", "--data.dataset", str(corpus),
            "--data.validation_files", str(corpus.with_name("val.jsonl")), "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.steps", str(STEPS), "--training.seed", "0",
            "--debug.deterministic", "true", "--precision.param_dtype", "float32",
            "--precision.reduce_dtype", "float32", "--validation.enable", "true", "--validation.freq", "5",
            "--validation.steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", str(folder), *extra]


@pytest.fixture(scope="module")
def seeds(corpus, tmp_path_factory) -> dict[str, list[str]]:
    out = {}
    for family in ("llama3", "deepseek_v3"):
        folder = tmp_path_factory.mktemp(f"seed_{family}")
        result = run_cli([*_args(family, corpus, folder), "--checkpoint.enable", "true",
                          "--checkpoint.create_seed_checkpoint", "true"], launcher="train.py")
        assert result.returncode == 0, result.stderr[-3000:]
        out[family] = ["--checkpoint.enable", "true", "--checkpoint.interval", "5",
                       "--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-0")]
    return out


def _train(family: str, corpus: Path, seeds: dict, folder: Path, *extra: str, nproc: int = 1) -> dict:
    cmd = train_cmd(_args(family, corpus, folder, *seeds[family], *extra), nproc=nproc if nproc > 1 else None)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {"out": result.stdout + result.stderr, **read_scalars(folder / "tb")}


@pytest.fixture(scope="module")
def one_process(corpus, seeds, tmp_path_factory):
    cache: dict[tuple[str, str], dict] = {}

    def get(family: str, mask: str) -> dict:
        if (family, mask) not in cache:
            folder = tmp_path_factory.mktemp(f"one_{family}_{mask}")
            cache[family, mask] = _train(family, corpus, seeds, folder, "--model.attention_mask", mask)
        return cache[family, mask]
    return get


def _assert_same(got: dict, ref: dict, key: str = "train/loss") -> None:
    assert set(got[key]) == set(ref[key]), (sorted(got[key]), sorted(ref[key]))
    worst = max(abs(got[key][s] - ref[key][s]) / abs(ref[key][s]) for s in ref[key])
    assert worst <= RTOL, (key, worst, got[key], ref[key])


@pytest.fixture(scope="module")
def cp2(corpus, seeds, tmp_path_factory):
    cache: dict[tuple[str, str], tuple[dict, Path]] = {}

    def get(family: str, mask: str) -> tuple[dict, Path]:
        if (family, mask) not in cache:
            folder = tmp_path_factory.mktemp(f"cp2_{family}_{mask}")
            cache[family, mask] = (_train(family, corpus, seeds, folder, "--model.attention_mask", mask,
                                          "--parallelism.cp", "2", nproc=2), folder)
        return cache[family, mask]
    return get


@pytest.mark.parametrize(("family", "mask"), [
    pytest.param("llama3", "causal", marks=pytest.mark.slow), ("llama3", "document"), ("deepseek_v3", "document")])
def test_cp2_trains_and_validates_as_one_process(family, mask, cp2, one_process):
    got, _ = cp2(family, mask)
    assert "CP 2, K/V all-gathered over CP, 4 head-tail chunks per sequence" in got["out"]
    ref = one_process(family, mask)
    _assert_same(got, ref)
    _assert_same(got, ref, "val/loss")


def test_the_document_mask_changes_the_cp_losses(one_process):
    """The negative control of the comparisons above: on this corpus the two masks give different losses, so
    a CP run that ignored the mask (or the gathered keys' documents) could not match the document reference."""
    causal, document = one_process("llama3", "causal")["train/loss"], one_process("llama3", "document")["train/loss"]
    assert min(abs(causal[s] - document[s]) for s in range(2, STEPS + 1)) > 1e-3


def test_pp2_x_cp2_trains_as_one_process(corpus, seeds, one_process, tmp_path):
    got = _train("llama3", corpus, seeds, tmp_path, "--model.attention_mask", "document", "--parallelism.cp", "2",
                 "--parallelism.pp", "2", nproc=4)
    _assert_same(got, one_process("llama3", "document"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--parallelism.cp", "4"),
                                    ("--parallelism.cp", "2", "--parallelism.dp_shard", "2",
                                     "--training.local_batch_size", "2")], ids=["cp4", "fsdp2_x_cp2"])
def test_four_rank_cp_layouts_train_as_one_process(layout, corpus, seeds, one_process, tmp_path):
    got = _train("llama3", corpus, seeds, tmp_path, "--model.attention_mask", "document", *layout, nproc=4)
    _assert_same(got, one_process("llama3", "document"))


def test_a_cp2_checkpoint_resumes_on_one_process(corpus, seeds, cp2, tmp_path):
    """The CP 2 run's step-5 checkpoint, resumed in a new folder on one process: the data position and weights
    come back, so steps 6-10 are the CP 2 run's own."""
    got, folder = cp2("llama3", "document")
    shutil.copytree(folder / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    resumed = _train("llama3", corpus, seeds, tmp_path, "--model.attention_mask", "document")
    assert "from step 5" in resumed["out"], resumed["out"][-3000:]
    assert set(resumed["train/loss"]) == set(range(6, STEPS + 1))
    worst = max(abs(v - got["train/loss"][s]) / got["train/loss"][s] for s, v in resumed["train/loss"].items())
    assert worst <= RTOL, (resumed["train/loss"], got["train/loss"])
