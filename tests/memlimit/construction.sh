#!/usr/bin/env bash
# Trains the GPT example at world N inside a memory cgroup with a hard limit, so that the
# kernel kills the job when its ranks together exceed it (docs/design.md, "Sharded
# construction"). Prints the limit, the model's full fp32 size, the job's peak (the
# cgroup's high-water mark) and each rank's peak RSS (fsdp-run --peak-rss-json), and
# exits with the job's status (137 when the OOM killer ended it).
#
#   construction.sh [--expect-oom] BIN_DIR LIMIT_MIB sharded|eager WORLD [train_gpt flags...]
#
# --expect-oom: succeed only if the kernel's OOM killer ended the job inside the cgroup
# (the eager run that the limit must stop), fail if it finished or failed otherwise.
#
# glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after
# which the engine's per-unit buffers come from its heap, which fragments and keeps their
# pages: a rank's resident memory in training then grows far past what it uses (measured:
# 1736 MiB against 881 MiB per rank for a 201M-parameter GPT at world 8). The job runs with
# MALLOC_MMAP_THRESHOLD_=64 KiB, which keeps the threshold fixed, so that the limit
# measures the engine's memory, not the allocator's (docs/design.md, "Sharded construction").
# 1 MiB, the value before, still left the buffers under it (a width-256 block's 16-bit
# shards and reduced gradients, 786 KB each) in the heap: 1.16 MiB more per block and rank
# at world 2 with the optimizer state on NVMe, 14% above fsdp-estimate at 100 blocks.
#
# Needs root and a memory controller: cgroup v1 (memory.limit_in_bytes) or v2
# (memory.max). Without them it exits 77, which ctest reports as skipped. The cgroup is
# removed on every exit.
set -uo pipefail
EXPECT_OOM=0
[ "${1:-}" = --expect-oom ] && { EXPECT_OOM=1; shift; }
[ $# -ge 4 ] || { echo "usage: $0 BIN_DIR LIMIT_MIB sharded|eager WORLD [train_gpt flags...]" >&2; exit 2; }
BIN="$1" LIMIT_MIB="$2" MODE="$3" WORLD="$4"
shift 4

skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to make a memory cgroup (CI runs as root)"

CG=""
if [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
  CG="/sys/fs/cgroup/memory/fsdp-construction-$$"
  LIMIT_FILE=memory.limit_in_bytes PEAK_FILE=memory.max_usage_in_bytes
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  CG="/sys/fs/cgroup/fsdp-construction-$$"
  LIMIT_FILE=memory.max PEAK_FILE=memory.peak
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
MALLOC_MMAP_THRESHOLD_=65536 bash -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' _ "$CG" \
  "$BIN/fsdp-run" --nproc "$WORLD" --peak-rss-json "$OUT.rss" -- "$BIN/train_gpt" \
  --construction "$MODE" "$@" >"$OUT" 2>&1
rc=$?
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
echo "construction.sh: $MODE construction at world $WORLD under a ${LIMIT_MIB} MiB limit: exit $rc, job peak $((peak / 1024 / 1024)) MiB, OOM kills ${kills:-unknown}"
if [ "$EXPECT_OOM" = 1 ]; then
  if [ "$rc" = 0 ]; then
    echo "construction.sh: FAILED: the $MODE run finished under the limit; it was expected to be killed" >&2
    exit 1
  fi
  if [ "${kills:-0}" = 0 ] && [ "$rc" != 137 ]; then
    echo "construction.sh: FAILED: the $MODE run failed (exit $rc) but not by the OOM killer" >&2
    exit 1
  fi
  echo "construction.sh: the $MODE run was killed by the OOM killer, as expected"
  exit 0
fi
exit "$rc"
