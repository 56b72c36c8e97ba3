#!/usr/bin/env bash
# Tear down what tools/dfs_up.sh made, also after a crash: lazy-unmount every client mount, stop the daemons
# (by the PIDs their lock files name, nothing by name), delete the namespace and the state directory.
set -uo pipefail
D=${KVF_DFS_DIR:-/tmp/kvf-dfs}
NS=${KVF_DFS_NS:-kvfdfs}
for m in "$D"/mnt*; do
  [ -d "$m" ] || continue
  mountpoint -q "$m" && { umount "$m" 2>/dev/null || umount -l "$m"; }
done
IN="nsenter --net=/var/run/netns/$NS"
if [ -e "/var/run/netns/$NS" ]; then
  [ -f "$D/cfg/mfschunkserver.cfg" ] && $IN mfschunkserver -c "$D/cfg/mfschunkserver.cfg" -s stop >/dev/null 2>&1
  [ -f "$D/cfg/mfsmaster.cfg" ] && $IN mfsmaster -c "$D/cfg/mfsmaster.cfg" -s stop >/dev/null 2>&1
  # Whatever still lives in the namespace (an mfsmount, a hung daemon) is ours: end it by PID.
  for p in $(ip netns pids "$NS" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  ip netns del "$NS"
fi
rm -rf "$D"
exit 0
