#!/usr/bin/env bash
# Times the README's commands, or CI's, as a new user or a fresh CI machine would run them:
# in a fresh clone of this repository's HEAD, with a fresh HOME: an empty ccache (the fresh
# HOME's, as on a new machine: what the run compiles twice, it compiles once) and no pip
# cache (PIP_NO_CACHE_DIR=1), so every byte is downloaded and every file compiled at least
# once. FRESH_CCACHE=off disables ccache altogether (CCACHE_DISABLE=1).
# What apt installed stays installed (apt's part is a minute or two; the packages are
# downloaded again only on a machine that never had them).
#
#   scripts/ci/fresh-run.sh readme [DIR]   ./scripts/setup.sh, then ./scripts/test.sh, then
#                                          ./scripts/test.sh --all (the long tier alone:
#                                          the default tier's tests are not run twice)
#   scripts/ci/fresh-run.sh ci [DIR]       CI=true bash .ci/run, as CI runs it
#
# DIR (default: a new directory under /var/tmp) gets the clone, the HOME and the logs;
# it is left for inspection. Each command's seconds and exit status go to DIR/times.txt
# and to the last lines printed; the full output to DIR/<name>.log. Exits non-zero if any
# command failed. Needs no network beyond what the commands themselves fetch.
set -euo pipefail
SRC="$(cd "$(dirname "$0")/../.." && pwd)"
MODE="${1:-}"
case "$MODE" in
  readme | ci) ;;
  *) echo "fresh-run: usage: $0 readme|ci [DIR] (got '${MODE}')" >&2; exit 2 ;;
esac
DIR="${2:-$(mktemp -d /var/tmp/fsdp-fresh-XXXXXX)}"
mkdir -p "$DIR"
[ -z "$(ls -A "$DIR")" ] || { echo "fresh-run: $DIR is not empty; give a new or empty directory" >&2; exit 2; }
DIR="$(cd "$DIR" && pwd)"
git -C "$SRC" rev-parse --verify HEAD >/dev/null
git clone -q --no-hardlinks "$SRC" "$DIR/clone"
# CI lays shared/ beside the clone (the contracts the tests read); copy it the same way.
[ -d "$SRC/../shared" ] && cp -r "$SRC/../shared" "$DIR/shared"
mkdir -p "$DIR/home"
echo "fresh-run: $(git -C "$DIR/clone" log -1 --format='%h %s' | cut -c1-100)"
CCACHE_ENV="" CCACHE_SAYS="empty"
[ "${FRESH_CCACHE:-on}" = off ] && CCACHE_ENV="CCACHE_DISABLE=1" CCACHE_SAYS="off"
echo "fresh-run: clone $DIR/clone, HOME $DIR/home, ccache $CCACHE_SAYS, pip's cache off; $(nproc) cores;" \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
: >"$DIR/times.txt"
FAILED=0
timed() {
  local name="$1"
  shift
  local t0=$SECONDS rc=0
  echo "fresh-run: [$name] $*"
  # This environment, as CI keeps the machine's, less every cache's location.
  (cd "$DIR/clone" && env -u XDG_CACHE_HOME -u CCACHE_DIR -u PIP_CACHE_DIR -u FSDP_VENV \
     -u FSDP_BUILD_DIR -u CCACHE_DISABLE HOME="$DIR/home" $CCACHE_ENV PIP_NO_CACHE_DIR=1 ${CI_ENV:-} "$@") \
    </dev/null >"$DIR/$name.log" 2>&1 || rc=$?
  echo "$name: $((SECONDS - t0)) s, exit $rc" | tee -a "$DIR/times.txt"
  grep -E '^\[ci\] times:|tests passed|tests failed out of' "$DIR/$name.log" | tail -2 || true
  [ "$rc" = 0 ] || FAILED=1
  return 0
}
if [ "$MODE" = readme ]; then
  timed setup ./scripts/setup.sh
  timed test ./scripts/test.sh
  timed test-long ./scripts/test.sh --all -L '^long$'
else
  CI_ENV="CI=true" timed ci bash .ci/run
fi
echo "fresh-run: times (also in $DIR/times.txt):"
cat "$DIR/times.txt"
exit $FAILED
