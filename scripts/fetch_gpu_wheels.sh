#!/usr/bin/env bash
# Downloads, into DIR, the wheels that a GPU machine with only Python 3.12 + a CUDA torch (2.11 or newer)
# + transformers / tokenizers / sentencepiece / tensorboard / safetensors lacks for scripts/gpu_check.sh,
# so that DIR can be carried to a machine without network and installed offline there:
#   scripts/fetch_gpu_wheels.sh gpu_wheels            # here, with the package registry reachable
#   scripts/fetch_gpu_wheels.sh gpu_wheels torchao datasets dill multiprocess   # only these (pinned as below)
#   TTL_PYTHON=python3 scripts/gpu_check.sh --wheels gpu_wheels   # there (pip install --no-index --no-deps)
# The wheels total ~94 MiB (pyarrow alone is 55 MiB), so they are split into DIR/part1, DIR/part2, ...
# of at most 60 MiB each, for transports that cap one transfer: carry and install part1 first
# (python3 -m pip install --no-index --no-deps DIR/part1/*.whl), then the rest with --wheels.
# The versions are the ones the suite runs with on CPU. Dependencies the GPU machine already has through
# torch or transformers (numpy, packaging, pyyaml, tqdm, filelock, fsspec, huggingface-hub) are not
# carried: --no-deps would otherwise replace them. gpu_check imports every needed module before stage a
# and names any that is still missing or broken. Names after DIR fetch only those packages: the H200 image
# run on 2026-11-27 (BENCHMARKS.md) had everything but torchao, datasets, dill and multiprocess (4.2 MiB).
# PYTHON_VERSION / PLATFORMS override the target (default 3.12 on x86_64 Linux).
set -euo pipefail
dir="${1:?usage: $0 DIR [PACKAGE ...]   (folder to download the wheels into; only these packages)}"
shift
python_version="${PYTHON_VERSION:-3.12}"
read -r -a platforms <<< "${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any}"
packages=(
  torchao==0.18.0
  datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  python-dateutil==4.0.0 six==1.17.0
  pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 pygments==2.21.0
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pyparsing==3.3.3
  pillow==13.0.0
)
if [ $# -gt 0 ]; then
  chosen=()
  for name in "$@"; do
    match=""
    for p in "${packages[@]}"; do [ "${p%%==*}" = "$name" ] && match="$p"; done
    if [ -z "$match" ]; then
      echo "error: $name is not one of the packages this script pins: ${packages[*]%%==*}" >&2
      exit 2
    fi
    chosen+=("$match")
  done
  packages=("${chosen[@]}")
fi
mkdir -p "$dir/download"
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platform_args[@]}" -d "$dir/download" "${packages[@]}"
# Largest first into the first part with room (first-fit decreasing), 60 MiB per part.
part=0
while read -r size path; do
  placed=""
  for ((i = 1; i <= part; i++)); do
    if [ $((used[i] + size)) -le $((60 * 1024 * 1024)) ]; then placed=$i; break; fi
  done
  if [ -z "$placed" ]; then part=$((part + 1)); placed=$part; used[part]=0; mkdir -p "$dir/part$part"; fi
  used[placed]=$((used[placed] + size))
  mv "$path" "$dir/part$placed/"
done < <(find "$dir/download" -name '*.whl' -printf '%s %p\n' | sort -rn)
rmdir "$dir/download"
for ((i = 1; i <= part; i++)); do
  echo "$dir/part$i: $(ls "$dir/part$i" | wc -l) wheels, $(du -sh "$dir/part$i" | cut -f1)"
  ls -1 "$dir/part$i" | sed 's/^/  /'
done
echo "total: $(du -ch "$dir"/part*/*.whl | tail -1 | cut -f1)"
