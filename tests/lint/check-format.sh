#!/usr/bin/env bash
# Checks that every C++ source of the project is formatted as .clang-format says, by
# clang-format 14 (Debian 12's: other versions break some lines differently, so the check
# pins one; scripts/install-deps.sh installs it). CI runs it.
#
#   tests/lint/check-format.sh          # names each file that differs and exits 1 if any
#   tests/lint/check-format.sh --fix    # formats those files in place
#
# FSDP_CLANG_FORMAT names another clang-format 14 binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
FIX=0
case "${1:-}" in
  --fix) FIX=1 ;;
  "") ;;
  *) echo "check-format: unknown option '$1' (expected --fix or nothing)" >&2; exit 2 ;;
esac
CF="${FSDP_CLANG_FORMAT:-$(command -v clang-format-14 || true)}"
if [ -z "$CF" ] || ! "$CF" --version 2>/dev/null | grep -q 'version 14\.'; then
  echo "check-format: needs clang-format 14 (found: ${CF:-none}${CF:+, $("$CF" --version 2>/dev/null | head -1)}); on Debian 12:" \
       "apt-get install clang-format-14 (scripts/install-deps.sh does), or set FSDP_CLANG_FORMAT" >&2
  exit 1
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t FILES < <(git ls-files -co --exclude-standard '*.cpp' '*.h' '*.hpp' '*.inc' '*.cu')
else
  mapfile -t FILES < <(find include src checkpoint wrap_policies examples tests -type f \
                         \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.inc' -o -name '*.cu' \) | sort)
fi
[ "${#FILES[@]}" -gt 50 ] || { echo "check-format: found only ${#FILES[@]} sources: wrong directory?" >&2; exit 1; }
if [ "$FIX" = 1 ]; then
  "$CF" -i --style=file "${FILES[@]}"
  echo "check-format: formatted ${#FILES[@]} files"
  exit 0
fi
BAD=()
for f in "${FILES[@]}"; do
  if ! "$CF" --style=file "$f" | cmp -s - "$f"; then BAD+=("$f"); fi
done
if [ "${#BAD[@]}" -gt 0 ]; then
  echo "check-format: ${#BAD[@]} of ${#FILES[@]} files differ from .clang-format (tests/lint/check-format.sh --fix formats them):" >&2
  printf '  %s\n' "${BAD[@]}" >&2
  exit 1
fi
echo "check-format: ${#FILES[@]} files, all formatted as .clang-format says (clang-format $("$CF" --version | grep -o 'version [0-9.]*' | cut -d' ' -f2))"
