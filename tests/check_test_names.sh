#!/usr/bin/env bash
# Fails when a test binary lists a parameterised test with GoogleTest's raw bytes for its
# value ("# GetParam() = 64-byte object <40-CC ...>"): each parameter type needs a PrintTo.
# The binaries list their cases themselves (--gtest_list_tests): ctest has one entry per
# test file, not per case (tests/CMakeLists.txt, FSDP_TEST_EACH_CASE).
#   tests/check_test_names.sh TEST_BINARY...
set -euo pipefail
[ $# -gt 0 ] || { echo "check_test_names: no test binary given" >&2; exit 1; }
list=""
for bin in "$@"; do
  list+="$("$bin" --gtest_list_tests | sed "s|^|$(basename "$bin"): |")"$'\n'
done
n="$(grep -c ':   ' <<<"$list" || true)"
[ "$n" -gt 100 ] || { echo "check_test_names: only $n tests listed by $*: wrong binaries?" >&2; exit 1; }
if bad="$(grep 'byte object' <<<"$list")"; then
  echo "check_test_names: these tests are listed with raw bytes; give their parameter type a PrintTo:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "check_test_names: $n tests in $# binaries, each listed readably"
