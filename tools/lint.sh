#!/usr/bin/env bash
# Static checks: ruff (kvformat, tests, tools: ruff.toml) and mypy --strict on the package (mypy.ini).
# Usage: bash tools/lint.sh   (exit 0 = clean). The lead wires this into .ci/run.
# Needs ruff and mypy in .venv (requirements/lint.txt); takes ~20 s on 2 cores (mypy ~17 s, ruff <1 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check kvformat tools/bench_index.py tools/mutate.py \
    tests/conftest.py tests/test_index.py tests/test_shutdown.py tests/test_store_results.py \
    tests/test_skip_guard.py tests/test_mutants.py tests/test_vectors.py tests/test_sglang.py tests/sglang_harness.py
"$PY" -m mypy --config-file mypy.ini
