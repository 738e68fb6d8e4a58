#!/usr/bin/env bash
# Multi-node training under SLURM: one torchrun per node, joined by torchrun's c10d rendezvous on the
# first node of the allocation. Submit with sbatch; arguments go to train.py:
#
#   sbatch --nodes=4 scripts/slurm_multinode.sh --config llama3_70b --parallelism.tp 8
#
# Environment (all optional): GPUS_PER_NODE (default: visible GPUs, else 1 CPU process per node with
# gloo), RDZV_PORT (29500), LOG_RANK (local ranks shown on each node, default 0), CONFIG (= --config).
# The degrees must multiply to nodes x GPUS_PER_NODE; they are checked before any process group exists.
#
#SBATCH --job-name=torchtitan_lite
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "slurm_multinode.sh runs inside a SLURM allocation: submit it with sbatch --nodes=N $0 ..." >&2
  exit 2
fi
root="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
py="$("$root/scripts/setup_env.sh")"

nnodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
if [ -n "${GPUS_PER_NODE:-}" ]; then
  per_node="$GPUS_PER_NODE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  per_node="$(nvidia-smi -L | wc -l)"
else
  per_node=1
fi
head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
rdzv_port="${RDZV_PORT:-29500}"
extra=()
if [ -n "${CONFIG:-}" ]; then extra+=(--config "$CONFIG"); fi

# Fail fast, on the submitting side, if the degrees do not fit nodes x processes per node, or the
# tokenizer / dataset are missing or unreachable (from this host: compute nodes may see less).
TORCHTITAN_LITE_REQUIRE_DATA=1 WORLD_SIZE="$((nnodes * per_node))" "$py" "$root/train.py" "${extra[@]}" "$@" --check-config >/dev/null

echo "launching ${nnodes} node(s) x ${per_node} process(es), rendezvous ${head_node}:${rdzv_port}"
# One task per node runs torchrun; the rendezvous id ties the nodes of this job together. SIGTERM and
# SIGUSR1 (e.g. sbatch --signal=USR1@120) make the workers finish the step, save and exit 0.
TORCHTITAN_LITE_LAUNCHER_PREFIXES_RANK=1 srun --ntasks="$nnodes" --ntasks-per-node=1 \
  "$root/scripts/torchrun_graceful.sh" "$py" \
    --nnodes="$nnodes" --nproc_per_node="$per_node" \
    --rdzv_backend=c10d --rdzv_endpoint="${head_node}:${rdzv_port}" --rdzv_id="$SLURM_JOB_ID" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    "$root/train.py" "${extra[@]}" "$@"
