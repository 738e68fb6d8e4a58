#!/usr/bin/env bash
# Launches training through torchrun. All arguments go to train.py.
#   NGPU=8 ./run_train.sh --config llama3_8b_fp8      one process per GPU (NCCL)
#   NPROC=2 ./run_train.sh --parallelism.dp_shard 2  CPU processes (gloo) when there is no GPU
#   LOG_RANK=0,1 shows those ranks' output (default 0). CONFIG=name is the same as --config name.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$("$root/scripts/setup_env.sh")"
nproc="${NGPU:-${NPROC:-1}}"
log_rank="${LOG_RANK:-0}"
extra=()
if [ -n "${CONFIG:-}" ]; then extra+=(--config "$CONFIG"); fi
# Help-like flags need no process group: run them in-process for a quick answer.
for a in "$@"; do
  case "$a" in
    --help|-h|--print-config|--list-configs|--print-fp8-plan|--estimate-memory|--check-config|--dry-run|--dry-run-detail)
      exec "$py" "$root/train.py" "${extra[@]}" "$@";;
  esac
done
# Validate names, keys, types, parallel degrees and the data (local records included) before any process
# group exists. Local files it found clean are handed to the workers by fingerprint, so they skip the scan.
clean_records="$(mktemp)"
trap 'rm -f "$clean_records"' EXIT
TORCHTITAN_LITE_PREFLIGHT=1 TORCHTITAN_LITE_CLEAN_RECORDS_OUT="$clean_records" WORLD_SIZE="$nproc" \
  "$py" "$root/train.py" "${extra[@]}" "$@" --check-config >/dev/null
TORCHTITAN_LITE_CLEAN_RECORDS="$(cat "$clean_records")"
export TORCHTITAN_LITE_CLEAN_RECORDS
# The check printed what resuming the folder's checkpoint changes: the workers do not print it again.
export TORCHTITAN_LITE_RESUME_REPORTED=1
rm -f "$clean_records"
trap - EXIT
# SIGTERM / SIGUSR1 to this script (or its process group) make the workers save and exit 0.
TORCHTITAN_LITE_LAUNCHER_PREFIXES_RANK=1 exec "$root/scripts/torchrun_graceful.sh" "$py" --standalone --nproc_per_node="$nproc" \
  --local-ranks-filter "$log_rank" --role rank --tee 3 \
  "$root/train.py" "${extra[@]}" "$@"
