#!/usr/bin/env bash
# The S3 roots on Ceph's RADOS gateway: up (tools/rgw_up.sh), the S3 test modules against it, two engines on one
# bounded s3:// root with faults (tools/rgw_run.py) and the MooseFS run's history checker, down.
# The last line printed is one JSON object: gateway, engines, rounds, faults, wrong bytes, lost durable stores,
# bound held, history ok, and the tests' outcome.
# Exit: 0 all held; 1 a violation (a test failed, or the history checker found one); 2 Ceph cannot start here;
# 3 the harness itself failed (an engine did not start, no history).
# Env: KVF_RGW_ROUNDS (default 40), KVF_RGW_FAULTS (default gw,pause,kill), KVFORMAT_VENV, KVF_RGW_SRC (a
# directory whose kvformat/ the tests and engines import instead of this checkout's: a candidate fix).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
PY=${KVFORMAT_VENV:-$REPO/.venv}/bin/python
SRC=${KVF_RGW_SRC:-$REPO}
D=${KVF_RGW_DIR:-/tmp/kvf-rgw}
OUT=${KVF_RGW_OUT:-$(mktemp -d /tmp/kvf-rgw-out.XXXXXX)}
trap 'bash "$HERE/rgw_down.sh" >/dev/null 2>&1' EXIT
t0=$SECONDS
ENV=$(KVFORMAT_VENV=${KVFORMAT_VENV:-$REPO/.venv} bash "$HERE/rgw_up.sh" 2>"$OUT/up.log")
up=$?
if [ $up != 0 ]; then
  # The daemons' own logs go with the state directory (rgw_down.sh at exit): keep them for the diagnosis.
  cp -r "$D/log" "$OUT/ceph-log" 2>/dev/null || true
  tail "$OUT/up.log" >&2; echo "rgw_check: the daemons' logs: $OUT/ceph-log" >&2
  [ $up = 2 ] && exit 2; exit 3
fi
t_up=$((SECONDS - t0))
# The S3 modules as they run in the main suite on moto, here on the gateway (tests/s3_server.py switches on
# KVFORMAT_RGW_ENV), plus the faults only a real gateway produces (tests/test_rgw_faults.py).
T=$REPO/tests
(cd "$SRC" && KVFORMAT_RGW_ENV=$ENV "$PY" -m pytest -q -p no:cacheprovider \
  "$T/test_storage_conformance.py::TestS3Store" "$T/test_s3_store.py" "$T/test_s3_cli.py" "$T/test_s3_vllm.py" \
  "$T/test_operators_s3.py" "$T/test_shared_root_s3.py" "$T/test_rgw_faults.py" \
  "$T/test_store_read_path.py" -k "not test_store_read_path or s3 or close_releases or timed_out_put") \
  > "$OUT/pytest.log" 2>&1
tests_rc=$?
tests=$(tail -1 "$OUT/pytest.log" | sed 's/^=* *//; s/ *=*$//')
echo "rgw_check: tests on RGW: $tests (rc=$tests_rc; $OUT/pytest.log)" >&2
[ $tests_rc = 0 ] || grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" >&2
t_tests=$((SECONDS - t0 - t_up))
(cd "$SRC" && "$PY" "$HERE/rgw_run.py" --env "$ENV" --repo "$SRC" --history "$OUT/history.jsonl" \
  --rounds "${KVF_RGW_ROUNDS:-40}" --faults "${KVF_RGW_FAULTS:-gw,pause,kill}") >&2
run_rc=$?
echo "history: $OUT/history.jsonl" >&2
[ -s "$OUT/history.jsonl" ] || exit 3
python3 "$HERE/dfs_history.py" "$OUT/history.jsonl" --fs rgw --clients 2 > "$OUT/check.json"
hist_rc=$?
t_run=$((SECONDS - t0 - t_up - t_tests))
gw=$(radosgw --version 2>/dev/null | awk '{print "radosgw " $3}')
python3 - "$OUT/check.json" "$gw" "$tests" "$tests_rc" "$t_up" "$t_tests" "$t_run" "$run_rc" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
gw, tests, tests_rc, t_up, t_tests, t_run, run_rc = sys.argv[2:]
bound_held = c["bound_max_over_bytes"] == 0
out = {"gateway": gw, "engines": c["clients"], "rounds": c["rounds"], "faults": c["faults"],
       "wrong_bytes": c["wrong_bytes"], "lost_durable": c["lost_durable"], "bound_held": bound_held,
       "bound_max_over_bytes": c["bound_max_over_bytes"], "bound_bytes": c["bound_bytes"],
       "lease_takeover_max_s": c["lease_takeover_max_s"], "wedged": c["wedged"], "final_misses": c["final_misses"],
       "history_ok": c["history_ok"], "tests": tests, "tests_ok": tests_rc == "0", "runner_rc": int(run_rc),
       "seconds": {"up": int(t_up), "tests": int(t_tests), "engines": int(t_run)}}
print(json.dumps(out))
PYEOF
[ $run_rc = 0 ] || exit 3
[ $hist_rc = 0 ] && [ $tests_rc = 0 ] || exit 1
exit 0
