#!/usr/bin/env bash
# Installs every build, test and benchmark dependency from Debian's archive: Debian 12
# (LibTorch 1.13, HDF5 1.10) or Debian 13 (LibTorch 2.6, HDF5 1.14), the same names.
# Used by the README's setup command, by .ci/run and by scripts/in-debian13.sh, so all
# of them see the same machine: this is the one package list.
#
#   scripts/install-deps.sh          # CPU LibTorch
#   scripts/install-deps.sh --cuda   # Debian 13 only: the CUDA LibTorch (contrib), NCCL and
#                                    # the CUDA toolkit (non-free), to compile and link the
#                                    # CUDA build (scripts/cuda-link-check.sh)
set -euo pipefail
CUDA=0
case "${1:-}" in
  --cuda) CUDA=1 ;;
  "") ;;
  *) echo "install-deps: unknown option '$1' (expected --cuda or nothing)" >&2; exit 2 ;;
esac
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
CODENAME="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"

COMMON=(
  build-essential cmake ninja-build ccache
  libhdf5-dev                       # checkpoints
  libcxxopts-dev nlohmann-json3-dev # command-line flags and JSON config
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-h5py              # interop tests: the h5py reader
  python3-matplotlib                # scripts/compare-pytorch.sh: the pictures
  fortunes                          # the demo's English text (quotations; BSD licence)
)
CPU=(
  libtorch-dev libgloo-dev          # LibTorch (CPU) and the Gloo headers c10d needs
  libopenblas0-pthread              # LibTorch links libblas.so.3; without OpenBLAS it is the
                                    # reference BLAS, about 40x slower (see docs/benchmarks.md)
  python3-torch                     # torchrun, and torch's own rounding in the interop tests
)
CUDA_PKGS=(
  libtorch-cuda-dev                 # contrib: LibTorch 2.6 built with CUDA and NCCL
  libgloo-cuda-dev                  # the Gloo headers of that build (replaces libgloo-dev)
  libnccl-dev                       # contrib: NCCL
  nvidia-cuda-toolkit               # non-free: nvcc and the CUDA libraries Torch's CMake looks for
)
if [ "$CUDA" = 1 ]; then
  if [ "$CODENAME" != trixie ]; then
    echo "install-deps: --cuda needs Debian 13 (trixie), this is '${CODENAME:-unknown}'; run it through" \
         "scripts/in-debian13.sh --cuda" >&2
    exit 2
  fi
  PACKAGES=("${COMMON[@]}" "${CUDA_PKGS[@]}")
else
  PACKAGES=("${COMMON[@]}" "${CPU[@]}")
fi

# The reference safetensors reader (the interop test of the safetensors exports; Debian
# 12 has no package of it, and the test says it skips there).
if [ "$CODENAME" = trixie ]; then PACKAGES+=(python3-safetensors); fi

if [ "$CODENAME" = trixie ] && [ "$CUDA" = 1 ]; then
  # contrib and non-free hold the CUDA packages.
  echo "[install-deps] enabling contrib and non-free in apt's sources (the CUDA packages live there)"
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/debian.sources; do
    [ -f "$f" ] || continue
    $SUDO sed -i -E '/^(deb|Components:)/{/contrib/! s/(main)( |$)/\1 contrib non-free\2/}' "$f"
  done
fi

echo "[install-deps] apt-get update"
$SUDO apt-get update -qq
echo "[install-deps] installing ${#PACKAGES[@]} packages on Debian ${CODENAME:-?}$([ "$CUDA" = 1 ] && echo ' (CUDA)')" \
     "(LibTorch is large; this takes a few minutes)"
if [ "$CUDA" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
else
  # nvidia-cudnn, a dependency of libtorch-cuda-2.6, is an installer: when configured it
  # downloads cuDNN from NVIDIA's site. Where that site cannot be reached, its
  # configuration fails and leaves it, libtorch-cuda-2.6 and libtorch-cuda-dev unpacked
  # but unconfigured: their files are in place, only libcudnn.so.9 is missing. The link
  # check accepts exactly that; any other failure is an error.
  LOG=/tmp/install-deps-cuda.log
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >$LOG 2>&1; then
    BAD="$(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' | awk '$1 != "ii" && $1 != "rc" {print $2}' | sort)"
    ALLOWED="$(printf '%s\n' nvidia-cudnn libtorch-cuda-2.6 libtorch-cuda-dev | sort)"
    if [ -z "$BAD" ] || [ -n "$(comm -23 <(echo "$BAD") <(echo "$ALLOWED"))" ]; then
      tail -30 $LOG >&2
      echo "install-deps: FAILED: apt-get install (CUDA) failed; packages not configured: ${BAD:-none}" >&2
      exit 1
    fi
    echo "[install-deps] note: left unconfigured because cuDNN's installer could not download cuDNN:" $BAD
    [ -e /usr/lib/x86_64-linux-gnu/libtorch_cuda.so ] || { echo "install-deps: FAILED: libtorch_cuda.so is missing" >&2; exit 1; }
  fi
fi
echo "[install-deps] done"
