#!/usr/bin/env bash
# torchrun whose workers, not torchrun, handle SIGTERM and SIGUSR1:
#   scripts/torchrun_graceful.sh PYTHON TORCHRUN_ARGS... train.py TRAIN_ARGS...
#
# Left to itself, torchrun forwards a SIGTERM to the workers and then re-raises it, so the launch
# exits 1 even though every worker finished its step, saved and exited 0; it SIGKILLs workers still
# saving 30 s after the signal; and a SIGUSR1 (the usual "time is nearly up" notice) kills torchrun
# outright, orphaning its workers. Here torchrun ignores both signals and this script passes them on
# to the workers, whose trainer finishes the current step, saves a checkpoint and exits 0; torchrun
# then exits like after any finished run. A signal sent to the whole process group (a terminal, a
# scheduler) reaches the workers twice, which is harmless. SIGINT (Ctrl-C) keeps torchrun's meaning:
# stop now, without saving.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 PYTHON TORCHRUN_ARGS... train.py TRAIN_ARGS..." >&2
  exit 2
fi
py="$1"; shift
# torchrun's stderr goes through a filter that turns its ~40-line ChildFailedError report into one
# line naming the failing rank (the rank's own error is printed above it). A FIFO rather than a
# pipe keeps $! torchrun's pid (signals, exit code) and lets the script wait for the filter's last line.
fifo_dir="$(mktemp -d)"
mkfifo "$fifo_dir/stderr"
# When the rank that failed first is not one whose output is shown (--local-ranks-filter), the filter
# prints its last lines from the per-rank logs torchrun keeps under --log-dir (a private one unless given).
shown=""; log_dir=""; prev=""
for a in "$@"; do
  case "$a" in *.py) break;; esac
  case "$prev" in --local-ranks-filter|--local_ranks_filter) shown="$a";; --log-dir|--log_dir) log_dir="$a";; esac
  case "$a" in --local-ranks-filter=*|--local_ranks_filter=*) shown="${a#*=}";; --log-dir=*|--log_dir=*) log_dir="${a#*=}";; esac
  prev="$a"
done
own_logs=()
if [ -z "$log_dir" ]; then log_dir="$fifo_dir/logs"; own_logs=(--log-dir "$log_dir"); fi
filter_args=()
if [ -n "$shown" ]; then filter_args=(--log-dir "$log_dir" --shown "$shown"); fi
"$py" "$(dirname "${BASH_SOURCE[0]}")/_torchrun_filter.py" ${filter_args[@]+"${filter_args[@]}"} < "$fifo_dir/stderr" >&2 &
filter=$!
# The workers inherit the ignored signals through exec; train.py puts the defaults back.
( trap '' TERM USR1
  TORCHTITAN_LITE_RESTORE_SIGNALS=1 exec "$py" -m torch.distributed.run \
    --signals-to-handle SIGINT,SIGHUP,SIGQUIT ${own_logs[@]+"${own_logs[@]}"} "$@" 2> "$fifo_dir/stderr" ) &
launcher=$!
forward() { pkill "-$1" -P "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
# A trapped signal interrupts `wait`; keep waiting until torchrun itself has exited.
status=0
wait "$launcher" || status=$?
while kill -0 "$launcher" 2>/dev/null; do
  status=0
  wait "$launcher" || status=$?
done
wait "$filter" 2>/dev/null || true
rm -rf "$fifo_dir"
exit "$status"
