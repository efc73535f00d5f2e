#!/usr/bin/env bash
# Runs a command in a Debian 13 (trixie) root on this machine, with this project inside:
#
#   scripts/ci/in-debian13.sh [--fresh] CMD [ARGS...]
#   scripts/ci/in-debian13.sh --prepare                  # only make the root (CI does it early)
#   scripts/ci/in-debian13.sh ./scripts/test.sh          # the whole suite on Debian's LibTorch 2.6
#
# The root is made with debootstrap when it is missing, and the project's dependencies
# are installed into it by scripts/install-deps.sh --debian-torch (the host's package
# list, plus Debian 13's LibTorch 2.6, the oldest supported, and its Python packages).
# Inside, the scripts build against that LibTorch (FSDP_TORCH=system, see
# scripts/lib/python-env.sh) and the tests run /usr/bin/python3. The project is
# bind-mounted at its own path, so CMD sees the same files; builds inside go to
# build-debian13/, never to the host's build/. Mounts are removed on exit, also on
# failure.
#
# Roots are cached in $FSDP_DEBIAN13_CACHE (default /var/cache/fsdp-libtorch) and
# reused only when complete: a root is built under a temporary name and renamed when its
# packages are installed. --fresh discards the cached root first. Needs root (or sudo),
# debootstrap and mount; without them it fails and says so. The mirror is debootstrap's
# default unless FSDP_DEBIAN_MIRROR is set.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROJECT="$(pwd -P)"

FRESH=0
PREPARE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --fresh) FRESH=1; shift ;;
    --prepare) PREPARE=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) echo "in-debian13: unknown option '$1' (expected --fresh, --prepare, or a command)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ "$PREPARE" = 1 ] && [ $# -gt 0 ]; then
  echo "in-debian13: --prepare makes the root only; it takes no command (got '$*')" >&2
  exit 2
fi
if [ $# -eq 0 ] && [ "$PREPARE" = 0 ]; then
  echo "in-debian13: no command given; e.g. scripts/ci/in-debian13.sh ./scripts/test.sh" >&2
  exit 2
fi

CHROOT_TAG=in-debian13
# fail, $SUDO, $DEBOOTSTRAP, mount_in, mount_system, cleanup (the EXIT trap), remove_root.
. scripts/lib/chroot.sh

VARIANT=cpu
DEPS_FLAGS=(--debian-torch)
CACHE="${FSDP_DEBIAN13_CACHE:-/var/cache/fsdp-libtorch}"
ROOT="$CACHE/debian13-$VARIANT"
# One run per root at a time: two runs would mount into one root and the first to finish
# would unmount what the other still uses. A second run waits for the first.
LOCK="${TMPDIR:-/tmp}/fsdp-libtorch-debian13-$VARIANT.lock"
exec 9>>"$LOCK"
if ! flock -n 9; then
  echo "[in-debian13] another run is using the $VARIANT root; waiting for it (lock $LOCK)"
  flock 9
fi
# The package list is part of the root's identity: a changed install-deps.sh rebuilds it.
STAMP="$(sha256sum scripts/install-deps.sh | cut -c1-16)"

if [ "$FRESH" = 1 ] && [ -d "$ROOT" ]; then
  echo "[in-debian13] --fresh: removing $ROOT"
  remove_root "$ROOT"
fi
if [ -d "$ROOT" ] && [ "$($SUDO cat "$ROOT/.fsdp-deps" 2>/dev/null)" != "$STAMP" ]; then
  echo "[in-debian13] $ROOT was made with another package list; making a new one (the old one stays until then)"
  STALE=1
else
  STALE=0
fi
if [ ! -d "$ROOT" ] || [ "$STALE" = 1 ]; then
  TMP="$ROOT.partial"
  LOG="$CACHE/debootstrap-$VARIANT.log"
  remove_root "$TMP"
  $SUDO mkdir -p "$CACHE"
  debootstrap_root trixie "$TMP" "$LOG" --components=main,contrib,non-free,non-free-firmware
  mount_system "$TMP"
  mount_in "$TMP" bind "$PROJECT/scripts" /tmp/fsdp-scripts
  $SUDO chroot "$TMP" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    bash /tmp/fsdp-scripts/install-deps.sh "${DEPS_FLAGS[@]}" || fail "installing the dependencies in $TMP failed"
  cleanup
  echo "$STAMP" | $SUDO tee "$TMP/.fsdp-deps" >/dev/null
  remove_root "$ROOT"
  $SUDO mv "$TMP" "$ROOT"
fi

if [ "$PREPARE" = 1 ]; then
  echo "[in-debian13] the $VARIANT root is ready: $ROOT"
  exit 0
fi
mount_system "$ROOT"
# /tmp first: a checkout under /tmp must stay visible through the binds below.
mount_in "$ROOT" tmpfs tmpfs /tmp
mount_in "$ROOT" bind "$PROJECT" "$PROJECT"
# shared/ beside the checkout holds the project's cross-program contracts.
if [ -d "$PROJECT/../shared" ]; then mount_in "$ROOT" bind "$(cd "$PROJECT/../shared" && pwd -P)" "$(cd "$PROJECT/../shared" && pwd -P)"; fi

BUILD_DIR="${FSDP_DEBIAN13_BUILD_DIR:-build-debian13}"
echo "[in-debian13] running in $ROOT ($VARIANT): $*"
# A clean environment inside, plus the project's own knobs from outside (FSDP_*, e.g.
# FSDP_TIMEOUT_S), thread counts and ctest's; not the host's choice of LibTorch and
# Python (FSDP_TORCH, FSDP_PY, FSDP_VENV), which inside are Debian's.
PASS=()
while IFS= read -r kv; do PASS+=("$kv"); done < <(env | grep -E '^(FSDP_[A-Z0-9_]*|OMP_NUM_THREADS|CTEST_[A-Z_]*|CCACHE_[A-Z_]*)=' |
                                                   grep -v -E '^FSDP_(BUILD_DIR|TORCH|PY|VENV)=' || true)
# As the calling user (under sudo), so that what CMD writes into the checkout is theirs;
# ccache keeps its cache in the root, per user.
USERSPEC=()
HOME_IN=/root
if [ -n "$SUDO" ]; then
  USERSPEC=(--userspec="$(id -u):$(id -g)")
  HOME_IN="/var/cache/home-$(id -u)"
  $SUDO mkdir -p "$ROOT$HOME_IN" && $SUDO chown "$(id -u):$(id -g)" "$ROOT$HOME_IN"
fi
set +e
$SUDO chroot "${USERSPEC[@]}" "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$HOME_IN" LANG=C.UTF-8 \
  TERM="${TERM:-dumb}" CI="${CI:-}" "${PASS[@]}" FSDP_BUILD_DIR="$BUILD_DIR" FSDP_IN_DEBIAN13="$VARIANT" FSDP_TORCH=system \
  bash -c 'cd "$1" && shift && exec "$@"' in-debian13 "$PROJECT" "$@"
RC=$?
set -e
exit $RC
