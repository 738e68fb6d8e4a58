"""Every command in README.md and docs/*.md either runs here, exactly as written, or is listed below as
long-running with the reason (or as run, with its arguments, by another test that checks it further). Quick
commands (help, listings, plans, estimates, checks, dry runs) run in parallel subprocesses; the test fails on
a command that is neither run nor listed, so new docs cannot slip in untested commands. They run as a user
types them: in a shell whose `python` has no torch (the project's interpreter is found by
scripts/setup_env.sh, as after README command 1), and every script a `python scripts/...` line of README.md,
docs/ or BENCHMARKS.md names shows its help there.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT_DOCS = [*DOCS, REPO / "BENCHMARKS.md"]

QUICK_FLAGS = ("--help", "--list-configs", "--print-config", "--print-fp8-plan", "--estimate-memory",
               "--check-config", "--dry-run")
COMMAND_PREFIXES = ("./", "python ", "torchrun ", "scripts/", ".venv/", "pip ")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")

LONG_RUNNING = {
    "python scripts/layout_equivalence.py --baseline main~1":
        "trains 32 runs of two revisions (tests/unit/test_layout_equivalence.py checks its judgement)",
    "python scripts/planning_equivalence.py --baseline main~1":
        "plans 146 commands in two revisions (tests/unit/test_layout_equivalence.py checks its command list)",
    "./run_train.sh --config llama3_debug --model.attention_mask document":
        "trains 200 steps (tests/integration/test_document_mask_run.py trains it on short documents, 1 process "
        "and a pipeline)",
    "NPROC=2 ./run_train.sh --config llama3_debug --parallelism.cp 2 --model.attention_mask document":
        "trains 200 steps on 2 processes (tests/integration/test_context_parallel_run.py trains CP 2 on short "
        "documents against one process)",
    "python scripts/loss_compare.py --verdict llama3 --seeds 4 --parallel 2":
        "trains 32 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "python scripts/loss_compare.py --verdict llama3 --recipes tensorwise --seeds 4 --parallel 2":
        "trains 16 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "python scripts/loss_compare.py --verdict llama3 --recipes tensorwise_head --seeds 4 --parallel 2":
        "trains 16 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs and checks the arm)",
    "python scripts/loss_compare.py --verdict qwen3_moe --seeds 4 --parallel 2":
        "trains 20 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "python scripts/loss_compare.py --verdict deepseek_v3 --fault e5m2_forward --seeds 4 --parallel 2":
        "trains 16 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "python scripts/loss_compare.py --verdict qwen3_moe --recipes experts_rowwise --seeds 4 --parallel 2":
        "trains 16 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "python scripts/loss_compare.py --verdict deepseek_v3 --seeds 4 --parallel 2":
        "trains 16 runs (tests/unit/test_paired_verdict.py runs the verdict on stubbed runs)",
    "./run_train.sh --config qwen3_moe_debug --training.steps 20":
        "trains (tests/unit/test_qwen3_moe_training.py trains the family through the trainer)",
    "NPROC=2 ./run_train.sh --config qwen3_moe_debug --parallelism.dp_shard 2": "trains on 2 processes",
    "./run_train.sh --config deepseek_v3_debug --training.steps 20":
        "trains (tests/unit/test_deepseek_v3_training.py trains the family through the trainer)",
    "python scripts/convert_to_hf.py --checkpoint outputs/deepseek_v3_debug/checkpoint/step-20 --output deepseek_v3_debug_hf":
        "needs the trained run (tests/unit/test_deepseek_v3_export_run.py runs it on a small checkpoint)",
    "NPROC=2 ./run_train.sh --config deepseek_v3_debug --parallelism.tp 2 --training.steps 5":
        "trains on 2 processes (tests/distributed/test_deepseek_v3_tensor_parallel.py compares TP 2 with one process)",
    "NPROC=2 ./run_train.sh --config qwen3_moe_debug --parallelism.tp 2 --training.steps 5":
        "trains on 2 processes (tests/integration/test_train_distributed.py runs it against one process)",
    "./run_train.sh --config qwen3_moe_debug_bf16 --training.steps 20":
        "trains (tests/unit/test_qwen3_moe_training.py trains qwen3_moe_debug_bf16, compiled and eager)",
    "NPROC=2 ./run_train.sh --config qwen3_moe_debug --parallelism.ep 2 --training.steps 20":
        "trains on 2 processes (tests/integration/test_train_expert_parallel.py runs it for 4 steps)",
    "./run_train.sh --config qwen3_moe_debug --training.steps 20 --checkpoint.interval 20 --job.dump_folder "
    "outputs/qwen3_moe": "trains (tests/unit/test_qwen3_moe_training.py checkpoints a 1-step run and round-trips it)",
    "python scripts/convert_to_hf.py --checkpoint outputs/qwen3_moe/checkpoint/step-20 --output qwen3_moe_hf":
        "needs the trained run (test_qwen3_moe_training.py runs the round trip on a small checkpoint)",
    "python scripts/generate.py --hf-dir qwen3_moe_hf --prompt \"def main(\" --max-new-tokens 32":
        "needs the exported run (test_qwen3_moe_training.py samples it from both folders)",
    "python scripts/convert_from_hf.py --hf-dir qwen3_moe_hf --output qwen3_moe_seed":
        "needs the exported run (test_qwen3_moe_training.py compares the seed with the run bitwise)",
    "./run_train.sh --config qwen3_moe_debug --checkpoint.enable true --checkpoint.initial_load_path qwen3_moe_seed "
    "--job.dump_folder outputs/qwen3_moe_from_seed":
        "trains from the seed",
    "./run_train.sh": "trains llama3_debug for 200 steps (minutes)",
    "scripts/run_tests.sh": "the default test suite (.ci/run runs it)",
    "scripts/run_tests.sh -m slow": "the slow cases only (tests/unit/test_run_tests_selection.py checks the selection)",
    'scripts/run_tests.sh -m ""': "every case (tests/unit/test_run_tests_selection.py checks the selection)",
    "./run_train.sh --config llama3_debug --training.steps 50 --optimizer.lr 1e-3": "trains 50 steps",
    "./run_train.sh --config llama3_debug --config-file my_overrides.toml": "trains; needs the user's file",
    "NPROC=2 ./run_train.sh --config llama3_debug_fp8 --parallelism.dp_shard 2": "trains on 2 processes",
    "NGPU=8 ./run_train.sh --config llama3_8b_fp8": "needs 8 GPUs",
    "torchrun --nproc_per_node 8 train.py --config llama3_8b_fp8": "needs 8 GPUs",
    "./run_train.sh --data.dataset 'data/train-*.jsonl' --data.validation_files data/val.jsonl "
    "--job.dump_folder outputs/my_data":
        "trains; needs the user's data (tests/unit/test_data_held_out.py checks its files are held out)",
    "./run_train.sh --data.dataset my_org/my_corpus --data.streaming true --data.shuffle none "
    "--data.shuffle_buffer 1024 --job.dump_folder outputs/my_corpus":
        "trains; downloads a hub data set",
    "python scripts/fp8_sqnr.py --check": "~1 minute of CPU; tests/unit/test_fp8_gates.py runs the gates",
    "scripts/fp8_sqnr.py --check": "~1 minute of CPU; tests/unit/test_fp8_gates.py runs the gates",
    "python scripts/fp8_sqnr.py --check --recipes rowwise,experts_rowwise":
        "tests/unit/test_fp8_gates.py runs the gates per recipe",
    "python scripts/fp8_sqnr.py --check --fault wrong_axis":
        "tests/unit/test_fp8_gates.py::test_cli_check_passes_and_a_planted_fault_fails_it runs a fault through the CLI",
    "python scripts/train_tokenizer.py --input 'data/*.jsonl' --vocab-size 32000 --output tok.model":
        "needs the user's data",
    "python scripts/pretokenize.py --dataset 'data/train-*.jsonl' --validation-files data/val.jsonl --output "
    "data/tokens --workers 8":
        "needs the user's data (tests/unit/test_token_store.py runs it on a small file)",
    "./run_train.sh --data.dataset 'data/train-*.jsonl' --data.token_store data/tokens --job.dump_folder "
    "outputs/my_tokens":
        "trains; needs the user's store (tests/integration/test_pretokenized_run.py trains from one)",
    "python scripts/data_loader_bench.py": "a benchmark (tokenises the embedded corpus, about a minute)",
    "./run_train.sh --tokenizer.path tok.model --data.dataset 'data/*.jsonl' --validation.enable false "
    "--job.dump_folder outputs/my_tokenizer":
        "trains; needs the user's data",
    "./run_train.sh --checkpoint.enable true --checkpoint.interval 100 --checkpoint.keep_latest_k 3": "trains",
    "./run_train.sh --checkpoint.enable true --checkpoint.create_seed_checkpoint true --job.dump_folder outputs/seed":
        "builds a checkpoint",
    "NPROC=2 ./run_train.sh --parallelism.dp_shard 2 --checkpoint.enable true --training.steps 20":
        "trains on 2 processes (tests/distributed/test_data_reshard_resume.py resumes such a run on TP 2)",
    "./run_train.sh --checkpoint.enable true --checkpoint.interval 100 --training.spike_policy.enable true "
    "--training.spike_policy.signals loss,grad_norm": "trains (tests/integration/test_spike_policy.py trains with the policy)",
    "python scripts/generate.py --checkpoint outputs/llama3_debug/checkpoint/step-200 --prompt \"def main(\" "
    "--max-new-tokens 64":
        "needs the trained run (tests/unit/test_generation.py runs the script on a small checkpoint)",
    "python scripts/convert_to_hf.py --checkpoint outputs/llama3_debug/checkpoint/step-200 --output hf_out":
        "needs the trained run (tests/unit/test_hf_export_run.py runs it on a small checkpoint)",
    "python scripts/generate.py --hf-dir hf_out --prompt \"import \" --temperature 0.8 --top-p 0.9 --seed 1":
        "needs the exported run",
    "python scripts/convert_from_hf.py --hf-dir hf_out --output seed_ckpt": "needs the exported run",
    "./run_train.sh --checkpoint.enable true --checkpoint.initial_load_path seed_ckpt --job.dump_folder outputs/from_seed":
        "trains",
    "pip install -e .[wandb]": "installs packages",
    "python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 llama3_debug_fp8_rowwise "
    "--last 20 --tolerance 0.05 --out loss.png --table loss_gap.md": "trains three configs",
    "python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 --seeds 3 --last 20":
        "trains two configs over three seeds",
    "python scripts/loss_compare.py --configs llama3_debug llama3_debug_fp8 --steps 50 "
    "-- --precision.param_dtype float32 --model.n_layers 2": "trains two configs",
    "python scripts/loss_compare.py --runs outputs/loss_compare/llama3_debug_bf16 outputs/loss_compare/llama3_debug_fp8 "
    "--last 50": "needs finished runs",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8": "runs the model on training batches (a minute)",
    "python train.py --config llama3_debug_fp8 --metrics.fp8_stats_freq 10":
        "trains 200 steps (tests/integration/test_fp8_stats_run.py runs it on a 2-layer model)",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8_rowwise --checkpoint outputs/llama3_debug_fp8_rowwise/checkpoint "
    "--batches 4":
        "needs a trained run",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8 --precision.param_dtype float32 --min-fwd-sqnr 20":
        "runs the model on training batches (a minute)",
    "scripts/fp8_sqnr.py --config llama3_debug_fp8_blockwise":
        "runs the model on training batches (tests/unit/test_fp8_sqnr.py runs the blockwise CLI on a small model)",
    "python scripts/fp8_sqnr.py --config llama3_debug_fp8_blockwise --min-fwd-sqnr 20":
        "runs the model on training batches (tests/unit/test_fp8_sqnr.py runs the blockwise CLI on a small model)",
    "python scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8_blockwise --seeds 3 --last 20 "
    "--tolerance 0.05 --dump-root /tmp/ttl_bw/runs": "trains 6 x 200 steps (an hour on 2 cores)",
    "python scripts/loss_compare.py --runs /tmp/ttl_bw/seeds/llama3_debug_bf16 "
    "/tmp/ttl_bw/seeds/llama3_debug_fp8_blockwise --last 20 --tolerance 0.05": "needs the finished seed runs",
    "python scripts/loss_compare.py --runs /tmp/ttl_bw/seeds/llama3_debug_bf16/seed-<s> "
    "/tmp/ttl_bw/seeds/llama3_debug_fp8_blockwise/seed-<s> --last 20 --tolerance 0.05": "needs the finished seed runs",
    "python scripts/loss_compare.py --configs deepseek_v3_debug_bf16 deepseek_v3_debug_fp8_blockwise --steps 200 "
    "--last 20 --tolerance 0.05 --dump-root /tmp/lc_dsv3/runs --out /tmp/lc_dsv3/loss.png --progress-every 120 -- "
    "--validation.enable false":
        "trains 2 x 200 steps (20 minutes on 2 cores)",
    "python scripts/loss_compare.py --runs /tmp/lc_dsv3x/deepseek_v3_debug_bf16 /tmp/lc_dsv3x/deepseek_v3_debug_fp8_blockwise "
    "--last 20 --tolerance 0.05 --out /tmp/lc_dsv3x/loss.png": "needs the finished 200-step runs",
    "OMP_NUM_THREADS=1 python train.py --config llama3_debug --training.steps 200 --checkpoint.enable false "
    "--validation.enable false --metrics.log_freq 1 --job.dump_folder <dir>": "a template (<dir>); trains 200 steps",
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
    "sbatch --nodes=256 scripts/slurm_multinode.sh --config llama3_405b_fp8 --parallelism.pp 8 --parallelism.tp 8 "
    "--parallelism.pipeline_schedule Interleaved1F1B --training.local_batch_size 16": "needs a SLURM cluster",
    "NGPU=8 ./run_train.sh --config llama3_8b_128k --checkpoint.enable true --checkpoint.initial_load_path "
    "outputs/llama3_8b/checkpoint/step-1000": "needs 8 GPUs and an 8K run's checkpoint",
    "NPROC=2 ./run_train.sh --config llama3_debug --parallelism.pp 2 --training.steps 20":
        "trains on 2 processes (tests/integration/test_train_pipeline.py compares such runs with one process)",
    "python scripts/convert_from_hf.py --hf-dir assets/hf/Llama-3.1-8B --config llama3_8b_fp8 --output seeds/llama3_8b":
        "needs the downloaded 8B weights",
    "python scripts/verify_checkpoint.py outputs/llama3_debug/checkpoint":
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
    "OMP_NUM_THREADS=1 python train.py --config <cfg> --validation.enable false --job.dump_folder "
    "/tmp/lpx_lc/par/<cfg> --metrics.log_freq 1 --metrics.enable_tensorboard true --metrics.save_tb_folder tb "
    "--metrics.rank_0_only true --checkpoint.enable false": "a template (<cfg>)",
    "python scripts/loss_compare.py --runs /tmp/lpx_lc/par/qwen3_moe_debug_bf16 /tmp/lpx_lc/par/qwen3_moe_debug_fp8 "
    "/tmp/lpx_lc/par/qwen3_moe_debug_mxfp8 --last 20 --tolerance 0.05 --out /tmp/lpx_lc/moe_loss.png":
        "needs the three finished 200-step runs",
}


ONLY_THE_USERS_MACHINE_HAS = ("`python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B",
                              "but HF_HUB_OFFLINE", "data.dataset='/data/")
"""--check-config exits 1 (the config is valid, a launch would stop) when the data is not ready; here that
may only be for what the suite's host cannot have: the fetched Llama 3 tokenizer, the hub (the suite runs
offline), the user's data under /data."""


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


RUN_ELSEWHERE = {
    "NGPU=2048 ./run_train.sh --config llama3_405b_fp8 --parallelism.pp 8 --parallelism.tp 8 "
    "--parallelism.pipeline_schedule Interleaved1F1B --training.local_batch_size 16 --dry-run":
        "tests/integration/test_pipeline_planning.py",
    "NGPU=512 ./run_train.sh --config llama3_405b_fp8 --parallelism.tp 8 --parallelism.dp_replicate 4 --dry-run":
        "tests/integration/test_dry_run.py",
    "NGPU=256 ./run_train.sh --config deepseek_v3_671b_fp8 --parallelism.ep 8 --dry-run":
        "tests/integration/test_moe_planning.py",
    "NGPU=1024 ./run_train.sh --config llama3_405b_fp8 --training.seq_len 131072 --parallelism.cp 16 "
    "--parallelism.tp 8 --training.local_batch_size 1 --model.attention_mask document --dry-run":
        "tests/integration/test_dry_run.py",
}
"""Quick commands that take tens of seconds (cluster-size dry runs) and that another test runs with the same
arguments and checks further (every pipeline rank's bytes, the fit in 80 GiB): run there, not twice."""


def is_quick(command: str) -> bool:
    words = command.split()
    return any(flag in words for flag in QUICK_FLAGS)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """The bin folder of a virtual environment without torch: its `python` and `python3` stand for the
    interpreter a user's shell finds first on PATH."""
    bin_dir = tmp_path_factory.mktemp("bare") / "venv"
    venv.create(bin_dir, with_pip=False, symlinks=True)
    bin_dir = bin_dir / "bin"
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in probe.stderr  # the shell's python really lacks torch
    return bin_dir


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The checkout as a user's shell sees it, without its ./outputs: every top-level entry linked except that
    folder, so the documented commands (relative paths, the default --job.dump_folder) run as written while
    what README command 1 left in ./outputs can neither steer nor receive them."""
    shadow = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name != "outputs":
            (shadow / entry.name).symlink_to(entry)
    return shadow


def run(command: str, bare_python: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{bare_python}{os.pathsep}{env.get('PATH', '')}"
    # What scripts/setup_env.sh names (run_train.sh and the scripts ask it): this test's interpreter, the
    # project's environment under test, instead of probing ./.venv (which a checkout may lack).
    env["TTL_PYTHON"] = sys.executable
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_every_documented_command_is_run_or_listed():
    commands = doc_commands()
    assert len(commands) > 20  # the extraction finds the docs' commands
    unknown = [f"{name}: {cmd}" for name, cmd in commands if not is_quick(cmd) and cmd not in LONG_RUNNING]
    assert not unknown, "commands neither quick nor listed in LONG_RUNNING (add them with a reason):\n" + "\n".join(unknown)
    stale = sorted(set(LONG_RUNNING) - {cmd for _, cmd in commands})
    assert not stale, f"LONG_RUNNING lists commands the docs no longer have: {stale}"


def test_commands_run_elsewhere_are_documented_and_run_there_with_their_arguments():
    documented = {cmd for _, cmd in doc_commands()}
    for command, test in RUN_ELSEWHERE.items():
        assert command in documented and is_quick(command), command
        text = (REPO / test).read_text()
        env = ENV_PREFIX.match(command)
        assert env is None or env.group(0).split("=")[1].split()[0] in text, (command, test)  # the world size
        flags = [w for w in command.split() if w.startswith("--")]
        values = [w for w in command.split()[1:] if not w.startswith("--") and not w.startswith("./")]
        missing = [w for w in flags + values if w not in text]
        assert not missing, f"{test} no longer runs {command!r}: {missing} not in it"
        # ... in the default suite: a test of that file not marked slow names the command's world size.
        world = env.group(0).split("=")[1].split()[0] if env else None
        assert world is None or world in default_tests_source(REPO / test), f"only slow tests of {test} run {command!r}"


def default_tests_source(path: Path) -> str:
    """The source of the test functions of ``path`` that scripts/run_tests.sh runs by default (not marked slow)."""
    import ast

    source = path.read_text()
    tests = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return "\n".join(ast.get_source_segment(source, node) or "" for node in tests
                     if not any("slow" in ast.unparse(d) for d in node.decorator_list))


def test_quick_documented_commands_run_as_written(bare_python, checkout):
    quick = list(dict.fromkeys(cmd for _, cmd in doc_commands() if is_quick(cmd) and cmd not in RUN_ELSEWHERE))
    assert any(cmd.startswith("NGPU=8 ") for cmd in quick)  # environment prefixes are part of the command
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(quick, pool.map(lambda cmd: run(cmd, bare_python, checkout), quick)))
    failed = [f"{cmd}\n  exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}" for cmd, r in results.items()
              if r.returncode != 0 and not stops_only_for_the_users_assets(r)]
    assert not failed, "documented commands failed:\n" + "\n".join(failed)
    plan = results["NGPU=8 python train.py --config llama3_8b_fp8 --print-fp8-plan"].stdout.splitlines()
    assert documented_excerpt() and all(line in plan for line in documented_excerpt() if line != "...")


def documented_python_scripts() -> list[str]:
    """Every `python <file>.py` of README.md, docs/ and BENCHMARKS.md, in code blocks or prose (not
    `.venv/bin/python ...`, which names its interpreter)."""
    found: set[str] = set()
    for path in SCRIPT_DOCS:
        found.update(re.findall(r"(?<![\w/.-])python ((?:scripts/)?\w+\.py)\b", path.read_text()))
    return sorted(found)


def test_documented_python_scripts_hand_over_to_the_project_python(bare_python, tmp_path):
    # The shell's python has no torch: each script must start again, with the same arguments, under the
    # interpreter scripts/setup_env.sh names. A stand-in interpreter that prints what it was given shows
    # that for every documented script without loading torch 20 times; the quick commands above run
    # real ones end to end.
    scripts = documented_python_scripts()
    assert {"train.py", "scripts/generate.py", "scripts/convert_to_hf.py", "scripts/benchmark.py",
            "scripts/verify_checkpoint.py", "scripts/checkpoint_hash_bench.py"} <= set(scripts)
    stand_in = tmp_path / "project_python"
    stand_in.write_text('#!/bin/sh\nprintf "%s\\n" "$0" "$@"\n')
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bare_python}{os.pathsep}{os.environ.get('PATH', '')}", "TTL_PYTHON": str(stand_in)}
    wrong = {}
    for script in scripts:
        result = subprocess.run(["bash", "-c", f"python -u {script} --help"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0 or result.stdout.splitlines() != [str(stand_in), "-u", script, "--help"]:
            wrong[script] = (result.returncode, result.stdout.strip(), result.stderr.strip()[-400:])
    assert not wrong, f"scripts that do not start again under the project's interpreter: {wrong}"


def test_an_interpreter_without_torch_named_by_setup_env_is_refused_with_the_fix(bare_python):
    # TTL_PYTHON names the same torch-less python: one second start at most, then the fix.
    env = {**os.environ, "PATH": f"{bare_python}{os.pathsep}{os.environ.get('PATH', '')}",
           "TTL_PYTHON": str(bare_python / "python")}
    result = subprocess.run(["bash", "-c", "python scripts/generate.py --help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {bare_python / 'python'}, the interpreter scripts/setup_env.sh names "
                                    "(TTL_PYTHON when set, else ./.venv), has no torch")
    assert "Point TTL_PYTHON at a Python with the project's dependencies" in result.stderr


def stops_only_for_the_users_assets(result: subprocess.CompletedProcess) -> bool:
    marker = "but a training launch would stop: the run's data is not ready:\n"
    if result.returncode != 1 or marker not in result.stdout:
        return False
    problems = [line for line in result.stdout.split(marker, 1)[1].splitlines() if line.startswith("  - ")]
    return bool(problems) and all(any(m in p for m in ONLY_THE_USERS_MACHINE_HAS) for p in problems)


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


def test_ci_runs_the_readme_commands_in_order():
    """CI is a new user: README command 1, then exactly command 2, so a suite that reads what command 1 left
    behind fails there."""
    first_block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    assert first_block is not None
    readme = _lines(first_block.group(1))
    ci = [line for line in _lines((REPO / ".ci" / "run").read_text()) if not line.startswith(("set ", "cd "))]
    assert readme == ["./run_train.sh", "scripts/run_tests.sh"] and ci == readme
