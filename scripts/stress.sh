#!/usr/bin/env bash
# Run a command while busy loops keep every CPU loaded: twice as many loops as CPUs, at least 4 (load >= 4 on a
# 2-CPU host), at the command's own priority. The loops are ended (by their pids) however the command ends; its
# exit status is ours. Used by `make stress`: the suite must not depend on an idle machine.
set -u
cpus=$(nproc)
n=$(( cpus * 2 > 4 ? cpus * 2 : 4 ))
n=${STRESS_LOOPS:-$n}
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait "${pids[@]}" 2>/dev/null; }
trap stop EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$n"); do
    ( trap - INT TERM; while :; do :; done ) &
    pids+=($!)
done
echo "stress: $n busy loops on $cpus CPUs (pids ${pids[*]})" >&2
start=$(date +%s)
"$@"
rc=$?
echo "stress: exit $rc after $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit $rc
