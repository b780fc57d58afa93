#!/usr/bin/env bash
# The GPU check in one command, on the GPU machine, from the repository root (benchmarks/gpu_check/MAINTAINERS.md):
#
#   bash scripts/gpu_check.sh            # writes gpu_check.json, gpu_check.md, gpu_check.log and packages.txt to $OUT
#
# Installs the carried wheels (.device_wheels/, from scripts/device_wheels.sh) with --no-index --no-deps into a
# folder put first on PYTHONPATH, so the image's own torch, transformers, peft, … are used as they are, and runs the
# project from this source tree. Not a venv: the image's python3 is itself a venv (/opt/torch/.venv), and a venv made
# from it with --system-site-packages would see the base interpreter's packages, not that venv's torch.
# Extra arguments go to benchmarks/gpu_check.py (e.g. --only sd35_lora,replay).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
SITE=${SITE:-/tmp/gpu_check_site}
mkdir -p "$OUT"
ls .device_wheels/*.whl >/dev/null 2>&1 || { echo "no .device_wheels/*.whl: run scripts/device_wheels.sh here and carry .device_wheels" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device_wheels/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip list --format=freeze >"$OUT/packages.txt" 2>/dev/null
nvidia-smi >>"$OUT/gpu_check.log" 2>&1
python3 benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
