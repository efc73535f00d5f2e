#!/usr/bin/env bash
# The CUDA build, compiled and linked for real against a CUDA LibTorch, on a machine
# without a GPU. Run it in the Debian 13 root that has Debian's CUDA LibTorch 2.6
# (libtorch-cuda-dev), NCCL and the CUDA toolkit:
#
#   scripts/in-debian13.sh --cuda ./scripts/cuda-link-check.sh
#
# It configures the project (CMake must report CUDA/NCCL=ON), builds what a CUDA build
# changes: the library with src/cuda/ and the NCCL backend, every tool and example, and
# the GPU test and benchmark (test_cuda, bench_gpu, on the test support library); it
# checks that the executables link against libtorch_cuda and that the NCCL backend is
# the real one, not the stand-in. The other test and benchmark binaries are the same
# sources against the same LibTorch 2.6 headers: the Debian 13 CPU leg compiles and runs
# them. `--all` builds every target of the project instead (CI's time does not allow it).
#
# What it cannot do here, and why: Debian's libtorch-cuda-2.6 needs cuDNN
# (libcudnn.so.9), which Debian ships only as an installer (nvidia-cudnn) that downloads
# it from NVIDIA's site when configured. Where that site cannot be reached, cuDNN is
# missing. So this build's link step -- and only this build's, never what users build --
# is told to leave symbols of shared libraries unresolved
# (-Wl,--unresolved-symbols=ignore-in-shared-libs): the project's own symbols must still
# all resolve. Nothing linked against libtorch_cuda.so can start without cuDNN
# (BIND_NOW), so the check stops at a full link; running the suite with this LibTorch is
# scripts/gpu-check.sh's job on a machine with a GPU and cuDNN.
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build-cuda-link}"
ALL=0
case "${1:-}" in
  --all) ALL=1 ;;
  "") ;;
  *) echo "cuda-link-check: unknown argument '$1' (expected --all or nothing)" >&2; exit 2 ;;
esac
# The executables a CUDA build changes; the library and test support come with them.
TARGETS=(fsdp-run fsdp-consolidate fsdp-inspect fsdp-estimate train_gpt train_mlp train_sequential generate
         test_cuda bench_gpu)
fail() { echo "cuda-link-check: FAILED: $*" >&2; exit 1; }

LINK_FLAGS=""
if [ -z "$(ldconfig -p | grep -F 'libcudnn.so.9 ')" ]; then
  echo "[cuda-link-check] libcudnn.so.9 is not installed: linking with" \
       "-Wl,--unresolved-symbols=ignore-in-shared-libs (this check's build only)"
  LINK_FLAGS="-Wl,--unresolved-symbols=ignore-in-shared-libs"
fi
echo "[cuda-link-check] configuring $B"
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_EXE_LINKER_FLAGS="$LINK_FLAGS" -DCMAKE_SHARED_LINKER_FLAGS="$LINK_FLAGS" | tee "$B.configure.log" ||
  fail "cmake could not configure against the CUDA LibTorch"
grep -q "CUDA/NCCL=ON" "$B.configure.log" || fail "CMake did not enable CUDA/NCCL (see $B.configure.log)"
rm -f "$B.configure.log"

if [ "$ALL" = 1 ]; then
  echo "[cuda-link-check] building every target"
  cmake --build "$B" -j2
  # Every executable the project defines (from the build graph) must exist.
  mapfile -t EXES < <(ninja -C "$B" -t targets all | sed -n 's/^\([^:]*\): CXX_EXECUTABLE_LINKER.*/\1/p' | sort -u)
  [ "${#EXES[@]}" -gt 10 ] || fail "found only ${#EXES[@]} executables in the build graph of $B"
else
  echo "[cuda-link-check] building ${TARGETS[*]} (the library, tools, examples and GPU test; --all: every target)"
  cmake --build "$B" -j2 --target "${TARGETS[@]}"
  EXES=()
  for t in "${TARGETS[@]}"; do EXES+=("bin/$t"); done
fi
MISSING=()
for exe in "${EXES[@]}"; do [ -x "$B/$exe" ] || MISSING+=("$exe"); done
[ "${#MISSING[@]}" -eq 0 ] || fail "executables that were not built: ${MISSING[*]}"
LINKED=${#EXES[@]}
for must in "${TARGETS[@]}"; do
  [ -x "$B/bin/$must" ] || fail "$must was not built"
done
# The engine's executables link LibTorch's CUDA library; the NCCL backend is the real one.
for exe in train_gpt test_cuda bench_gpu; do
  case "$(readelf -d "$B/bin/$exe")" in *libtorch_cuda.so*) ;; *) fail "$exe does not link libtorch_cuda.so" ;; esac
done
# (nm's output goes to a file: grep -q in a pipeline would end nm with SIGPIPE.)
SYMS="$B/libfsdp.symbols.txt"
nm -C "$B/lib/libfsdp.a" >"$SYMS" 2>/dev/null || fail "cannot read $B/lib/libfsdp.a"
grep -q 'c10d::ProcessGroupNCCL::' "$SYMS" ||
  fail "libfsdp.a has no reference to c10d::ProcessGroupNCCL: the NCCL backend was not compiled in"
MEMBERS="$(ar t "$B/lib/libfsdp.a")"
case "$MEMBERS" in *no_cuda.cpp.o*) fail "libfsdp.a contains the no-CUDA stand-in (src/no_cuda.cpp)" ;; esac
for m in backend_nccl.cpp.o transfers_cuda.cpp.o; do
  case "$MEMBERS" in *"$m"*) ;; *) fail "libfsdp.a lacks $m (src/cuda/)" ;; esac
done
rm -f "$SYMS"
TORCH_CUDA="$(readlink -f /usr/lib/x86_64-linux-gnu/libtorch_cuda.so || echo libtorch_cuda.so)"
echo "[cuda-link-check] OK: $LINKED executables ($( [ "$ALL" = 1 ] && echo "every one of the build" || echo "${TARGETS[*]}")) compiled and linked against $TORCH_CUDA," \
     "with src/cuda/ and the NCCL backend compiled in. Not run: that needs cuDNN and a GPU (scripts/gpu-check.sh)."
