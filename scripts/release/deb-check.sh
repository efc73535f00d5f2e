#!/usr/bin/env bash
# Checks the Debian package on a fresh Debian 13: builds the .deb against Debian 13's
# LibTorch 2.6 (in the root of scripts/ci/in-debian13.sh, or on the host if it is Debian 13
# with libtorch-dev), installs it with apt into a bare trixie root (apt takes LibTorch,
# HDF5, ... from the archive through the package's Depends alone), then builds and runs
# an application against it. The .deb belongs with a Debian LibTorch: Debian 12's is
# 1.13, older than the 2.6 this project supports.
#
#   scripts/release/deb-check.sh [--fresh] [--keep] [CONSUMER_DIR]     (default: tests/consumer)
#   scripts/release/deb-check.sh [--fresh] --root-only     # only make the cached bare root
#
# CONSUMER_DIR is a CMake project that uses the installed package (find_package(fsdp
# CONFIG REQUIRED), fsdp::fsdp) and holds an executable run.sh. Inside the root, a copy of
# it is built and run as
#     cmake -S <copy> -B <build> && cmake --build <build> && <copy>/run.sh <build>
# from the directory <build>, with PATH=/usr/sbin:/usr/bin:/sbin:/bin (so fsdp-run and the
# other tools are the package's), as root; run.sh exits 0 when the application works.
# The consumer's build tools (cmake, g++, make) are installed beside the package, not
# through its Depends.
#
# The package is built in build-deb/ (library and tools; no tests, examples, benchmarks;
# FSDP_DEB_BUILD_DIR names another build directory under the checkout).
# The bare root (debootstrap --variant=minbase trixie, apt-get update done) is cached
# in $FSDP_DEBIAN13_CACHE (default /var/cache/fsdp-libtorch) as debian13-bare and copied
# for every run, so each run starts from a machine that has never seen the package;
# --fresh makes the cached root again, --keep leaves the used copy (its path is printed).
# Needs root (or sudo), debootstrap and mount, like scripts/ci/in-debian13.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROJECT="$(pwd -P)"

FRESH=0
KEEP=0
ROOT_ONLY=0
CONSUMER=""
while [ $# -gt 0 ]; do
  case "$1" in
    --fresh) FRESH=1; shift ;;
    --keep) KEEP=1; shift ;;
    --root-only) ROOT_ONLY=1; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "deb-check: unknown option '$1' (expected --fresh, --keep, --root-only or a consumer directory)" >&2; exit 2 ;;
    *) [ -z "$CONSUMER" ] || { echo "deb-check: one consumer directory only" >&2; exit 2; }
       CONSUMER="$1"; shift ;;
  esac
done
CONSUMER="${CONSUMER:-tests/consumer}"

CHROOT_TAG=deb-check
# fail, $SUDO, $DEBOOTSTRAP, mount_in, mount_system, cleanup (the EXIT trap), remove_root.
. scripts/lib/chroot.sh
say() { echo "[deb-check] $*"; }
START=$SECONDS
STEP_T0=$SECONDS
STEP_NAME=""
TIMES=()
step() {  # step NAME MESSAGE: starts a step; the times of all steps are printed at the end
  [ -z "$STEP_NAME" ] || TIMES+=("$STEP_NAME $((SECONDS - STEP_T0)) s")
  STEP_NAME="$1"
  STEP_T0=$SECONDS
  shift
  say "$* (at $((SECONDS - START)) s)"
}

if [ "$ROOT_ONLY" = 0 ]; then
  [ -d "$CONSUMER" ] || fail "no consumer project at '$CONSUMER' (give its directory as the argument)"
  CONSUMER="$(cd "$CONSUMER" && pwd -P)"
  [ -f "$CONSUMER/CMakeLists.txt" ] || fail "$CONSUMER has no CMakeLists.txt"
  [ -x "$CONSUMER/run.sh" ] || fail "$CONSUMER has no executable run.sh (it runs the built application: run.sh BUILD_DIR)"

  # 1. The package, against Debian 13's LibTorch.
  BUILD="$(realpath -m "${FSDP_DEB_BUILD_DIR:-$PROJECT/build-deb}")"
  case "$BUILD" in "$PROJECT"/*) ;; *) fail "FSDP_DEB_BUILD_DIR must be under the checkout ($PROJECT), got $BUILD" ;; esac
  mkdir -p "$BUILD"
  rm -f "$BUILD"/*.deb
  # The preset "deb" of CMakePresets.json: library and tools only, prefix /usr (so that
  # GNUInstallDirs picks Debian's multiarch libdir, lib/x86_64-linux-gnu), Ninja
  # (install-deps.sh installs ninja-build, here and in the root).
  PACKAGE_CMD="set -e; cd '$PROJECT'
    echo '[deb-check] configuring $BUILD (cmake --preset deb)'
    cmake --preset deb -B '$BUILD' >'$BUILD/deb-check-configure.log' 2>&1 ||
      { tail -30 '$BUILD/deb-check-configure.log' >&2; exit 1; }
    echo '[deb-check] building (cmake --build -j${FSDP_JOBS:-$(nproc)})'
    cmake --build '$BUILD' -j${FSDP_JOBS:-$(nproc)} >'$BUILD/deb-check-build.log' 2>&1 || { tail -30 '$BUILD/deb-check-build.log' >&2; exit 1; }
    echo '[deb-check] cpack -G DEB'
    cd '$BUILD' && cpack -G DEB >'$BUILD/deb-check-cpack.log' 2>&1 || { tail -30 '$BUILD/deb-check-cpack.log' >&2; exit 1; }"
  if [ "$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")" = trixie ] && dpkg -s libtorch-dev >/dev/null 2>&1; then
    step package "building the .deb here (Debian 13, libtorch-dev $(dpkg-query -W -f='${Version}' libtorch-dev))"
    bash -c "$PACKAGE_CMD" || fail "building the package in $BUILD failed (logs: $BUILD/deb-check-*.log)"
  else
    step package "building the .deb in the Debian 13 root of scripts/ci/in-debian13.sh (LibTorch 2.6)"
    scripts/ci/in-debian13.sh bash -c "$PACKAGE_CMD" || fail "building the package in $BUILD failed (logs: $BUILD/deb-check-*.log)"
  fi
  DEBS=("$BUILD"/*.deb)
  if [ ${#DEBS[@]} -ne 1 ] || [ ! -f "${DEBS[0]}" ]; then fail "cpack made no single .deb in $BUILD: ${DEBS[*]}"; fi
  DEB="${DEBS[0]}"
  say "package: $(basename "$DEB"); $(dpkg-deb -f "$DEB" Depends | sed 's/^/Depends: /')"
fi

# 2. The bare Debian 13 root, cached.
CACHE="${FSDP_DEBIAN13_CACHE:-/var/cache/fsdp-libtorch}"
BARE="$CACHE/debian13-bare"
if [ "$FRESH" = 1 ] && [ -d "$BARE" ]; then
  step remove-root "--fresh: removing $BARE"
  remove_root "$BARE"
fi
if [ ! -d "$BARE" ]; then
  step debootstrap "making the bare Debian 13 root $BARE"
  $SUDO mkdir -p "$CACHE"
  remove_root "$BARE.partial"
  debootstrap_root trixie "$BARE.partial" "$CACHE/debootstrap-debian13-bare.log"
  mount_system "$BARE.partial"
  $SUDO chroot "$BARE.partial" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    apt-get update -qq || fail "apt-get update in $BARE.partial failed"
  cleanup
  $SUDO mv "$BARE.partial" "$BARE"
fi
if [ "$ROOT_ONLY" = 1 ]; then
  say "the bare root is ready: $BARE ($((SECONDS - START)) s)"
  exit 0
fi

# 3. A copy of it for this run: the cached root never sees the package.
WORK="$($SUDO mktemp -d /var/tmp/fsdp-deb-check.XXXXXX)"
ROOT="$WORK/root"
finish() {
  local rc=$?
  [ "$STEP_NAME" = cleanup ] || step cleanup "unmounting and removing the root"
  cleanup
  if [ "$KEEP" = 1 ]; then
    say "kept the root: $ROOT (remove it with: rm -rf --one-file-system $WORK)"
  else
    remove_root "$WORK"
  fi
  step end "finished"
  local times
  times="$(printf '%s; ' "${TIMES[@]}")"
  say "times: ${times%; }"
  if [ $rc -eq 0 ]; then say "PASSED in $((SECONDS - START)) s"; else say "FAILED (exit $rc) after $((SECONDS - START)) s"; fi
}
trap finish EXIT
step copy-root "copying the bare root to $ROOT"
$SUDO cp -a "$BARE" "$ROOT"
$SUDO mkdir -p "$ROOT/opt/deb-check"
$SUDO cp "$DEB" "$ROOT/opt/deb-check/"
$SUDO cp -a "$CONSUMER" "$ROOT/opt/deb-check/consumer"
mount_system "$ROOT"
mount_in "$ROOT" tmpfs tmpfs /tmp
in_root() {
  $SUDO chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive TERM="${TERM:-dumb}" bash -euo pipefail -c "$1"
}

# 4. Install: the package's Depends must bring everything an application needs to build
# against it and the tools need to run. No recommends, so only Depends count.
step apt-install "apt-get install ./$(basename "$DEB") cmake g++ make (a few minutes: LibTorch comes from the archive)"
in_root "cd /opt/deb-check && apt-get update -qq && apt-get install -y -q --no-install-recommends ./$(basename "$DEB") cmake g++ make \
           >/opt/deb-check/apt.log 2>&1" ||
  { $SUDO tail -30 "$ROOT/opt/deb-check/apt.log" >&2; fail "apt-get install of the package failed (its Depends cannot be met from the archive?)"; }
say "installed: $(in_root "dpkg-query -W -f='\${Package} \${Version}, ' libfsdp-libtorch-dev libtorch-dev libhdf5-dev 2>/dev/null || true")"
step tools "the tools start"
for tool in fsdp-run fsdp-estimate fsdp-trace fsdp-consolidate fsdp-inspect; do
  if in_root "command -v $tool >/dev/null"; then
    in_root "$tool --version" || fail "$tool --version failed in the fresh root"
  elif [ "$tool" = fsdp-run ] || [ "$tool" = fsdp-estimate ] || [ "$tool" = fsdp-trace ]; then
    fail "$tool is not installed by the package"
  else
    say "$tool is not in the package (built without HDF5)"
  fi
done

# 5. The application.
step consumer-build "building the consumer $CONSUMER (cmake -S consumer -B /tmp/consumer-build)"
in_root "cmake -S /opt/deb-check/consumer -B /tmp/consumer-build && cmake --build /tmp/consumer-build -j${FSDP_JOBS:-2}" ||
  fail "the consumer project did not configure or build against the installed package"
step consumer-run "running the consumer: run.sh /tmp/consumer-build"
in_root "cd /tmp/consumer-build && /opt/deb-check/consumer/run.sh /tmp/consumer-build" ||
  fail "the consumer's run.sh failed"
step cleanup "the application ran; removing the root"
