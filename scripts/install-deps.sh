#!/usr/bin/env bash
# Installs every build, test and benchmark dependency from Debian 12's archive.
# Used by the README's setup command and by .ci/run, so both see the same machine.
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PACKAGES=(
  build-essential cmake ninja-build ccache
  libtorch-dev libgloo-dev          # LibTorch 1.13.1 (CPU) and the Gloo headers c10d needs
  libopenblas0-pthread              # LibTorch links libblas.so.3; without OpenBLAS it is the
                                    # reference BLAS, about 40x slower (see docs/benchmarks.md)
  libhdf5-dev                       # checkpoints
  libcxxopts-dev nlohmann-json3-dev # command-line flags and JSON config
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-h5py python3-torch # interop tests: h5py reader and torchrun
)
echo "[install-deps] apt-get update"
$SUDO apt-get update -qq
echo "[install-deps] installing ${#PACKAGES[@]} packages (LibTorch is large; this takes a few minutes)"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "[install-deps] done"
