#!/usr/bin/env bash
# Fails when ctest lists a parameterised test with GoogleTest's raw bytes for its value
# ("# GetParam() = 64-byte object <40-CC ...>"): each parameter type needs a PrintTo.
#   tests/check_test_names.sh CTEST BUILD_DIR
set -euo pipefail
list="$("$1" --test-dir "$2" -N)"
n="$(grep -c 'Test *#' <<<"$list" || true)"
[ "$n" -gt 100 ] || { echo "check_test_names: only $n tests listed in $2: wrong build directory?" >&2; exit 1; }
if bad="$(grep 'byte object' <<<"$list")"; then
  echo "check_test_names: these tests are listed with raw bytes; give their parameter type a PrintTo:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "check_test_names: $n tests, each listed readably"
