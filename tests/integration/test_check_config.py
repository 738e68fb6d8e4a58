"""--check-config (run before every launch by run_train.sh) applies every rule the build applies, and holds
the launch against the host's devices and memory, before any process starts."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.actions import run_action
from torchtitan_lite.components.data import prescan
from torchtitan_lite.components.data.readiness import data_problems
from torchtitan_lite.components.data.sources import load_split
from torchtitan_lite.config import parse_cli
from torchtitan_lite.hf_assets import SMOKE_OVERRIDE

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ENV = ("WORLD_SIZE", "NGPU", "NPROC", "TTL_GPU_MEMORY_GIB", "TORCHTITAN_LITE_PREFLIGHT",
              "TORCHTITAN_LITE_REQUIRE_DATA", prescan.CLEAN_RECORDS_OUT_ENV)


@pytest.fixture
def check(monkeypatch, capsys):
    """--check-config in this process (as train.py runs it) under the given launch environment:
    (exit status, stdout, stderr)."""
    def run(args: list[str], **env: str) -> tuple[int, str, str]:
        for name in LAUNCH_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        status = run_action(parse_cli([*args, "--check-config"], registry=DEFAULT_REGISTRY), registry=DEFAULT_REGISTRY)
        out, err = capsys.readouterr()
        return status, out, err
    return run


@pytest.fixture
def bad_records(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "def f():\n    return 1\n"}) + "\n" + json.dumps({"text": 3}) + "\n")
    return path


def test_rowwise_float8_with_float16_is_rejected_by_the_converter_rule(cli):
    result = cli(["--config", "llama3_debug_fp8_rowwise", "--precision.param_dtype", "float16", "--check-config"])
    assert result.returncode == 2
    assert "recipe_name='rowwise' cannot be combined with precision.param_dtype=float16" in result.stderr


def test_float32_evaluation_with_fsdp_and_bf16_is_rejected_by_the_precision_rule(cli):
    result = cli(["--config", "llama3_debug_bf16", "--precision.mixed_precision_eval", "false", "--check-config"],
                 NPROC="2")
    assert result.returncode == 2
    assert "precision.mixed_precision_eval=False (float32 evaluation) cannot be honoured with FSDP" in result.stderr


def test_8b_on_one_gpu_does_not_fit_and_the_error_names_estimate_limit_and_fixes(cli):
    result = cli(["--config", "llama3_8b_fp8", "--check-config"], NGPU="1", TTL_GPU_MEMORY_GIB="80")
    assert result.returncode == 2
    err = result.stderr
    assert "exceeds 80.0 GiB (80 GiB per GPU" in err and "estimated peak per rank" in err
    assert "more GPUs" in err and "--activation_checkpoint.mode full" in err


def test_8b_on_8_gpus_fits(check):
    """With the smoke recipe, since this host has neither the Llama 3 tokenizer nor the hub (a launch would stop)."""
    status, out, _ = check(["--config", "llama3_8b_fp8", *SMOKE_OVERRIDE.split()], NGPU="8", TTL_GPU_MEMORY_GIB="80")
    assert status == 0, out
    assert "config 'llama3_8b_fp8' is valid for 8 process(es) (FSDP 8); estimated peak" in out


def test_8b_mxfp8_on_8_gpus_fits_and_a_native_kernel_request_is_left_to_the_gpu(check):
    status, out, _ = check(["--config", "llama3_8b_mxfp8", "--model_converters.converters.0.kernel", "native",
                            *SMOKE_OVERRIDE.split()], NGPU="8", TTL_GPU_MEMORY_GIB="80")
    assert status == 0, out
    assert "config 'llama3_8b_mxfp8' is valid for 8 process(es) (FSDP 8); estimated peak" in out


def test_a_gpu_launch_on_a_host_without_gpus_stops_before_torchrun(cli):
    result = cli(["--config", "llama3_debug", "--training.steps", "1"], NGPU="2", CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0
    assert "NGPU=2 but this host has no CUDA device" in result.stderr
    assert "Use NPROC=2 for CPU processes (gloo)" in result.stderr and "--dry-run" in result.stderr


def test_without_the_tokenizer_and_dataset_the_config_is_valid_but_a_launch_would_stop(cli, tmp_path):
    """Planning needs neither (the published vocabulary is used); --check-config says what a launch lacks, and
    exits 1: the config is valid (2 would say it is not), but a launch would stop."""
    tokenizer = tmp_path / "assets" / "hf" / "Llama-3.1-8B"
    result = cli(["--config", "llama3_8b_fp8", "--tokenizer.path", str(tokenizer), "--check-config"], NGPU="8",
                 TTL_GPU_MEMORY_GIB="80")
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "config 'llama3_8b_fp8' is valid for 8 process(es) (FSDP 8)" in out
    assert "planning with the 8B flavor's vocabulary of 128256" in out
    assert "but a training launch would stop: the run's data is not ready:" in out
    assert f"`python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --output {tokenizer}`" in out
    assert "data.dataset='HuggingFaceFW/fineweb-edu' is a Hugging Face hub dataset, but HF_HUB_OFFLINE" in out


def test_a_launch_without_its_tokenizer_and_dataset_stops_before_torchrun(cli, tmp_path):
    tokenizer = tmp_path / "assets" / "hf" / "Llama-3.1-8B"
    result = cli(["--config", "llama3_debug", "--tokenizer.path", str(tokenizer), "--data.dataset",
                  "HuggingFaceFW/fineweb-edu", "--data.streaming", "true", "--data.shuffle", "none",
                  "--training.steps", "1"])
    assert result.returncode == 2
    err = result.stderr
    assert "error: the run's data is not ready:" in err
    assert f"download_hf_assets.py --repo meta-llama/Llama-3.1-8B --output {tokenizer}" in err
    assert "`--data.dataset embedded --tokenizer.path none`" in err
    assert "rank0" not in result.stdout + err  # no worker was started


def test_the_slurm_submit_check_requires_the_data(cli, tmp_path):
    """scripts/slurm_multinode.sh checks on the submitting host (no GPUs there) with TORCHTITAN_LITE_REQUIRE_DATA."""
    result = cli(["--config", "llama3_debug", "--tokenizer.path", str(tmp_path / "tok"), "--check-config"],
                 launcher="train.py", TORCHTITAN_LITE_REQUIRE_DATA="1")
    assert result.returncode == 2
    assert f"error: the run's data is not ready:\n  - tokenizer.path='{tmp_path / 'tok'}' does not exist" in result.stderr


def test_a_glob_without_validation_files_is_refused_with_both_fixes(check, tmp_path):
    """llama3_debug validates by default; a file source has no validation split (the README's own example)."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    glob = str(tmp_path / "*.jsonl")
    status, out, _ = check(["--tokenizer.path", "none", "--data.dataset", glob])
    assert status == 1
    assert "config 'llama3_debug' is valid for 1 process(es)" in out
    assert (f"but a training launch would stop: the run's data is not ready:\n  - data.dataset='{glob}' is a file or "
            f"glob, which has no validation split (validation.enable is on); set --data.validation_files FILE to "
            f"held-out documents (a file or glob, e.g. 'data/val-*.jsonl'), or --validation.enable false") in out
    status, _, err = check(["--tokenizer.path", "none", "--data.dataset", glob], TORCHTITAN_LITE_PREFLIGHT="1")
    assert status == 2 and "error: the run's data is not ready:\n  - data.dataset=" in err
    assert check(["--tokenizer.path", "none", "--data.dataset", glob, "--validation.enable", "false"])[0] == 0
    held_out = tmp_path / "held_out" / "val.jsonl"
    held_out.parent.mkdir()
    held_out.write_text(json.dumps({"text": "y = 2"}) + "\n")
    assert check(["--tokenizer.path", "none", "--data.dataset", glob, "--data.validation_files", str(held_out)])[0] == 0


def test_bad_local_records_are_refused_by_the_check(check, bad_records):
    args = ["--tokenizer.path", "none", "--data.dataset", str(bad_records), "--validation.enable", "false"]
    status, out, _ = check(args)
    assert status == 1
    assert (f"  - {bad_records}:2: text=3 is a int, not a string (data.dataset='{bad_records}'); fix the record, or "
            f"point data.text_field at the field that holds the text, or set data.on_bad_record=skip") in out
    # Validation files are scanned too, and skipping bad records is no problem (the loader leaves them out).
    status, out, _ = check([*args[:4], "--data.validation_files", str(bad_records)])
    assert status == 1 and f"(data.validation_files='{bad_records}')" in out
    assert check([*args, "--data.on_bad_record", "skip"])[0] == 0


def test_bad_local_records_stop_the_launch_before_torchrun(cli, bad_records):
    """End to end: run_train.sh's check refuses the file; no worker (rank) ever starts."""
    result = cli(["--tokenizer.path", "none", "--data.dataset", str(bad_records), "--validation.enable", "false",
                  "--training.steps", "1", "--job.dump_folder", str(bad_records.parent / "out")])
    assert result.returncode == 2
    assert f"error: the run's data is not ready:\n  - {bad_records}:2: text=3 is a int, not a string" in result.stderr
    assert "rank0" not in result.stdout + result.stderr
    assert not (bad_records.parent / "out").exists()


def test_files_found_clean_are_handed_to_the_workers_by_fingerprint(check, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "x = 1"}) + "\n")
    out_file = tmp_path / "clean"
    args = ["--tokenizer.path", "none", "--data.dataset", str(docs), "--validation.enable", "false"]
    assert check(args, TORCHTITAN_LITE_PREFLIGHT="1", **{prescan.CLEAN_RECORDS_OUT_ENV: str(out_file)})[0] == 0
    assert out_file.read_text() == prescan.fingerprint([str(docs)], "json", "text")


def test_a_gpu_launch_sized_from_a_host_without_gpus_names_what_it_could_not_check(check):
    status, out, _ = check(["--config", "llama3_debug"], NGPU="8")
    assert status == 0
    assert out.splitlines()[1:] == [
        "not checked on this host:",
        "  - the devices: NGPU=8 needs 8 CUDA device(s) per node; this host has none",
        "  - the GPU memory: the estimate was held against 80 GiB per GPU (assumed: this host has no GPU to ask; set "
        "TTL_GPU_MEMORY_GIB for other GPUs)",
    ]
    status, out, _ = check(["--config", "llama3_debug"], NGPU="8", TTL_GPU_MEMORY_GIB="141")
    assert status == 0
    assert out.splitlines()[-1] == ("  - the GPU memory: the estimate was held against 141 GiB per GPU (from "
                                    "TTL_GPU_MEMORY_GIB: this host has no GPU to ask)")
    assert check(["--config", "llama3_debug"], NPROC="2")[1].count("\n") == 1  # a CPU launch: all checked here


PUBLISHED = [name for name in DEFAULT_REGISTRY.names() if re.fullmatch(r"llama3_\d+b.*", name)]


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_smoke_recipe_needs_no_second_flag_on_published_configs(name):
    """The configs stream a hub dataset with a configuration ('sample-10BT'); the embedded corpus has none, and
    replacing the dataset drops it, so the smoke recipe is ready as printed."""
    cfg = parse_cli(["--config", name, *SMOKE_OVERRIDE.split()], registry=DEFAULT_REGISTRY).config
    assert cfg.data.dataset == "embedded" and cfg.data.dataset_config is None
    assert data_problems(cfg.data, cfg.tokenizer, validation=cfg.validation.enable) == []


def test_the_smoke_recipe_loads_its_data_on_llama3_8b():
    """What the run used to fail on after building the 8B model: loading the embedded corpus with the
    config's hub configuration name."""
    cfg = parse_cli(["--config", "llama3_8b", *SMOKE_OVERRIDE.split()], registry=DEFAULT_REGISTRY).config
    for role in ("train", "validation"):
        assert isinstance(next(iter(load_split(cfg.data, role)))["text"], str)


def test_the_readme_smoke_recipe_checks_on_llama3_8b(check):
    assert f"A smoke run that needs no download: `{SMOKE_OVERRIDE}`" in (ROOT / "README.md").read_text()
    status, out, _ = check(["--config", "llama3_8b", *SMOKE_OVERRIDE.split()], NGPU="8")
    assert status == 0, out
    assert out.startswith("config 'llama3_8b' is valid for 8 process(es) (FSDP 8)")


def test_a_configuration_for_the_embedded_corpus_is_still_refused_before_launch(check):
    """Set explicitly beside it, a hub configuration name contradicts the embedded corpus."""
    status, out, _ = check(["--config", "llama3_8b", *SMOKE_OVERRIDE.split(), "--data.dataset_config", "en"], NGPU="8")
    assert status == 1
    assert ("  - data.dataset_config='en' selects a configuration of a hub dataset or dataset folder; the embedded "
            "corpus has none, so leave it unset") in out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compiling_grouped_moe_experts_outside_bfloat16_is_refused_before_launch(check, dtype):
    """The family's own rule (ModelSpec.check_run), applied by resolve_run: refused by --check-config, not
    after torchrun and the model build."""
    args = ["--config", "qwen3_moe_debug", "--tokenizer.path", "none", "--data.dataset", "embedded",
            "--compile.enable", "true", "--precision.param_dtype", dtype]
    status, _, err = check(args)
    assert status == 2
    assert (f"error: compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is {dtype} "
            f"(torch._grouped_mm is traced for bfloat16 only); set --precision.param_dtype bfloat16 or "
            f"--compile.enable false") in err
    assert check([*args[:-1], "bfloat16"])[0] == 0
    assert check([*args[:-4], "--precision.param_dtype", dtype])[0] == 0  # eager: any dtype


def test_a_tp_that_does_not_split_the_moe_evenly_is_refused_before_launch(check, monkeypatch):
    """Expert tensor parallelism splits every expert's hidden dim: the family's rule (ModelSpec.check_run, with
    the run's tp) refuses an uneven or unaligned split at resolve, and the heads' rule a tp the heads do not
    take."""
    from models.qwen3_moe import QWEN3_MOE_FLAVORS

    args = ["--config", "qwen3_moe_debug", "--tokenizer.path", "none", "--data.dataset", "embedded"]
    assert check([*args, "--parallelism.tp", "2"], NPROC="2")[0] == 0
    status, _, err = check([*args, "--parallelism.tp", "4"], NPROC="4")
    assert status == 2 and "parallelism.tp=4 must divide the model's n_kv_heads=2" in err
    debug = QWEN3_MOE_FLAVORS["debug"]
    monkeypatch.setitem(QWEN3_MOE_FLAVORS, "debug", dataclasses.replace(debug, moe=dataclasses.replace(debug.moe,
                                                                                                        hidden_dim=40)))
    status, _, err = check([*args, "--parallelism.tp", "2"], NPROC="2")
    assert status == 2
    assert ("error: parallelism.tp=2 leaves each rank 20 of the experts' hidden_dim=40 channels, not a multiple of "
            "8: torch._grouped_mm needs 16-byte aligned strides in bfloat16") in err


def test_the_pipeline_layout_is_stated_with_accumulation_as_its_own_number(check):
    """Stages per rank, blocks per stage and micro-batches per local batch, apart from gradient accumulation."""
    status, out, _ = check(["--parallelism.pp", "2", "--parallelism.pipeline_schedule", "Interleaved1F1B",
                            "--parallelism.pipeline_microbatch_size", "2", "--training.global_batch_size", "64",
                            "--parallelism.dp_shard", "2"], NPROC="4")
    assert status == 0
    assert ("pipeline: PP 2 (Interleaved1F1B, 4 stages, 2 per rank, 8 micro-batches of 2); blocks per stage 1, 2, 2, "
            "1 (the first adds the embedding, the last the head); gradient accumulation 2 (local batches per "
            "optimizer step)") in out
