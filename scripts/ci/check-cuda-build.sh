#!/usr/bin/env bash
# Checks that a build against a CUDA LibTorch is the real CUDA build (CI runs it on
# build/, made against PyPI's torch, before the suite runs with these same binaries):
#
#   scripts/ci/check-cuda-build.sh [BUILD_DIR]        (default: build)
#
# - CMake found CUDA and NCCL (CUDA/NCCL=ON in the configure line it cached);
# - libfsdp.a holds the CUDA code (src/comm/nccl/backend_nccl.cpp, the NCCL backend;
#   src/engine/transfers_cuda.cpp, the offload streams) and none of the stand-ins;
# - every executable in BUILD_DIR/bin that links LibTorch links libtorch_cuda.so, and the
#   dynamic loader resolves every library each one needs (ldd: no "not found"; cuDNN,
#   NCCL and the CUDA runtime among them): nothing is left unresolved, so the binaries
#   start on this CPU-only machine exactly as a user's do on a GPU machine;
# - the engine's programs start: `train_gpt --help` runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${1:-build}"
fail() { echo "check-cuda-build: FAILED: $*" >&2; exit 1; }
[ -f "$B/CMakeCache.txt" ] || fail "$B is not a configured build directory"
grep -q '^FSDP_HAVE_CUDA_BUILD:INTERNAL=ON' "$B/CMakeCache.txt" ||
  fail "$B was not configured against a CUDA LibTorch (CUDA/NCCL=OFF); scripts/setup.sh builds against PyPI's CUDA torch"
LIB="$B/lib/libfsdp.a"
[ -f "$LIB" ] || fail "$LIB is missing (build first)"
MEMBERS="$(ar t "$LIB")"
case "$MEMBERS" in *no_nccl.cpp.o*) fail "$LIB contains the no-NCCL stand-in (src/comm/nccl/no_nccl.cpp)" ;; esac
case "$MEMBERS" in *no_cuda_transfers.cpp.o*) fail "$LIB contains the no-CUDA stand-in (src/engine/no_cuda_transfers.cpp)" ;; esac
case "$MEMBERS" in *no_gloo.cpp.o*) fail "$LIB contains the no-Gloo stand-in (src/comm/gloo/no_gloo.cpp): no Gloo headers were found" ;; esac
for m in backend_nccl.cpp.o transfers_cuda.cpp.o; do
  case "$MEMBERS" in *"$m"*) ;; *) fail "$LIB lacks $m (the CUDA code)" ;; esac
done
SYMS="$(mktemp)"
nm -C "$LIB" >"$SYMS" 2>/dev/null || fail "cannot read $LIB"
grep -q 'c10d::ProcessGroupNCCL::' "$SYMS" || { rm -f "$SYMS"; fail "$LIB does not reference c10d::ProcessGroupNCCL"; }
rm -f "$SYMS"
N=0
for exe in "$B"/bin/*; do
  [ -x "$exe" ] && [ -f "$exe" ] || continue
  DEPS="$(ldd "$exe" 2>&1)" || fail "ldd $exe failed: $DEPS"
  if grep -q "not found" <<<"$DEPS"; then
    fail "$exe needs libraries the loader cannot find: $(grep 'not found' <<<"$DEPS" | tr -s ' \t' ' ' | paste -sd ';')"
  fi
  case "$DEPS" in *libtorch_cpu.so*) ;; *) continue ;; esac   # the offline tools link no LibTorch
  case "$DEPS" in *libtorch_cuda.so*) ;; *) fail "$exe links LibTorch but not libtorch_cuda.so" ;; esac
  N=$((N + 1))
done
[ "$N" -gt 5 ] || fail "only $N executables in $B/bin link LibTorch; expected the tools, examples and tests"
"$B/bin/train_gpt" --help >/dev/null || fail "$B/bin/train_gpt --help did not run"
echo "[check-cuda-build] OK: $N executables in $B/bin link libtorch_cuda.so with every library resolved; the NCCL backend and the offload streams are in libfsdp.a"
echo "[check-cuda-build] ldd $B/bin/train_gpt (CUDA, cuDNN, NCCL):"
ldd "$B/bin/train_gpt" | grep -E 'libtorch_cuda|libc10_cuda|libcudnn|libnccl|libcudart|libcublas' | sed 's/^/  /'
