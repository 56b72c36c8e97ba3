#!/usr/bin/env bash
# Set up .venv from scratch: CPU torch first (a bare `torch` would pull a multi-GB CUDA build),
# then kvformat with its extras, then vLLM 0.33 without its CUDA dependency pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q torch==2.13.0 numpy
pip install -q -e '.[test,s3]'
pip install -q --no-deps vllm==0.33.0 xgrammar==0.2.8
pip install -q -r requirements/vllm-cpu.txt
# The integration tests import these; fail the setup here rather than let them skip.
python -c "import kvformat, torch, vllm.v1.kv_offload.tiering.spec, s3fs, moto; print('kvformat', kvformat.__version__, 'torch', torch.__version__)"
