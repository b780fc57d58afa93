#!/usr/bin/env bash
# Prove on this CPU machine that the carried wheels (.device_wheels/, scripts/device_wheels.sh) are all the GPU check
# needs beyond the GPU machine's image: install them exactly as scripts/gpu_check.sh does there (pip --no-index
# --no-deps --target, first on PYTHONPATH), then run the check's dry run in an interpreter that may import only the
# image's packages (scripts/device_image/packages.txt), the standard library, the source tree and the carried folder
# (scripts/device_image/sitecustomize.py). Every top-level import of a package outside the image is listed.
#
#   bash scripts/prove_device_wheels.sh [OUT]      # OUT (default /tmp/device_wheels_proof): the dry run's record
#
# What it cannot prove here: the image's own versions (torch 2.11 there, 2.13 here: benchmarks/gpu_check/MAINTAINERS.md
# says how the torch range was checked) and CPython 3.12 (the wheels are pure Python, the same files for 3.11 and 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/device_wheels_proof}
SITE=$(mktemp -d /tmp/device_site.XXXXXX)
rm -rf "$OUT" && mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device_wheels/*.whl
export DEVICE_CARRIED_SITE="$SITE" DEVICE_IMPORT_LOG="$OUT/imports.log" PYTHONPATH="$PWD/scripts/device_image:$SITE:$PWD"
python3 -c "import diffusers, tensordict, pyvers; assert all(m.__file__.startswith('$SITE') for m in (diffusers, tensordict, pyvers)); print('carried:', diffusers.__version__, tensordict.__version__)"
python3 benchmarks/gpu_check.py --dry-run --out "$OUT"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
parts = json.load(open(f"{out}/gpu_check.json"))["parts"]
bad = {k: v.get("error") or v.get("reason") for k, v in parts.items() if v["status"] != "ok"}
lines = sorted(set(open(f"{out}/imports.log").read().split("\n")) - {""})
print("\n".join(lines))
if bad:
    sys.exit(f"not proven: parts {bad}")
print("proven: every part of the dry run ran with the image's packages and the carried wheels only ('absent': "
      "optional packages a library probed for, absent on the device too)")
PY
rm -rf "$SITE"
