#!/usr/bin/env bash
# Trains the GPT example at world N inside a memory cgroup with a hard limit, so that the
# kernel kills the job when its ranks together exceed it (docs/design.md, "Sharded
# construction"). Prints the limit, the model's full fp32 size, the job's peak (the
# cgroup's high-water mark) and each rank's peak RSS (fsdp-run --peak-rss-json), and
# exits with the job's status (137 when the OOM killer ended it).
#
#   construction.sh [--expect-oom] [--deadline-s N] BIN_DIR LIMIT_MIB sharded|eager WORLD [train_gpt flags...]
#
# --expect-oom: succeed only if the job does not fit under the limit (the eager run that
# the limit must stop), fail if it finished or failed otherwise. It does not fit when
#   - the kernel's OOM killer ended it inside the cgroup, or
#   - it ran past --deadline-s having hit the limit (the cgroup's failcnt, or v2's
#     memory.events max, above 0): under a limit the kernel reclaims the pages of the
#     libraries' code before it kills anyone, so a job that does not fit may thrash, each
#     instruction fetch a disk read, for longer than any test should wait.
# --deadline-s N: the job is killed after N seconds (exit 124 when it is; without
#   --expect-oom that is a failure: the run had to train). Default: none.
#
# No allocator variable is set: where the shards live in host memory the library fixes
# glibc's mmap threshold itself (Note [Host heap] in src/engine/host_heap.cpp), which these
# runs used to get from MALLOC_MMAP_THRESHOLD_=65536.
#
# Needs root and a memory controller: cgroup v1 (memory.limit_in_bytes) or v2
# (memory.max). Without them it exits 77, which ctest reports as skipped. The cgroup is
# removed on every exit.
set -uo pipefail
EXPECT_OOM=0 DEADLINE_S=0
while [ $# -gt 0 ]; do
  case "$1" in
    --expect-oom) EXPECT_OOM=1; shift ;;
    --deadline-s)
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "construction.sh: --deadline-s '${2:-}' must be a whole number of seconds > 0" >&2; exit 2; }
      DEADLINE_S="$2"; shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 4 ] || { echo "usage: $0 [--expect-oom] [--deadline-s N] BIN_DIR LIMIT_MIB sharded|eager WORLD [train_gpt flags...]" >&2; exit 2; }
BIN="$1" LIMIT_MIB="$2" MODE="$3" WORLD="$4"
shift 4

skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to make a memory cgroup (CI runs as root)"

CG=""
if [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
  CG="/sys/fs/cgroup/memory/fsdp-construction-$$"
  LIMIT_FILE=memory.limit_in_bytes PEAK_FILE=memory.max_usage_in_bytes FAIL_FILE=memory.failcnt
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  CG="/sys/fs/cgroup/fsdp-construction-$$"
  LIMIT_FILE=memory.max PEAK_FILE=memory.peak FAIL_FILE=memory.events
else
  skip "no memory cgroup controller mounted (cgroup v1 memory or v2 memory.max)"
fi
mkdir "$CG" || skip "cannot make $CG"
cleanup() {
  if [ -d "$CG" ]; then
    while read -r p; do kill -9 "$p" 2>/dev/null; done <"$CG/cgroup.procs" 2>/dev/null
    sleep 0.2
    rmdir "$CG" 2>/dev/null || true
  fi
}
trap cleanup EXIT

echo $((LIMIT_MIB * 1024 * 1024)) >"$CG/$LIMIT_FILE"
# No swap to escape into under v1 when memsw accounting exists.
[ -f "$CG/memory.memsw.limit_in_bytes" ] && echo $((LIMIT_MIB * 1024 * 1024)) >"$CG/memory.memsw.limit_in_bytes" 2>/dev/null
[ -f "$CG/memory.swap.max" ] && echo 0 >"$CG/memory.swap.max"

OUT="$(mktemp)"
# The job joins the cgroup before it starts, so every rank and the launcher are counted.
# No allocator variable: the library keeps its memory bound with glibc's defaults
# (Note [Host allocator] in src/engine/host_memory.cpp).
bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$CG" \
  "$BIN/fsdp-run" --nproc "$WORLD" --peak-rss-json "$OUT.rss" -- "$BIN/train_gpt" \
  --construction "$MODE" "$@" >"$OUT" 2>&1 &
JOB=$!
DEADLINE_HIT=0
if [ "$DEADLINE_S" -gt 0 ]; then
  # Polls, so that it ends by itself within 0.2 s of the job (a lingering sleep would
  # hold ctest's pipe open).
  (
    end=$((SECONDS + DEADLINE_S))
    while kill -0 "$JOB" 2>/dev/null; do
      if [ $SECONDS -ge $end ]; then
        echo deadline >"$OUT.deadline"
        while read -r p; do kill -9 "$p" 2>/dev/null; done <"$CG/cgroup.procs"
        exit 0
      fi
      sleep 0.2
    done
  ) >/dev/null 2>&1 &
  WATCH=$!
fi
wait "$JOB"
rc=$?
if [ "$DEADLINE_S" -gt 0 ]; then
  wait "$WATCH" 2>/dev/null
  [ -s "$OUT.deadline" ] && { DEADLINE_HIT=1; rc=124; }
  rm -f "$OUT.deadline"
fi
# Every rank's peak RSS, as the launcher measured it (fsdp-run --peak-rss-json; written
# only when the job ends by itself).
if [ -s "$OUT.rss" ]; then
  echo "construction.sh: peak RSS per rank (MiB): $(tr -dc '0-9,' <"$OUT.rss" |
    awk -F, '{ for (i = 1; i <= NF; i++) printf "%s%d", (i > 1 ? " " : ""), $i / 1024 }')"
fi
rm -f "$OUT.rss"
peak=$(cat "$CG/$PEAK_FILE" 2>/dev/null || echo 0)
cat "$OUT"
rm -f "$OUT"
# OOM kills inside the cgroup: v1 memory.oom_control's oom_kill (Linux 4.13+), v2 memory.events.
kills=$(awk '$1 == "oom_kill" { print $2 }' "$CG/memory.oom_control" "$CG/memory.events" 2>/dev/null | head -1)
# Times the job was held at the limit: v1's failcnt, v2's memory.events "max".
if [ "$FAIL_FILE" = memory.failcnt ]; then
  hits=$(cat "$CG/memory.failcnt" 2>/dev/null || echo 0)
else
  hits=$(awk '$1 == "max" { print $2 }' "$CG/memory.events" 2>/dev/null | head -1)
fi
echo "construction.sh: $MODE construction at world $WORLD under a ${LIMIT_MIB} MiB limit: exit $rc, job peak $((peak / 1024 / 1024)) MiB, OOM kills ${kills:-unknown}, limit hits ${hits:-0}$([ "$DEADLINE_HIT" = 1 ] && echo ", killed at the ${DEADLINE_S} s deadline")"
if [ "$EXPECT_OOM" = 1 ]; then
  if [ "$rc" = 0 ]; then
    echo "construction.sh: FAILED: the $MODE run finished under the limit; it was expected to be killed" >&2
    exit 1
  fi
  if [ "$DEADLINE_HIT" = 1 ]; then
    if [ "${hits:-0}" = 0 ]; then
      echo "construction.sh: FAILED: the $MODE run was still running at the ${DEADLINE_S} s deadline without" \
           "having reached the limit: it is slow, not too large (raise --deadline-s)" >&2
      exit 1
    fi
    echo "construction.sh: the $MODE run did not fit: it reached the limit (${hits} times) and was still" \
         "running at the ${DEADLINE_S} s deadline, its pages reclaimed instead of killed"
    exit 0
  fi
  if [ "${kills:-0}" = 0 ] && [ "$rc" != 137 ]; then
    echo "construction.sh: FAILED: the $MODE run failed (exit $rc) but not by the OOM killer" >&2
    exit 1
  fi
  echo "construction.sh: the $MODE run was killed by the OOM killer, as expected"
  exit 0
fi
if [ "$DEADLINE_HIT" = 1 ]; then
  echo "construction.sh: FAILED: the $MODE run was still running at the ${DEADLINE_S} s deadline" \
       "(limit hits ${hits:-0})" >&2
fi
exit "$rc"
