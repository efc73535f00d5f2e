#!/usr/bin/env bash
# Packs what scripts/gpu/gpu-check.sh needs on an offline GPU machine into ONE folder, to copy
# there and run with its own CUDA torch. Such a machine (one H100/H200, its own Python
# with a CUDA torch, the system nvcc, cmake and ninja) has no package registry, no
# network and none of this project's other dependencies, so the folder carries them as
# sources, built there by gpu-check.sh:
#
#   src/                  this checkout: the files `git ls-files --cached --others
#                         --exclude-standard` lists (HEAD plus the uncommitted changes)
#   deps/googletest/      GoogleTest's sources (Debian's googletest, /usr/src/googletest)
#   deps/include/         cxxopts.hpp and nlohmann/ (header-only; the tools include them)
#   deps/gloo/include/    Gloo's headers for c10d's ProcessGroupGloo.hpp (.venv/fsdp/gloo
#                         when scripts/lib/python-env.sh made it, else Debian's libgloo-dev
#                         of FSDP_GLOO_SUITE, downloaded the same way)
#   deps/hdf5/            HDF5's source (.orig tarball of Debian's hdf5 of FSDP_HDF5_SUITE,
#                         default bookworm, downloaded and verified by apt), for checkpoints
#   manifest.json         what is in it: versions, sizes, the source tree's commit
#
#   scripts/gpu/gpu-bundle.sh [BUNDLE_DIR]        (default: .gpu-bundle/ in the checkout)
#
# The folder stays under FSDP_GPU_BUNDLE_MAX_MIB (default 40) MiB; when HDF5 does not fit
# it is left out (checkpoints then say how to get it, and gpu-check.sh says so). Then, on
# the GPU machine:  BUNDLE/src/scripts/gpu/gpu-check.sh [OUT_DIR]
# Needs: git, apt-get and dpkg-deb (the downloads), Debian's googletest, libcxxopts-dev
# and nlohmann-json3-dev (scripts/install-deps.sh installs them), python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROJECT="$(pwd -P)"

say() { echo "[gpu-bundle] $*"; }
fail() { echo "gpu-bundle: FAILED: $*" >&2; exit 1; }

case "${1:-}" in
  -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
  -*) echo "gpu-bundle: unknown option '$1' (expected a folder for the bundle, or none)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "gpu-bundle: one folder only" >&2; exit 2; }
BUNDLE="$(realpath -m "${1:-$PROJECT/.gpu-bundle}")"
MAX_MIB="${FSDP_GPU_BUNDLE_MAX_MIB:-40}"
HDF5_SUITE="${FSDP_HDF5_SUITE:-bookworm}"
MIRROR="${FSDP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
case "$BUNDLE" in /|"$PROJECT") fail "refusing to write the bundle into $BUNDLE (give a folder of its own)" ;; esac

GTEST_SRC=/usr/src/googletest
{ [ -f "$GTEST_SRC/CMakeLists.txt" ] && [ -d "$GTEST_SRC/googletest" ]; } ||
  fail "no GoogleTest sources in $GTEST_SRC (apt-get install googletest, or scripts/install-deps.sh)"
[ -f /usr/include/cxxopts.hpp ] || fail "no /usr/include/cxxopts.hpp (apt-get install libcxxopts-dev)"
[ -f /usr/include/nlohmann/json.hpp ] || fail "no /usr/include/nlohmann/json.hpp (apt-get install nlohmann-json3-dev)"
command -v git >/dev/null || fail "no git (apt-get install git)"
command -v python3 >/dev/null || fail "no python3 (apt-get install python3)"
git -C "$PROJECT" rev-parse --git-dir >/dev/null 2>&1 || fail "$PROJECT is not a git checkout (the file list comes from git ls-files)"

deb_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo unknown; }

START=$SECONDS
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# Built beside the old bundle and swapped in at the end, so a failed run leaves the old one.
NEW="$BUNDLE.new"
rm -rf "$NEW"
mkdir -p "$NEW/deps/include" "$NEW/deps/gloo" "$NEW/deps/hdf5"

# 1. The source tree: committed files plus the working tree's changes and new files that
# git does not ignore (so .venv/, build*/ and this bundle stay out). Files deleted in the
# working tree are skipped.
say "source tree: git ls-files of $PROJECT"
(cd "$PROJECT" && git ls-files -z --cached --others --exclude-standard) |
  while IFS= read -r -d '' f; do
    [ -f "$PROJECT/$f" ] || [ -L "$PROJECT/$f" ] || continue
    case "$PROJECT/$f" in "$BUNDLE"/*|"$NEW"/*) continue ;; esac
    printf '%s\0' "$f"
  done >"$TMP/files"
tar -C "$PROJECT" --null -T "$TMP/files" -cf - | tar -C "$NEW" --transform 's,^,src/,' -xf - ||
  fail "copying the source tree into $NEW/src failed"
SRC_FILES="$(tr -cd '\0' <"$TMP/files" | wc -c)"
SRC_COMMIT="$(git -C "$PROJECT" rev-parse HEAD)"
SRC_CHANGED="$(git -C "$PROJECT" status --porcelain --untracked-files=normal | wc -l)"
say "  $SRC_FILES files (HEAD ${SRC_COMMIT:0:12}, $SRC_CHANGED changed or new)"

# 2. GoogleTest, Debian's sources (googletest's top-level CMakeLists.txt builds gtest and
# gmock and installs GTestConfig.cmake).
say "GoogleTest: $GTEST_SRC (googletest $(deb_version googletest))"
cp -a "$GTEST_SRC" "$NEW/deps/googletest"

# 3. cxxopts and nlohmann-json: the project includes them from the include path
# (src/tools: <cxxopts.hpp>, <nlohmann/json.hpp>), no find_package.
say "cxxopts $(deb_version libcxxopts-dev), nlohmann-json $(deb_version nlohmann-json3-dev): headers"
cp /usr/include/cxxopts.hpp "$NEW/deps/include/"
cp -a /usr/include/nlohmann "$NEW/deps/include/nlohmann"

# 4. Gloo's headers.
GLOO_FROM=""
if [ -f "$PROJECT/.venv/fsdp/gloo/include/gloo/algorithm.h" ]; then
  say "Gloo: the headers of $PROJECT/.venv/fsdp/gloo/include"
  cp -a "$PROJECT/.venv/fsdp/gloo/include" "$NEW/deps/gloo/include"
  GLOO_FROM=".venv/fsdp/gloo (scripts/lib/python-env.sh)"
else
  say "Gloo: no .venv/fsdp/gloo here; downloading libgloo-dev as scripts/lib/python-env.sh does"
  (
    export FSDP_VENV="$TMP/venv"
    # shellcheck disable=SC1091
    . scripts/lib/python-env.sh
    fsdp_gloo_headers
  ) || fail "could not get Gloo's headers (see above; FSDP_GLOO_SUITE and FSDP_DEBIAN_MIRROR choose the source)"
  mv "$TMP/venv/fsdp/gloo/include" "$NEW/deps/gloo/include"
  GLOO_FROM="libgloo-dev of Debian ${FSDP_GLOO_SUITE:-forky}"
fi
[ -f "$NEW/deps/gloo/include/gloo/algorithm.h" ] || fail "the Gloo headers have no gloo/algorithm.h"
GLOO_VERSION="$(sed -n 's/^#define GLOO_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' \
  "$NEW/deps/gloo/include/gloo/config.h" 2>/dev/null | paste -sd. -)"

# 5. HDF5's source: Debian's .orig tarball, fetched by `apt-get source --download-only`
# with lists of its own (deb-src of FSDP_HDF5_SUITE), so apt checks it against the signed
# Sources index. Only the tarball is kept; gpu-check.sh builds the C library with CMake.
HDF5_VERSION=""
HDF5_NOTE=""
[ -f "$KEYRING" ] || fail "no $KEYRING to verify Debian's hdf5 source with (apt-get install debian-archive-keyring)"
say "HDF5: source of Debian $HDF5_SUITE's hdf5 ($MIRROR)"
mkdir -p "$TMP/apt/lists/partial" "$TMP/apt/cache/archives/partial" "$TMP/hdf5"
echo "deb-src [signed-by=$KEYRING] $MIRROR $HDF5_SUITE main" >"$TMP/apt/sources.list"
APT=(apt-get -q -o Dir::Etc::SourceList="$TMP/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$TMP/apt/lists" -o Dir::Cache="$TMP/apt/cache" -o APT::Sandbox::User=root)
if (cd "$TMP/hdf5" && "${APT[@]}" update >"$TMP/apt.log" 2>&1 &&
    "${APT[@]}" source --download-only hdf5 >>"$TMP/apt.log" 2>&1); then
  ORIG="$(compgen -G "$TMP/hdf5/hdf5_*.orig.tar.*" | head -1 || true)"
  [ -n "$ORIG" ] || fail "apt-get source hdf5 downloaded no .orig tarball (see $TMP/apt.log)"
  HDF5_VERSION="$(basename "$ORIG" | sed 's/^hdf5_\(.*\)\.orig\.tar\..*$/\1/')"
  mv "$ORIG" "$NEW/deps/hdf5/"
  say "  $(basename "$ORIG") ($(du -b "$NEW/deps/hdf5/$(basename "$ORIG")" | cut -f1) bytes)"
else
  tail -5 "$TMP/apt.log" >&2
  HDF5_NOTE="could not download the source of Debian $HDF5_SUITE's hdf5 (set FSDP_HDF5_SUITE or FSDP_DEBIAN_MIRROR)"
  echo "gpu-bundle: warning: $HDF5_NOTE; the bundle goes without HDF5" >&2
fi

# 6. Size: at most MAX_MIB; HDF5 is the part that can go.
size_of() { du -sb "$1" | cut -f1; }
LIMIT=$((MAX_MIB * 1024 * 1024))
if [ "$(size_of "$NEW")" -gt "$LIMIT" ] && [ -n "$HDF5_VERSION" ]; then
  HDF5_NOTE="left out: the bundle would be $(size_of "$NEW") bytes with it, over $MAX_MIB MiB"
  echo "gpu-bundle: warning: HDF5 $HDF5_NOTE; checkpoints will be disabled on the GPU machine" >&2
  rm -f "$NEW"/deps/hdf5/*
  HDF5_VERSION=""
fi

# 7. The manifest (gpu-check.sh copies it into its results).
python3 - "$NEW" "$SRC_COMMIT" "$SRC_CHANGED" "$SRC_FILES" "$(deb_version googletest)" \
  "$(deb_version libcxxopts-dev)" "$(deb_version nlohmann-json3-dev)" "$GLOO_VERSION" "$GLOO_FROM" \
  "$HDF5_VERSION" "$HDF5_SUITE" "$HDF5_NOTE" "$MAX_MIB" <<'EOF' || fail "writing manifest.json failed"
import json, os, sys, datetime
(root, commit, changed, nfiles, gtest, cxxopts, nlohmann, gloo_v, gloo_from,
 hdf5_v, hdf5_suite, hdf5_note, max_mib) = sys.argv[1:]
def size(p):
    p = os.path.join(root, p)
    if os.path.isfile(p):
        return os.path.getsize(p)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs
               if not os.path.islink(os.path.join(d, f)))
hdf5_files = sorted(os.listdir(os.path.join(root, "deps/hdf5")))
parts = {
    "src": {"what": "fsdp-libtorch source tree (git ls-files --cached --others --exclude-standard)",
            "commit": commit, "uncommitted_paths": int(changed), "files": int(nfiles)},
    "deps/googletest": {"what": "GoogleTest sources (Debian googletest, /usr/src/googletest)", "version": gtest},
    "deps/include/cxxopts.hpp": {"what": "cxxopts (Debian libcxxopts-dev)", "version": cxxopts},
    "deps/include/nlohmann": {"what": "nlohmann-json (Debian nlohmann-json3-dev)", "version": nlohmann},
    "deps/gloo/include": {"what": "Gloo headers", "from": gloo_from, "version": gloo_v or "unknown"},
    "deps/hdf5": {"what": "HDF5 source (Debian %s hdf5 .orig tarball)" % hdf5_suite,
                  "version": hdf5_v or None, "files": hdf5_files,
                  **({"note": hdf5_note} if hdf5_note else {})},
}
for p, d in parts.items():
    d["bytes"] = size(p)
m = {"made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
     "made_on": os.uname().nodename, "max_mib": int(max_mib), "hdf5": bool(hdf5_v), "parts": parts}
m["total_bytes"] = sum(d["bytes"] for d in parts.values())
with open(os.path.join(root, "manifest.json"), "w") as f:
    json.dump(m, f, indent=2)
    f.write("\n")
EOF

TOTAL="$(size_of "$NEW")"
[ "$TOTAL" -le "$LIMIT" ] || fail "the bundle is $TOTAL bytes without HDF5, over $MAX_MIB MiB (FSDP_GPU_BUNDLE_MAX_MIB)"
rm -rf "$BUNDLE"
mv "$NEW" "$BUNDLE"
say "bundle: $BUNDLE, $TOTAL bytes ($(du -sh "$BUNDLE" | cut -f1)); HDF5: ${HDF5_VERSION:-none}; $((SECONDS - START)) s"
for p in src deps/googletest deps/include deps/gloo deps/hdf5; do
  printf '[gpu-bundle]   %-16s %10s bytes\n' "$p" "$(size_of "$BUNDLE/$p")"
done
say "on the GPU machine: copy $(basename "$BUNDLE")/ there, then run $(basename "$BUNDLE")/src/scripts/gpu/gpu-check.sh [OUT_DIR]"
