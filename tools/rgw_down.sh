#!/usr/bin/env bash
# Tear down what tools/rgw_up.sh made, also after a crash: end the daemons by the PIDs rgw_up.sh recorded (the
# gateway's current PID from rgw.pid, as a restart by a test changes it; nothing is ended by name), then remove
# the state directory whole. The memstore OSD keeps its objects in its own memory, so nothing else is left.
set -uo pipefail
D=${KVF_RGW_DIR:-/tmp/kvf-rgw}
# Only a PID whose command line names this cluster's config is ours: a PID recorded by a run long gone may have
# been reused by an unrelated process since.
ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -qF -- "$D/ceph.conf"; }
pids=()
[ -f "$D/rgw.pid" ] && pids+=("$(cat "$D/rgw.pid")")
[ -f "$D/pids" ] && while read -r p _; do pids+=("$p"); done < "$D/pids"
live=()
for p in "${pids[@]}"; do
  [ -n "$p" ] && ours "$p" && { kill -CONT "$p" 2>/dev/null; kill -TERM "$p" 2>/dev/null; live+=("$p"); }
done
for _ in $(seq 1 50); do
  left=0
  for p in "${live[@]}"; do ours "$p" && left=1; done
  [ $left = 0 ] && break
  sleep 0.1
done
for p in "${live[@]}"; do ours "$p" && kill -KILL "$p" 2>/dev/null; done
rm -rf "$D"
exit 0
