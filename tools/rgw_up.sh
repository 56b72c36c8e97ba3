#!/usr/bin/env bash
# Bring up a one-host Ceph cluster with an S3 gateway on loopback: one monitor, one manager, one OSD on memstore,
# one radosgw, an S3 user with fresh keys and a bucket. Usage: bash tools/rgw_up.sh
# Idempotent: a cluster already up (its gateway answers with the recorded keys) is left as it is; anything else
# under $KVF_RGW_DIR (a crashed run's remains) is torn down first. Prints the env file's path; the file
# ($KVF_RGW_DIR/env, sh syntax) holds the endpoint, keys, bucket and how to restart the gateway; tests read it
# through KVFORMAT_RGW_ENV.
# Exit codes: 0 up; 2 cannot run here (not root, packages missing and not installable); 3 a daemon did not come up.
# Why memstore: no block device or file system is formatted, the OSD starts in seconds, and the cluster's whole
# state goes with the process (the gateway can restart, the OSD is never restarted). Why auth none: the cluster
# lives on 127.0.0.1 for one test run; S3 requests are still signed and checked against the user's keys (the
# gateway's authentication is separate from cephx).
set -euo pipefail
D=${KVF_RGW_DIR:-/tmp/kvf-rgw}
PORT=${KVF_RGW_PORT:-17480}
MONPORT=${KVF_RGW_MON_PORT:-16789}
BUCKET=${KVF_RGW_BUCKET:-kvf}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${KVFORMAT_VENV:-$(dirname "$HERE")/.venv}/bin/python
t0=$SECONDS
say() { echo "rgw_up: $* ($((SECONDS - t0)) s)" >&2; }
[ -x "$PY" ] || { echo "rgw_up: no venv python at $PY (tools/setup.sh)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "rgw_up: needs root (apt, daemons)" >&2; exit 2; }
# One S3 round trip with boto3 (the venv's): create the bucket if asked, put, get and delete a small object.
ping() { "$PY" - "$@" <<'PYEOF'
import sys, boto3
from botocore.config import Config
ep, bucket = sys.argv[1], sys.argv[2]
c = boto3.client("s3", endpoint_url=ep, region_name="us-east-1",
                 config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
if "--create" in sys.argv:
    try:
        c.create_bucket(Bucket=bucket)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
c.put_object(Bucket=bucket, Key=".rgw-ping", Body=b"ok")
assert c.get_object(Bucket=bucket, Key=".rgw-ping")["Body"].read() == b"ok"
c.delete_object(Bucket=bucket, Key=".rgw-ping")
PYEOF
}
need() { command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v ceph-mgr >/dev/null \
  && command -v radosgw >/dev/null && command -v radosgw-admin >/dev/null && command -v monmaptool >/dev/null; }
if ! need; then
  pk="radosgw ceph-mon ceph-osd ceph-mgr"
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y $pk >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y $pk >&2; } \
    || { echo "rgw_up: cannot install $pk" >&2; exit 2; }
  need || { echo "rgw_up: Ceph binaries still missing after apt" >&2; exit 2; }
fi
if [ -f "$D/env" ]; then
  # shellcheck disable=SC1091
  . "$D/env"
  if AWS_ACCESS_KEY_ID=$KVF_RGW_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$KVF_RGW_SECRET_KEY \
     ping "$KVF_RGW_ENDPOINT" "$KVF_RGW_BUCKET" 2>/dev/null; then
    say "already up"
    echo "$D/env"
    exit 0
  fi
fi
bash "$HERE/rgw_down.sh" >/dev/null 2>&1 || true
# The ports must be free: a monitor of another cluster still listening on MONPORT (another checkout's run, a
# crashed run whose state directory is gone) answers our `ceph` calls, gets our OSD created in its map, and the
# OSD then fails to boot with "wrong fsid".
held=$("$PY" - "$MONPORT" "$PORT" <<'PYEOF'
import socket, sys
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemons bind: TIME_WAIT of a last run is no holder
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        print(port)
    finally:
        s.close()
PYEOF
)
if [ -n "$held" ]; then
  for p in $held; do
    echo "rgw_up: port $p on 127.0.0.1 is in use by another process (another Ceph cluster?):" \
      "$(ss -ltnpH "sport = :$p" 2>/dev/null | head -1)" >&2
  done
  echo "rgw_up: set KVF_RGW_MON_PORT / KVF_RGW_PORT, or stop it (tools/rgw_down.sh with its KVF_RGW_DIR)" >&2
  exit 3
fi
mkdir -p "$D"/{mon,osd,mgr,rgw,run,log}
: > "$D/pids"
FSID=$(cat /proc/sys/kernel/random/uuid)
cat > "$D/ceph.conf" <<X
[global]
fsid = $FSID
mon_host = v1:127.0.0.1:$MONPORT
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr2 = false
ms_bind_ipv6 = false
ms_bind_ipv4 = true
ms_bind_port_min = 16800
ms_bind_port_max = 16999
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = $D/run
admin_socket = $D/run/\$name.asok
log_file = $D/log/\$name.log
pid_file = $D/run/\$name.pid
keyring = $D/keyring
mon_data = $D/mon/\$name
osd_data = $D/osd/\$name
mgr_data = $D/mgr/\$name
crash_dir = $D/crash
exporter_sock_dir = $D/run
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 1000
mgr_initial_modules = iostat
osd_objectstore = memstore
memstore_device_bytes = 2147483648
osd_memory_target = 939524096
osd_op_num_shards = 1
osd_op_num_threads_per_shard = 2
mon_data_avail_warn = 2
mon_warn_on_insecure_global_id_reclaim_allowed = false
debug_ms = 0/0
[client.rgw.kvf]
rgw_frontends = beast endpoint=127.0.0.1:$PORT
rgw_thread_pool_size = 64
rgw_enable_usage_log = false
rgw_dns_name = 127.0.0.1
rgw_lc_debug_interval = 10
rgw_lifecycle_work_time = 00:00-24:00
rgw_gc_obj_min_wait = 5
rgw_gc_processor_period = 10
rgw_data_log_num_shards = 4
rgw_md_log_max_shards = 4
rgw_override_bucket_index_max_shards = 1
X
CEPH="ceph -c $D/ceph.conf --connect-timeout 20"
# Each daemon in the foreground (-f) of its own session, its PID recorded: rgw_down.sh ends exactly these.
daemon() { local name=$1; shift; setsid "$@" -f -c "$D/ceph.conf" >>"$D/log/$name.out" 2>&1 < /dev/null &
  echo "$! $name" >> "$D/pids"; }
ceph-authtool --create-keyring "$D/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
monmaptool --create --fsid "$FSID" --addv a "[v1:127.0.0.1:$MONPORT]" "$D/monmap" >/dev/null
ceph-mon -c "$D/ceph.conf" --mkfs -i a --monmap "$D/monmap" --keyring "$D/mon.keyring" >&2
daemon mon ceph-mon -i a
ok=0
for _ in $(seq 1 60); do $CEPH mon stat >/dev/null 2>&1 && { ok=1; break; }; sleep 0.5; done
[ $ok = 1 ] || { echo "rgw_up: the monitor did not answer" >&2; tail -5 "$D/log/mon.a.log" >&2 || true; exit 3; }
got=$($CEPH fsid 2>/dev/null || true)
[ "$got" = "$FSID" ] || { echo "rgw_up: the monitor on port $MONPORT is not this cluster's (fsid '$got', ours $FSID)" >&2
  exit 3; }
say "mon up"
daemon mgr ceph-mgr -i x
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
ID=$($CEPH osd new "$OSD_UUID")
mkdir -p "$D/osd/osd.$ID"
ceph-osd -c "$D/ceph.conf" -i "$ID" --mkfs --osd-uuid "$OSD_UUID" >>"$D/log/osd-mkfs.out" 2>&1 \
  || { echo "rgw_up: OSD mkfs failed" >&2; tail -5 "$D/log/osd-mkfs.out" >&2; exit 3; }
# Up to 3 starts: the OSD's first command to the monitor can go out before its monitor client has the monmap
# (the monitor logs "handle_command on fsid 00000000-… != <ours>"); the OSD then logs "mon_cmd_maybe_osd_create
# fail: 'wrong fsid'" and exits. Seen in 1 of 9 start-ups here (and in one CI run); a restart of the same OSD,
# whose memstore was saved at mkfs, boots.
ok=0
for start in 1 2 3; do
  daemon osd ceph-osd -i "$ID"
  osd_pid=$(tail -1 "$D/pids" | cut -d' ' -f1)
  # KVF_RGW_KILL_FIRST_OSD=1: the first start dies at once, so the restart below is exercised on demand.
  [ "$start" = 1 ] && [ "${KVF_RGW_KILL_FIRST_OSD:-0}" = 1 ] && kill -9 "$osd_pid" 2>/dev/null && sleep 0.5
  for _ in $(seq 1 60); do
    [ "$($CEPH osd stat -f json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])' \
      2>/dev/null)" = 1 ] && { ok=1; break; }
    kill -0 "$osd_pid" 2>/dev/null || break
    sleep 0.5
  done
  [ $ok = 1 ] && break
  kill -0 "$osd_pid" 2>/dev/null && break  # alive but not up in 30 s: not the start-up race
  say "the OSD exited at start (start $start): $(grep -m1 -o "mon_cmd_maybe_osd_create fail: [^:]*" \
    "$D/log/osd.$ID.log" || echo "see $D/log/osd.$ID.log"); starting it again"
done
[ $ok = 1 ] || { echo "rgw_up: the OSD did not come up" >&2; tail -5 "$D/log/osd.$ID.log" >&2 || true; exit 3; }
say "osd up"
# The gateway is started by a script of its own so that tests can restart it (the "gateway restarted" fault)
# exactly as it was started here; its PID is kept in $D/rgw.pid.
cat > "$D/rgw_start.sh" <<X
#!/usr/bin/env bash
setsid radosgw -f -c $D/ceph.conf -n client.rgw.kvf >>$D/log/rgw.out 2>&1 < /dev/null &
echo \$! > $D/rgw.pid
X
bash "$D/rgw_start.sh"
AK="KVFRGW$("$PY" -c 'import secrets; print(secrets.token_hex(7).upper())')"
SK="kvf-rgw-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')"  # distinctive, so a leak is findable in logs
ok=0
for _ in $(seq 1 120); do
  # The user is created once the gateway has made its pools (radosgw-admin would otherwise make them itself).
  if curl -s -o /dev/null "http://127.0.0.1:$PORT/"; then ok=1; break; fi
  kill -0 "$(cat "$D/rgw.pid")" 2>/dev/null || break
  sleep 0.5
done
[ $ok = 1 ] || { echo "rgw_up: the gateway did not answer" >&2; tail -5 "$D/log/client.rgw.kvf.log" >&2 || true; exit 3; }
say "gateway answers"
radosgw-admin -c "$D/ceph.conf" -n client.admin user create --uid kvf --display-name "kvformat tests" \
  --access-key "$AK" --secret-key "$SK" >/dev/null \
  || { echo "rgw_up: user create failed" >&2; exit 3; }
cat > "$D/env" <<X
KVF_RGW_ENDPOINT=http://127.0.0.1:$PORT
KVF_RGW_ACCESS_KEY=$AK
KVF_RGW_SECRET_KEY=$SK
KVF_RGW_BUCKET=$BUCKET
KVF_RGW_DIR=$D
KVF_RGW_CONF=$D/ceph.conf
KVF_RGW_START=$D/rgw_start.sh
KVF_RGW_PIDFILE=$D/rgw.pid
X
chmod 600 "$D/env"
ok=0
for _ in $(seq 1 60); do
  if AWS_ACCESS_KEY_ID=$AK AWS_SECRET_ACCESS_KEY=$SK ping "http://127.0.0.1:$PORT" "$BUCKET" \
      --create 2>>"$D/log/ping.err"; then ok=1; break; fi
  sleep 0.5
done
[ $ok = 1 ] || { echo "rgw_up: the bucket round trip failed" >&2; tail -3 "$D/log/ping.err" >&2; exit 3; }
say "up: S3 at http://127.0.0.1:$PORT, bucket $BUCKET"
echo "$D/env"
