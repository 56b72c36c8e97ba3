#!/usr/bin/env bash
# One shared kvformat root on MooseFS with 3 clients: up, probe, engines with faults, history check, down.
# The last line printed is the checker's JSON object; the exit status is 0 only when the history is OK.
# Env: KVF_DFS_ROUNDS (default 40), KVF_DFS_FAULTS (default kill,cs,master,umount), KVFORMAT_VENV.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
PY=${KVFORMAT_VENV:-$REPO/.venv}/bin/python
D=${KVF_DFS_DIR:-/tmp/kvf-dfs}
OUT=${KVF_DFS_OUT:-$(mktemp -d /tmp/kvf-dfs-out.XXXXXX)}
trap 'bash "$HERE/dfs_down.sh" >/dev/null 2>&1' EXIT
mapfile -t MOUNTS < <(bash "$HERE/dfs_up.sh" 3 2>"$OUT/up.log") || { tail "$OUT/up.log" >&2; exit 2; }
[ "${#MOUNTS[@]}" = 3 ] || { tail "$OUT/up.log" >&2; exit 2; }
mkdir -p "${MOUNTS[0]}/probe"
python3 "$HERE/fs_probe.py" "${MOUNTS[0]}/probe" "${MOUNTS[1]}/probe" >&2
PYTHONPATH=$REPO "$PY" "$HERE/dfs_run.py" --mounts "${MOUNTS[@]}" --dfs-dir "$D" --history "$OUT/history.jsonl" \
  --rounds "${KVF_DFS_ROUNDS:-40}" --faults "${KVF_DFS_FAULTS:-kill,cs,master,umount}" >&2 || exit 3
echo "history: $OUT/history.jsonl" >&2
python3 "$HERE/dfs_history.py" "$OUT/history.jsonl" --fs moosefs --clients 3
