#!/usr/bin/env bash
# Installs every build, test and benchmark dependency from Debian's archive (Debian 12 or
# 13, the same names). Used by the README's setup command, by .ci/run and by
# scripts/ci/in-debian13.sh, so all of them see the same machine: this is the one package
# list. LibTorch itself is not among them by default: the build uses PyPI's torch
# (scripts/requirements.txt), which scripts/lib/python-env.sh installs into .venv/.
#
#   scripts/install-deps.sh                 # build tools and libraries; python3-venv
#   scripts/install-deps.sh --debian-torch  # also Debian's LibTorch: libtorch-dev (2.6 on
#                                           # Debian 13; Debian 12's 1.13 is too old),
#                                           # its Gloo headers and Python packages
set -euo pipefail
DEBIAN_TORCH=0
case "${1:-}" in
  --debian-torch) DEBIAN_TORCH=1 ;;
  "") ;;
  *) echo "install-deps: unknown option '$1' (expected --debian-torch or nothing)" >&2; exit 2 ;;
esac
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
CODENAME="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"

COMMON=(
  build-essential cmake ninja-build ccache
  mold                              # the linker (CMakeLists.txt, FSDP_LINKER): each binary links LibTorch
  file dpkg-dev                     # cpack -G DEB (scripts/release/deb-check.sh): file, dpkg-shlibdeps
  libhdf5-dev                       # checkpoints
  libcxxopts-dev nlohmann-json3-dev # command-line flags and JSON config
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv              # the project's Python environment (.venv, PyPI's torch)
  debian-archive-keyring            # verifies Debian's gloo headers (scripts/lib/python-env.sh)
  fortunes                          # the demo's English text (quotations; BSD licence)
  iproute2                          # the two-host test's network namespaces (tests/multihost)
  liburing-dev                      # the NVMe offload's io_uring (src/nvme; else a thread pool)
  fio                               # bench_nvme's baseline: the disk's own O_DIRECT throughput
)
DEBIAN_TORCH_PKGS=(
  libtorch-dev libgloo-dev          # LibTorch (CPU) and the Gloo headers c10d needs
  libopenblas0-pthread              # LibTorch links libblas.so.3; without OpenBLAS it is the
                                    # reference BLAS, about 40x slower (see docs/benchmarks.md)
  python3-torch python3-h5py        # torchrun, torch's FSDP and h5py for the interop tests
  python3-safetensors               # the reference safetensors reader
)
PACKAGES=("${COMMON[@]}")
# The format check (tests/lint/check-format.sh) pins Debian 12's clang-format.
[ "$CODENAME" = bookworm ] && PACKAGES+=(clang-format-14)
if [ "$DEBIAN_TORCH" = 1 ]; then
  if [ "$CODENAME" != trixie ]; then
    echo "install-deps: --debian-torch needs Debian 13 (trixie): Debian ${CODENAME:-?}'s LibTorch is older than 2.6," \
         "the oldest supported; run it through scripts/ci/in-debian13.sh, or use PyPI's torch (the default)" >&2
    exit 2
  fi
  PACKAGES+=("${DEBIAN_TORCH_PKGS[@]}")
fi

echo "[install-deps] apt-get update"
$SUDO apt-get update -qq
echo "[install-deps] installing ${#PACKAGES[@]} packages on Debian ${CODENAME:-?}$([ "$DEBIAN_TORCH" = 1 ] && echo ', with its LibTorch')"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "[install-deps] done"
