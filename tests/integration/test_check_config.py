"""--check-config (run before every launch by run_train.sh) applies every rule the build applies, and holds
the launch against the host's devices and memory, before any process starts."""
from __future__ import annotations


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


def test_8b_on_8_gpus_fits(cli):
    result = cli(["--config", "llama3_8b_fp8", "--check-config"], NGPU="8", TTL_GPU_MEMORY_GIB="80")
    assert result.returncode == 0, result.stderr
    assert "config 'llama3_8b_fp8' is valid for 8 process(es) (FSDP 8); estimated peak" in result.stdout


def test_8b_mxfp8_on_8_gpus_fits_and_a_native_kernel_request_is_left_to_the_gpu(cli):
    result = cli(["--config", "llama3_8b_mxfp8", "--model_converters.converters.0.kernel", "native", "--check-config"],
                 NGPU="8", TTL_GPU_MEMORY_GIB="80")
    assert result.returncode == 0, result.stderr
    assert "config 'llama3_8b_mxfp8' is valid for 8 process(es) (FSDP 8); estimated peak" in result.stdout


def test_a_gpu_launch_on_a_host_without_gpus_stops_before_torchrun(cli):
    result = cli(["--config", "llama3_debug", "--training.steps", "1"], NGPU="2", CUDA_VISIBLE_DEVICES="")
    assert result.returncode != 0
    assert "NGPU=2 but this host has no CUDA device" in result.stderr
    assert "Use NPROC=2 for CPU processes (gloo)" in result.stderr and "--dry-run" in result.stderr


def test_without_the_tokenizer_and_dataset_the_config_is_valid_but_a_launch_would_stop(cli, tmp_path):
    """Planning needs neither (the published vocabulary is used); --check-config says what a launch lacks."""
    tokenizer = tmp_path / "assets" / "hf" / "Llama-3.1-8B"
    result = cli(["--config", "llama3_8b_fp8", "--tokenizer.path", str(tokenizer), "--check-config"], NGPU="8",
                 TTL_GPU_MEMORY_GIB="80")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "config 'llama3_8b_fp8' is valid for 8 process(es) (FSDP 8)" in out
    assert "planning with the 8B flavor's vocabulary of 128256" in out
    assert "but a training launch would stop: the run's data is not ready:" in out
    assert f"`python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --output {tokenizer}`" in out
    assert "data.dataset='HuggingFaceFW/fineweb-edu' is a Hugging Face hub dataset, but HF_HUB_OFFLINE" in out


def test_a_launch_without_its_tokenizer_and_dataset_stops_before_torchrun(cli, tmp_path):
    tokenizer = tmp_path / "assets" / "hf" / "Llama-3.1-8B"
    result = cli(["--config", "llama3_debug", "--tokenizer.path", str(tokenizer), "--data.dataset",
                  "HuggingFaceFW/fineweb-edu", "--data.streaming", "true", "--data.shuffle", "false",
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
