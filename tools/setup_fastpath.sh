#!/usr/bin/env bash
# Benchmarks only (never CI): a venv in which vLLM's built-in fs tier runs its C fast path (vllm.fs_io_C), so
# tools/bench_tier.py --peer c compares kvformat with the peer as deployed. fs_io_C links libtorch_cuda and
# libnvrtc but calls no CUDA: a CUDA torch build imports without a GPU (../shared/reference/vllm-fastpath.md).
# ~6 GB; the torch and nvidia wheels come from the machine's local wheel store where it has them.
#   bash tools/setup_fastpath.sh && .venv-fastpath/bin/python tools/bench_tier.py --peer c ...
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVFORMAT_FASTPATH_VENV:-.venv-fastpath}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q torch==2.14.1 numpy
pip install -q --no-deps vllm==0.34.0 xgrammar==0.2.8
pip install -q -r requirements/vllm-cpu.txt
KVFORMAT_REQUIRE_NATIVE=1 pip install -q -e '.[test]'
python -c "import vllm.v1.kv_offload.tiering.fs.io as io, sys; print('vllm.fs_io_C loads:', io._HAS_FSIO_C); sys.exit(0 if io._HAS_FSIO_C else 1)"
