"""Every command in README.md and docs/*.md either runs here, exactly as written, or is listed below as
long-running with the reason. Quick commands (help, listings, plans, estimates, checks, dry runs) run
in parallel subprocesses; the test fails on a command that is neither run nor listed, so new docs
cannot slip in untested commands.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

QUICK_FLAGS = ("--help", "--list-configs", "--print-config", "--print-fp8-plan", "--estimate-memory",
               "--check-config", "--dry-run")
COMMAND_PREFIXES = ("./", "python ", "torchrun ", "scripts/", ".venv/", "pip ")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")

LONG_RUNNING = {
    "./run_train.sh": "trains llama3_debug for 200 steps (minutes)",
    "scripts/run_tests.sh": "the whole test suite",
    "./run_train.sh --config llama3_debug --training.steps 50 --optimizer.lr 1e-3": "trains 50 steps",
    "./run_train.sh --config llama3_debug --config-file my_overrides.toml": "trains; needs the user's file",
    "NPROC=2 ./run_train.sh --config llama3_debug_fp8 --parallelism.dp_shard 2": "trains on 2 processes",
    "NGPU=8 ./run_train.sh --config llama3_8b_fp8": "needs 8 GPUs",
    "torchrun --nproc_per_node 8 train.py --config llama3_8b_fp8": "needs 8 GPUs",
    "./run_train.sh --data.dataset 'data/*.jsonl' --data.validation_files data/val.jsonl": "trains; needs the user's data",
    "./run_train.sh --data.dataset my_org/my_corpus --data.streaming true --data.shuffle false":
        "trains; downloads a hub data set",
    "python scripts/train_tokenizer.py --input 'data/*.jsonl' --vocab-size 32000 --output tok.model":
        "needs the user's data",
    "./run_train.sh --tokenizer.path tok.model --data.dataset 'data/*.jsonl'": "trains; needs the user's data",
    "./run_train.sh --checkpoint.enable true --checkpoint.interval 100 --checkpoint.keep_latest_k 3": "trains",
    "./run_train.sh --checkpoint.enable true --checkpoint.create_seed_checkpoint true": "builds a checkpoint",
    "./run_train.sh --checkpoint.enable true --checkpoint.interval 100 --training.spike_policy.enable true "
    "--training.spike_policy.signals loss,grad_norm": "trains (tests/integration/test_spike_policy.py trains with the policy)",
    "python scripts/generate.py --checkpoint outputs/checkpoint/step-200 --prompt \"def main(\" --max-new-tokens 64":
        "needs the trained run (tests/unit/test_generation.py runs the script on a small checkpoint)",
    "python scripts/convert_to_hf.py --checkpoint outputs/checkpoint/step-200 --output hf_out":
        "needs the trained run (tests/unit/test_hf_export_run.py runs it on a small checkpoint)",
    "python scripts/generate.py --hf-dir hf_out --prompt \"import \" --temperature 0.8 --top-p 0.9 --seed 1":
        "needs the exported run",
    "python scripts/convert_from_hf.py --hf-dir hf_out --output seed_ckpt": "needs the exported run",
    "./run_train.sh --checkpoint.enable true --checkpoint.initial_load_path seed_ckpt": "trains",
    "pip install -e .[wandb]": "installs packages",
    "python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 llama3_debug_fp8_rowwise "
    "--last 20 --tolerance 0.05 --out loss.png --table loss_gap.md": "trains three configs",
    "python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 --seeds 3 --last 20":
        "trains two configs over three seeds",
    "python scripts/loss_compare.py --configs llama3_debug llama3_debug_fp8 --steps 50 "
    "-- --precision.param_dtype float32 --model.n_layers 2": "trains two configs",
    "python scripts/loss_compare.py --runs outputs/bf16 outputs/fp8 --last 50": "needs finished runs",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8": "runs the model on training batches (a minute)",
    "python train.py --config llama3_debug_fp8 --metrics.fp8_stats_freq 10":
        "trains 200 steps (tests/integration/test_fp8_stats_run.py runs it on a 2-layer model)",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8_rowwise --checkpoint outputs/checkpoint --batches 4":
        "needs a trained run",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8 --precision.param_dtype float32 --min-fwd-sqnr 20":
        "runs the model on training batches (a minute)",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8 --min-fwd-sqnr 20":
        "runs the model on training batches (a minute)",
    "python scripts/float8_layer_bench.py --shapes llama3_8b": "benchmarks 8B-sized layers (needs a GPU)",
    "python scripts/float8_layer_bench.py --shapes 8192,4096,14336 --recipes tensorwise rowwise": "needs a GPU",
    "python scripts/float8_layer_bench.py --shapes 256,256,256 --no-compile":
        "a benchmark (tests/unit/test_float8_layer_bench.py covers it)",
    "./run_train.sh --config <cfg> --metrics.log_freq 1 --job.dump_folder /tmp/ttl/lc/<cfg>": "a template (<cfg>)",
    "HF_TOKEN=hf_... python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B":
        "downloads from the hub (tests/unit/test_hf_assets.py runs it against a stand-in client)",
    "NGPU=8 ./run_train.sh --config llama3_8b_fp8 --parallelism.tp 2 --training.steps 20000 --checkpoint.enable true "
    "--checkpoint.interval 500 --job.dump_folder outputs/llama3_8b": "needs 8 GPUs and the fetched assets",
    "sbatch --nodes=4 scripts/slurm_multinode.sh --config llama3_8b_fp8 --parallelism.tp 2 --training.steps 20000 "
    "--checkpoint.enable true --job.dump_folder outputs/llama3_8b": "needs a SLURM cluster",
    "sbatch --nodes=64 scripts/slurm_multinode.sh --config llama3_405b_fp8 --parallelism.tp 8 --parallelism.dp_replicate 4":
        "needs a SLURM cluster",
    "python scripts/convert_from_hf.py --hf-dir assets/hf/Llama-3.1-8B --config llama3_8b_fp8 --output seeds/llama3_8b":
        "needs the downloaded 8B weights",
    "python scripts/verify_checkpoint.py outputs/checkpoint":
        "needs a trained run (tests/unit/test_checkpoint_integrity.py runs it on a small checkpoint)",
    "scripts/test_torch_versions.sh 2.11.0 2.14.1 [-- PYTEST_ARGS]": "installs two torch releases and runs the suite",
    "scripts/fetch_gpu_wheels.sh DIR": "downloads wheels (a template: DIR)",
    "python scripts/loss_compare.py --runs <bf16> <fp8> <fp8_rowwise> --last 20 --tolerance 0.05 --out loss.png":
        "a template (<bf16> ...)",
    "python scripts/loss_compare.py --runs <bf16> <fp8> <fp8_rowwise> <mxfp8> --last 20 --tolerance 0.05 "
    "--out loss.png": "a template (<bf16> ...)",
    "python scripts/fp8_sqnr.py --config <cfg> --min-fwd-sqnr 20": "a template (<cfg>)",
    "OMP_NUM_THREADS=1 python train.py --config <cfg> --training.seed <s> --training.steps 200 "
    "--checkpoint.enable false --metrics.cpu_peak_tflops 1 --job.dump_folder /tmp/ttl_seeds/<cfg>/seed-<s> "
    "--metrics.log_freq 1 --metrics.enable_tensorboard true --metrics.save_tb_folder tb --metrics.rank_0_only true":
        "a template (<cfg>, <s>)",
    "python scripts/loss_compare.py --runs /tmp/ttl_seeds/<bf16> /tmp/ttl_seeds/<fp8> /tmp/ttl_seeds/<fp8_rowwise> "
    "/tmp/ttl_seeds/<mxfp8> --last 20": "a template (<bf16> ...)",
}


def doc_commands() -> list[tuple[str, str]]:
    """(file name, command) of every shell line in ```bash blocks and every inline `command` span."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
            for command in _lines(block):
                found.append((path.name, command))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if " " in span and ENV_PREFIX.sub("", span).startswith(COMMAND_PREFIXES):
                found.append((path.name, span.strip()))
    return found


def _lines(block: str) -> list[str]:
    commands, pending = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment is not part of the command
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def is_quick(command: str) -> bool:
    words = command.split()
    return any(flag in words for flag in QUICK_FLAGS)


def run(command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # `python` and run_train.sh use this interpreter (run_train.sh would otherwise probe the venv first).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TTL_PYTHON"] = sys.executable
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_every_documented_command_is_run_or_listed():
    commands = doc_commands()
    assert len(commands) > 20  # the extraction finds the docs' commands
    unknown = [f"{name}: {cmd}" for name, cmd in commands if not is_quick(cmd) and cmd not in LONG_RUNNING]
    assert not unknown, "commands neither quick nor listed in LONG_RUNNING (add them with a reason):\n" + "\n".join(unknown)
    stale = sorted(set(LONG_RUNNING) - {cmd for _, cmd in commands})
    assert not stale, f"LONG_RUNNING lists commands the docs no longer have: {stale}"


def test_quick_documented_commands_run_as_written():
    quick = list(dict.fromkeys(cmd for _, cmd in doc_commands() if is_quick(cmd)))
    assert any(cmd.startswith("NGPU=8 ") for cmd in quick)  # environment prefixes are part of the command
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(quick, pool.map(run, quick)))
    failed = [f"{cmd}\n  exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}" for cmd, r in results.items()
              if r.returncode != 0]
    assert not failed, "documented commands failed:\n" + "\n".join(failed)
    plan = results["NGPU=8 python train.py --config llama3_8b_fp8 --print-fp8-plan"].stdout.splitlines()
    assert documented_excerpt() and all(line in plan for line in documented_excerpt() if line != "...")


def documented_excerpt() -> list[str]:
    """The --print-fp8-plan excerpt of docs/mixed_precision.md: the block after the command's paragraph."""
    text = (REPO / "docs" / "mixed_precision.md").read_text()
    after = text[text.index("`NGPU=8 python train.py --config llama3_8b_fp8 --print-fp8-plan`"):]
    return after.split("```\n", 2)[1].splitlines()


@pytest.mark.parametrize("line, expected", [
    ("NGPU=8 ./run_train.sh --x  # note", ["NGPU=8 ./run_train.sh --x"]),
    ("python a.py --b \\\n    --c d", ["python a.py --b --c d"]),
    ("# only a comment\n\n./run_train.sh", ["./run_train.sh"]),
])
def test_command_extraction(line, expected):
    assert _lines(line) == expected
