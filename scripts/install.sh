#!/usr/bin/env bash
# Installs the project and its dependencies on a fresh machine.
# Picks torch's CPU build where there is no NVIDIA GPU, so pip never pulls a multi-GB CUDA build.
#   bash scripts/install.sh          # runtime
#   bash scripts/install.sh test     # runtime + test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if ! python3 -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python3 -m pip install -q "torch==${TORCH_VERSION}"
  else
    # On machines with a local CPU wheel (find-links) this takes it; elsewhere PyTorch's CPU index.
    python3 -m pip install -q "torch==${TORCH_VERSION}" 2>/dev/null \
      || python3 -m pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if [ "$extra" = "test" ]; then
  python3 -m pip install -q -e ".[test]"
  # Without a GPU the Triton kernels (actors/kernels/decode_attention.py, ...) are tested in Triton's
  # interpreter, which needs triton >= 3.8 with numpy 2.x. With a GPU, torch's own pinned triton
  # compiles them and is left alone.
  if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
    python3 -m pip install -q "triton>=3.8"
  fi
else
  python3 -m pip install -q -e .
fi
