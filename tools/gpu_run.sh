#!/usr/bin/env bash
# The one prepared GPU measurement of kvformat.staging (issue 37), for a session that is lent a GPU machine.
# Builds the C extension in place (optional: the pure-Python fallback runs without it), then runs
# tools/gpu_check.py at TP 1, 2 and 8 with contiguous and scattered block ids (DeepSeek-V3 chunks, 8 chunks,
# best of 3), each under its own timeout, and prints one JSON line with every cell's ratios last.
# Usage (from the repository root, whole run under ~8 min on one H200):
#   timeout 540 bash tools/gpu_run.sh            # PYTHON=/path/to/python to choose the interpreter
# Exit status: 0 when every cell ran with bytes equal, 1 otherwise (a cell that timed out or crashed counts).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CELL_TIMEOUT=${CELL_TIMEOUT:-150}
DEVICE=${DEVICE:-auto}  # DEVICE=cpu EXTRA="--layers 2 ..." dry-runs this script's logic on a CPU host
EXTRA=${EXTRA:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "$DEVICE" = cpu ] || "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, 'CUDA',
torch.version.cuda, torch.cuda.get_device_name(0))" 2>/dev/null || { echo "not run: no GPU available"; exit 0; }
"$PY" setup.py build_ext --inplace -q >/tmp/kvformat-build.log 2>&1 || echo "extension not built (fallback used): see /tmp/kvformat-build.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
status=0
lines=()
for tp in 1 2 8; do
  for ids in contiguous scattered; do
    echo "== TP=$tp ids=$ids"
    out=$(timeout "$CELL_TIMEOUT" "$PY" tools/gpu_check.py --device "$DEVICE" --tp "$tp" --ids "$ids" --chunks 8 --repeat 3 $EXTRA 2>&1)
    rc=$?
    echo "$out"
    last=$(printf '%s\n' "$out" | tail -n 1)
    if [ "$rc" -ne 0 ] || [ "${last:0:1}" != "{" ]; then
      status=1
      last="{\"tp\": $tp, \"ids\": \"$ids\", \"error\": \"exit $rc\"}"
    fi
    lines+=("$last")
  done
done
printf '%s\n' "${lines[@]}" | "$PY" -c "import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin]))"
exit $status
