#!/usr/bin/env bash
# Install diffusion-rl into the current Python environment.
#
#   bash scripts/install.sh          # the library and CLI
#   bash scripts/install.sh dev      # + test and lint tools (pytest, ruff, wandb) and Ray
#   bash scripts/install.sh ray      # + Ray, for engine.kind=ray (several GPUs or nodes)
#
# torch comes first and on its own: a plain `pip install torch` on a CPU-only Linux machine pulls gigabytes of
# CUDA packages. If torch is already installed (e.g. your CUDA build on a GPU machine) it is kept as it is;
# otherwise TORCH_SPEC (default torch==2.13.0) is installed, from TORCH_INDEX_URL when set (for a CPU wheel
# elsewhere: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu). Everything else is then installed with
# torch pinned to the installed version, so nothing can replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-}

# The installed torch's version from its package metadata, not `import torch`: importing torch before numpy is
# installed prints "Failed to initialize NumPy" on a fresh machine.
torch_version() {
  "$PYTHON" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null
}
if ! torch_version >/dev/null; then
  echo "installing ${TORCH_SPEC:-torch==2.13.0}"
  "$PYTHON" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
fi
TORCH_VERSION=$(torch_version) || { echo "torch is still not installed; see the pip output above" >&2; exit 1; }
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"
"$PYTHON" -m pip install -q -c "$CONSTRAINTS" -e ".${EXTRAS:+[$EXTRAS]}"
echo "diffusion-rl installed (torch ${TORCH_VERSION})"
