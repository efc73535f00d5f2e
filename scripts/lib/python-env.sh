# Which LibTorch the build uses, and the project's Python environment. Sourced by
# scripts/setup.sh, scripts/test.sh, scripts/ci/sanitize.sh, scripts/demo.sh and the other
# scripts that build or run Python. Provides:
#
#   fsdp_torch_setup   picks the LibTorch and fills
#                        TORCH_CMAKE_ARGS  CMake arguments that select it (an array)
#                        FSDP_PY           the Python the tests and demo run (with torch)
#                      and exports FSDP_PY.
#
# The LibTorch, from FSDP_TORCH:
#   pypi (the default)  PyPI's torch, pinned in scripts/requirements.txt, in .venv/ of the
#                       checkout (made here with Debian's python3 -m venv, reused while
#                       requirements.txt and this file are unchanged). The wheel is a CUDA
#                       build: CMake needs a CUDA toolkit of the release it was built with
#                       (torch.version.cuda), so the nvcc of that release is installed from
#                       PyPI beside it and .venv/fsdp/cuda lays the wheels out as a toolkit
#                       (bin, include, lib64). The wheel has no Gloo headers, which c10d's
#                       ProcessGroupGloo.hpp includes: they come from Debian's libgloo-dev
#                       (FSDP_GLOO_SUITE, default forky: the newest gloo Debian has; the
#                       suite's package is downloaded with apt and verified, never
#                       installed), into .venv/fsdp/gloo.
#   system              whatever CMake finds: Debian's libtorch-dev (scripts/ci/in-debian13.sh
#                       uses it), or a pytorch.org LibTorch named by CMAKE_PREFIX_PATH or
#                       Torch_DIR in the environment. The tests' Python is /usr/bin/python3.
# Unset, FSDP_TORCH is `system` when CMAKE_PREFIX_PATH or Torch_DIR is set or inside
# scripts/ci/in-debian13.sh, and `pypi` otherwise.
# shellcheck shell=bash

FSDP_VENV="${FSDP_VENV:-$PWD/.venv}"

fsdp_env_fail() { echo "python-env: FAILED: $*" >&2; exit 1; }

# The site-packages directory of the venv's Python.
fsdp_site_packages() { "$FSDP_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

fsdp_make_venv() {
  local stamp want
  want="$(cat scripts/requirements.txt scripts/lib/python-env.sh | sha256sum | cut -c1-16)"
  stamp="$FSDP_VENV/.fsdp-stamp"
  if [ -x "$FSDP_VENV/bin/python" ] && "$FSDP_VENV/bin/python" -c 'import sys' 2>/dev/null &&
     [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  local base=/usr/bin/python3
  [ -x "$base" ] || base="$(command -v python3 || true)"
  [ -n "$base" ] || fsdp_env_fail "no python3 to make $FSDP_VENV with (scripts/install-deps.sh installs Debian's)"
  if ! [ -x "$FSDP_VENV/bin/python" ] || ! "$FSDP_VENV/bin/python" -c 'import sys' 2>/dev/null; then
    echo "[python-env] making $FSDP_VENV with $base ($("$base" --version 2>&1))"
    rm -rf "$FSDP_VENV"
    "$base" -m venv "$FSDP_VENV" ||
      fsdp_env_fail "$base -m venv $FSDP_VENV failed (on Debian: apt-get install python3-venv, or run scripts/install-deps.sh)"
  fi
  echo "[python-env] pip install -r scripts/requirements.txt into $FSDP_VENV (torch with its CUDA libraries: a few GB the first time)"
  # deepspeed last (its setup.py imports torch), with DS_BUILD_OPS=0: see requirements.txt.
  "$FSDP_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -r <(grep -v '^deepspeed' scripts/requirements.txt) ||
    fsdp_env_fail "pip could not install scripts/requirements.txt (is PyPI reachable?)"
  local ds
  ds="$(grep '^deepspeed' scripts/requirements.txt || true)"
  if [ -n "$ds" ]; then
    DS_BUILD_OPS=0 "$FSDP_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation "$ds" ||
      fsdp_env_fail "pip could not install $ds (DS_BUILD_OPS=0, --no-build-isolation; is PyPI reachable?)"
  fi
  fsdp_cuda_toolkit
  fsdp_gloo_headers
  echo "$want" >"$stamp"
}

# The CUDA toolkit of the wheel's own CUDA release, from PyPI: nvcc, its compiler parts
# (nvvm, crt) at exactly the version of the wheel's CUDA runtime, so headers, nvcc and the
# libraries LibTorch loads are one release. A CPU-only torch needs none.
fsdp_cuda_toolkit() {
  local py="$FSDP_VENV/bin/python" cuda major rt sp src dst f b
  cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
  [ -n "$cuda" ] || { rm -rf "$FSDP_VENV/fsdp/cuda"; return 0; }
  major="${cuda%%.*}"
  rt="$("$py" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime"))' 2>/dev/null || true)"
  [ -n "$rt" ] || fsdp_env_fail "torch $("$py" -c 'import torch; print(torch.__version__)') is built with CUDA $cuda" \
    "but the nvidia-cuda-runtime wheel is not installed; this script knows the cu${major} layout of CUDA 13's wheels only"
  case "$rt" in "$cuda".*) ;; *) fsdp_env_fail "torch says CUDA $cuda but nvidia-cuda-runtime is $rt" ;; esac
  echo "[python-env] torch is built with CUDA $cuda: installing nvcc $rt from PyPI (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt)"
  "$py" -m pip install -q --disable-pip-version-check "nvidia-cuda-nvcc==$rt" "nvidia-nvvm==$rt" "nvidia-cuda-crt==$rt" ||
    fsdp_env_fail "pip could not install nvcc $rt (nvidia-cuda-nvcc==$rt) to match torch's CUDA $cuda"
  sp="$(fsdp_site_packages)"
  src="$sp/nvidia/cu$major"
  [ -x "$src/bin/nvcc" ] || fsdp_env_fail "no nvcc at $src/bin/nvcc after installing nvidia-cuda-nvcc==$rt"
  # The layout CMake's FindCUDAToolkit (and LibTorch's FindCUDA) expect: bin, include,
  # nvvm, and lib64 with the unversioned names a link step asks for.
  dst="$FSDP_VENV/fsdp/cuda"
  rm -rf "$dst"
  mkdir -p "$dst/lib64"
  for f in bin include nvvm; do ln -s "$src/$f" "$dst/$f"; done
  for f in "$src"/lib/*.so.* "$src"/lib/*.a; do
    [ -e "$f" ] || continue
    b="$(basename "$f")"
    ln -sf "$f" "$dst/lib64/$b"
    case "$b" in *.so.*) ln -sf "$f" "$dst/lib64/${b%%.so.*}.so" ;; esac
  done
  "$dst/bin/nvcc" --version | tail -1 | sed 's/^/[python-env] nvcc: /'
}

# Gloo's headers for c10d's ProcessGroupGloo.hpp: Debian's libgloo-dev of FSDP_GLOO_SUITE,
# downloaded by apt with its own lists (signatures checked as for any install), unpacked
# into .venv/fsdp/gloo. Nothing is installed into the system.
fsdp_gloo_headers() {
  local suite="${FSDP_GLOO_SUITE:-forky}" mirror="${FSDP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  local tmp dst="$FSDP_VENV/fsdp/gloo" keyring=/usr/share/keyrings/debian-archive-keyring.gpg deb
  [ -f "$keyring" ] || fsdp_env_fail "no $keyring to verify Debian's gloo package with (apt-get install debian-archive-keyring)"
  tmp="$(mktemp -d)"
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  echo "deb [signed-by=$keyring] $mirror $suite main" >"$tmp/sources.list"
  local apt=(apt-get -q -o Dir::Etc::SourceList="$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$tmp/lists" -o Dir::Cache="$tmp/cache" -o APT::Sandbox::User=root)
  echo "[python-env] Gloo's headers: libgloo-dev from Debian $suite ($mirror)"
  if ! (cd "$tmp" && "${apt[@]}" update >"$tmp/apt.log" 2>&1 && "${apt[@]}" download libgloo-dev >>"$tmp/apt.log" 2>&1); then
    tail -5 "$tmp/apt.log" >&2
    rm -rf "$tmp"
    fsdp_env_fail "could not download libgloo-dev from Debian $suite; set FSDP_GLOO_SUITE or FSDP_DEBIAN_MIRROR"
  fi
  deb="$(ls "$tmp"/libgloo-dev_*.deb)"
  rm -rf "$dst"
  mkdir -p "$dst"
  dpkg-deb -x "$deb" "$tmp/x" && mv "$tmp/x/usr/include" "$dst/include" ||
    fsdp_env_fail "could not unpack $deb"
  echo "[python-env] gloo: $(basename "$deb") -> $dst/include"
  rm -rf "$tmp"
}

fsdp_torch_setup() {
  local mode="${FSDP_TORCH:-}"
  if [ -z "$mode" ]; then
    if [ -n "${CMAKE_PREFIX_PATH:-}" ] || [ -n "${Torch_DIR:-}" ] || [ -n "${FSDP_IN_DEBIAN13:-}" ]; then
      mode=system
    else
      mode=pypi
    fi
  fi
  TORCH_CMAKE_ARGS=()
  case "$mode" in
    pypi)
      fsdp_make_venv
      FSDP_PY="$FSDP_VENV/bin/python"
      local prefix
      prefix="$("$FSDP_PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" ||
        fsdp_env_fail "torch does not import in $FSDP_VENV"
      TORCH_CMAKE_ARGS=(-DCMAKE_PREFIX_PATH="$prefix" -DFSDP_PYTHON="$FSDP_PY")
      if [ -d "$FSDP_VENV/fsdp/cuda" ]; then
        local t="$FSDP_VENV/fsdp/cuda"
        TORCH_CMAKE_ARGS+=(-DCUDAToolkit_ROOT="$t" -DCUDA_TOOLKIT_ROOT_DIR="$t" -DCMAKE_CUDA_COMPILER="$t/bin/nvcc")
      fi
      [ -f "$FSDP_VENV/fsdp/gloo/include/gloo/algorithm.h" ] ||
        fsdp_env_fail "no Gloo headers in $FSDP_VENV/fsdp/gloo (remove $FSDP_VENV/.fsdp-stamp and rerun)"
      TORCH_CMAKE_ARGS+=(-DGLOO_INCLUDE_DIR="$FSDP_VENV/fsdp/gloo/include")
      ;;
    system)
      FSDP_PY=/usr/bin/python3
      [ -x "$FSDP_PY" ] || FSDP_PY="$(command -v python3 || echo python3)"
      TORCH_CMAKE_ARGS=(-DFSDP_PYTHON="$FSDP_PY")
      ;;
    *) fsdp_env_fail "FSDP_TORCH='$mode': expected pypi (PyPI's torch in .venv, the default) or system (the LibTorch CMake finds)" ;;
  esac
  export FSDP_PY
  echo "[python-env] LibTorch: $mode; Python for the tests: $FSDP_PY"
}
