#!/usr/bin/env bash
# Download, on this machine, the wheels the GPU check (benchmarks/gpu_check.py) needs on the GPU machine and its image
# lacks, into .device_wheels/ (git-ignored): a `run` carries that folder (carry: [".device_wheels"]) and
# scripts/gpu_check.sh installs it there with --no-index --no-deps.
#
#   bash scripts/device_wheels.sh
#
# The image (python3 3.12, torch 2.11 + CUDA 13, transformers 5.x, peft, accelerate, safetensors, numpy, pillow,
# pyyaml, matplotlib, pyarrow, tensorboard, cloudpickle, huggingface-hub, …: scripts/device_image/packages.txt) lacks
# diffusers, tensordict and tensordict's pyvers; nothing else the check imports is missing there
# (scripts/prove_device_wheels.sh proves it on this machine). Versions are pinned to the ones this project is tested
# with. All three are pure-Python wheels (py3-none-any): the same files serve CPython 3.11 here and 3.12 there, which
# the script checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.device_wheels
WHEELS=(diffusers==0.42.1 tensordict==0.15.3 pyvers==0.2.3)
LIMIT_MIB=16 # of the 64 MiB a run may carry (the working tree counts too): keep the wheels well under it

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
for wheel in "$DEST"/*.whl; do
  case "$wheel" in
    *-py3-none-any.whl) ;;
    *) echo "$wheel is not pure Python: the CPU proof (CPython 3.11) would not cover the device's 3.12" >&2; exit 1 ;;
  esac
done
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
  exit 1
fi
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$DEST: $count wheels, $((bytes / 1024)) KiB"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "the wheels take more than $LIMIT_MIB MiB" >&2
  exit 1
fi
