# Sourced by the scripts that build: configure through a preset of CMakePresets.json with
# the LibTorch that scripts/lib/python-env.sh found (TORCH_CMAKE_ARGS; source that and call
# fsdp_torch_setup first), and test; they build with plain `cmake --build DIR`. One place for what used to be a hand-written
# `cmake -S . -B ... -G Ninja -DCMAKE_BUILD_TYPE=... -j2` in each script.
#
# Jobs: CMAKE_BUILD_PARALLEL_LEVEL and CTEST_PARALLEL_LEVEL, which cmake --build and ctest
# read; by default every core (nproc: 2 on the CI machine, as before).
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export CTEST_PARALLEL_LEVEL="${CTEST_PARALLEL_LEVEL:-$(nproc)}"

# fsdp_configure PRESET DIR [cmake arguments...]: the preset's settings, in DIR (the
# preset's own directory unless the caller chose another, e.g. FSDP_BUILD_DIR).
fsdp_configure() {
  local preset="$1" dir="$2"
  shift 2
  cmake --preset "$preset" -B "$dir" "${TORCH_CMAKE_ARGS[@]}" "$@"
}

# fsdp_ctest DIR [ctest arguments...]
# OpenBLAS (Debian's LibTorch uses it) starts a thread per core in every process that
# loads it, and its threads spin: with ctest running a test per core, each of several rank
# processes, that oversubscribed the cores, and a test process with a thread more cannot
# fork its ranks (tests/support/multirank.cpp). One thread each, unless the caller says.
fsdp_ctest() {
  local dir="$1"
  shift
  OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" ctest --test-dir "$dir" --output-on-failure "$@"
}
