#!/usr/bin/env bash
# kvformat inside a running vLLM (issue 36; docs/vllm.md "Tried end to end"): engine A at TP=2 stores through
# KVFormatTier, engine B at TP=1 serves from it, with the engine and the model's weights as the oracles
# (tests/e2e/run_e2e.py). From a fresh clone: builds .venv-vllmcpu first if it is missing (tools/setup_e2e.sh,
# about 4 minutes, 3.5 GB). The last line printed is one JSON object; exit status 0 only if every check held.
# Environment: KVFORMAT_E2E_VENV (default .venv-vllmcpu), KVFORMAT_E2E_WORK (work directory; default a new temp
# dir, kept), KVFORMAT_E2E_MUTANT=store_nothing|load_zeros (a broken tier: the run must fail).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVFORMAT_E2E_VENV:-.venv-vllmcpu}
if ! "$VENV/bin/python" -c "import vllm, kvformat" >/dev/null 2>&1; then
  # pip's warnings about local index paths are noise here; its errors still fail the script
  bash tools/setup_e2e.sh 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
fi
# the engines' logs go to the work directory; only the result line reaches stdout
exec "$VENV/bin/python" tests/e2e/run_e2e.py
