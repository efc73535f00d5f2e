#!/usr/bin/env bash
# Compiles sources with -fsyntax-only against a LibTorch header tree with CUDA and NCCL
# switched on, on a machine that has no CUDA LibTorch to build against.
#
#   tests/lint/check-sources.sh                      # the CUDA sources vs the system LibTorch
#   tests/lint/check-sources.sh --torch-include DIR  # ... vs another tree (e.g. a 2.x
#                                                 #     libtorch/include, CPU or CUDA)
#   tests/lint/check-sources.sh --all [--std c++20]  # every source of the project
#
# Needs a CUDA Toolkit's headers (CUDA_HOME, else /usr/local/cuda) and a LibTorch tree
# that ships c10/cuda; exits 77 (ctest: skipped) when either is missing. It checks that
# the code compiles, not that it links or runs: that needs a GPU (scripts/gpu/gpu-check.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

torch_inc=/usr/include
std=c++17
all=0
cxx="${CXX:-c++}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-include) torch_inc="$2"; shift 2 ;;
    --std) std="$2"; shift 2 ;;
    --all) all=1; shift ;;
    --cxx) cxx="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "check-sources.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

cuda_inc="${CUDA_HOME:-/usr/local/cuda}/include"
if [[ ! -f "$cuda_inc/cuda_runtime.h" || ! -f "$cuda_inc/nccl.h" ]]; then
  echo "SKIP: no CUDA Toolkit / NCCL headers in $cuda_inc (set CUDA_HOME)"
  exit 77
fi
if [[ ! -f "$torch_inc/c10/cuda/CUDAStream.h" || ! -f "$torch_inc/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp" ]]; then
  echo "SKIP: $torch_inc has no c10/cuda or c10d NCCL headers"
  exit 77
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# A CPU LibTorch does not ship the header CMake generates for a CUDA build.
if [[ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
  mkdir -p "$tmp/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$tmp/c10/cuda/impl/cuda_cmake_macros.h"
fi

# The version header CMake generates from include/fsdp/version.h.in.
mkdir -p "$tmp/fsdp"
sed -e 's/@PROJECT_VERSION_MAJOR@/0/; s/@PROJECT_VERSION_MINOR@/0/; s/@PROJECT_VERSION_PATCH@/0/' \
    -e 's/@PROJECT_VERSION@/0.0.0/' include/fsdp/version.h.in > "$tmp/fsdp/version.h"

if [[ $all == 1 ]]; then
  mapfile -t files < <(ls src/*/*.cpp src/*/*/*.cpp checkpoint/*.cpp wrap_policies/*.cpp \
    examples/*/*.cpp tests/*.cpp tests/support/*.cpp tests/bench/*.cpp |
    grep -v -e no_nccl.cpp -e no_cuda_transfers.cpp -e no_gloo.cpp -e no_hdf5.cpp)
else
  files=(src/comm/nccl/backend_nccl.cpp src/engine/transfers_cuda.cpp)
fi

flags=(-std="$std" -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_DISTRIBUTED -DUSE_CUDA
       -DUSE_C10D_GLOO -DUSE_C10D_NCCL -DFSDP_SOURCE_DIR=\""$PWD"\" -Iinclude -Isrc -I.)
# /usr/include is searched anyway; naming it with -isystem would break #include_next.
[[ "$torch_inc" != /usr/include ]] && flags+=(-isystem "$torch_inc")
flags+=(-isystem "$torch_inc/torch/csrc/api/include" -isystem "$tmp" -isystem "$cuda_inc"
        -isystem /usr/include/hdf5/serial)
echo "checking ${#files[@]} files against $torch_inc ($std) and $cuda_inc"
export cxx
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -I{} sh -c '
  if out=$("$cxx" "$@" {} 2>&1); then echo "ok    {}"; else echo "FAIL  {}"; echo "$out" | grep -m 10 "error"; exit 1; fi
' sh "${flags[@]}" && echo "all ${#files[@]} compile" || { echo "some files do not compile"; exit 1; }
