#!/usr/bin/env bash
# The whole test suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider tests "$@"
