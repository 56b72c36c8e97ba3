#!/usr/bin/env bash
# Bring up MooseFS (master + one chunkserver + N client FUSE mounts) inside a private network namespace.
# Usage: bash tools/dfs_up.sh [N]   (N client mounts, default 3). Idempotent: a previous run (or its crash
# remains) is torn down first. Prints the mount points, one a line. State lives in $KVF_DFS_DIR.
# Why a namespace: the chunkserver refuses a loopback master address, so master and chunkserver talk over a
# dummy interface address that exists only inside the namespace; no traffic ever leaves it. Why nsenter --net and
# not `ip netns exec`: the latter also makes a private mount namespace, which would hide the FUSE mounts.
# KVF_DFS_NICE: the daemons' and mounts' nice level (unset: MooseFS's own, -19). At -19 their busy threads can starve
# the kernel's nice-0 workers on a 2-core machine that also runs vLLM's spinning CPU workers (the kernel logged
# 'workqueue lockup ... stuck for 61s' and FUSE waits over 120 s in tools/fleet.sh --moosefs, then EIO).
set -euo pipefail
N=${1:-3}
D=${KVF_DFS_DIR:-/tmp/kvf-dfs}
NS=${KVF_DFS_NS:-kvfdfs}
ADDR=10.213.77.1
NICE=${KVF_DFS_NICE:-}
HERE=$(cd "$(dirname "$0")" && pwd)
[ -c /dev/fuse ] || { echo "dfs_up: /dev/fuse missing: FUSE cannot run here" >&2; exit 2; }
if ! command -v mfsmaster >/dev/null || ! command -v mfsmount >/dev/null || ! command -v mfschunkserver >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y moosefs-master moosefs-chunkserver moosefs-client >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y moosefs-master moosefs-chunkserver moosefs-client >&2; }
fi
bash "$HERE/dfs_down.sh" >/dev/null 2>&1 || true
mkdir -p "$D"/{master,cs,hdd,cfg}
ip netns add "$NS"
IN="nsenter --net=/var/run/netns/$NS"
$IN ip link set lo up
# Both ends of the veth pair stay inside the namespace; the address exists nowhere else.
$IN ip link add kvfa type veth peer name kvfb
$IN ip addr add $ADDR/24 dev kvfa
$IN ip link set kvfb up
$IN ip link set kvfa up
cp /var/lib/mfs/metadata.mfs.empty "$D/master/metadata.mfs"
cat > "$D/cfg/mfsexports.cfg" <<X
* / rw,alldirs,maproot=0
X
cat > "$D/cfg/mfsmaster.cfg" <<X
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $D/master
EXPORTS_FILENAME = $D/cfg/mfsexports.cfg
MATOML_LISTEN_HOST = $ADDR
MATOCS_LISTEN_HOST = $ADDR
MATOCL_LISTEN_HOST = $ADDR
${NICE:+NICE_LEVEL = $NICE}
X
echo "$D/hdd" > "$D/cfg/mfshdd.cfg"
cat > "$D/cfg/mfschunkserver.cfg" <<X
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $D/cs
HDD_CONF_FILENAME = $D/cfg/mfshdd.cfg
MASTER_HOST = $ADDR
CSSERV_LISTEN_HOST = $ADDR
HDD_LEAVE_SPACE_DEFAULT = 256MiB
${NICE:+NICE_LEVEL = $NICE}
X
$IN mfsmaster -c "$D/cfg/mfsmaster.cfg" start >&2
$IN mfschunkserver -c "$D/cfg/mfschunkserver.cfg" start >&2
for i in $(seq 0 $((N - 1))); do
  m="$D/mnt$i"; mkdir -p "$m"
  ok=0
  for _ in $(seq 1 40); do
    if $IN mfsmount "$m" -H $ADDR -o mfsmaster=$ADDR ${NICE:+-o mfsnice=$NICE} >&2 2>&1; then ok=1; break; fi
    sleep 0.5
  done
  [ $ok = 1 ] || { echo "dfs_up: mfsmount $m failed" >&2; exit 3; }
done
# Writes need the chunkserver registered with the master: wait until a small file round-trips.
for _ in $(seq 1 60); do
  if echo ok > "$D/mnt0/.probe" 2>/dev/null && [ "$(cat "$D/mnt1/.probe" 2>/dev/null || cat "$D/mnt0/.probe")" = ok ]; then
    rm -f "$D/mnt0/.probe"; break
  fi
  sleep 0.5
done
for i in $(seq 0 $((N - 1))); do echo "$D/mnt$i"; done
