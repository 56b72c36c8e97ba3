#!/usr/bin/env bash
# The whole test suite (the README's test command). Extra arguments go to pytest, e.g. `-m vllm` for
# the vLLM-dependent tests only (tests/conftest.py marks them from their imports).
# KVFORMAT_VENV picks the venv (default .venv); vLLM must import there, else the run fails (no skips).
set -euo pipefail
cd "$(dirname "$0")/.."
. "${KVFORMAT_VENV:-.venv}/bin/activate"
export KVFORMAT_REQUIRE_VLLM=1
# With test paths among the arguments (tests/test_x.py, tests/test_x.py::name) only those run; else the whole suite.
for arg in "$@"; do
  case "$arg" in tests/*|./tests/*) exec python -m pytest -q -p no:cacheprovider "$@" ;; esac
done
exec python -m pytest -q -p no:cacheprovider tests "$@"
