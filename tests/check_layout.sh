#!/usr/bin/env bash
# The source layout's one rule (docs/design.md, "Source layout"): no folder reaches into
# another folder's private files. A quoted #include may name
#   - a file of the includer's own folder,
#   - the public API (include/fsdp/...), or
#   - a shared internal header (src/internal/...), except from the public API itself.
# Folders: include/fsdp, the engine (src and src/cuda), src/tools, src/internal,
# checkpoint, wrap_policies, and each example. An include is resolved as the compiler
# does: beside the includer first, then in include/, then in src/.
# Usage: tests/check_layout.sh [SOURCE_ROOT]; prints every violation, exits 1 if any.
set -euo pipefail
ROOT="$(cd "${1:-$(dirname "$0")/..}" && pwd -P)"
cd "$ROOT"

folder_of() {  # folder_of PATH (relative to ROOT) -> the folder it belongs to
  case "$1" in
    include/*) echo public ;;
    src/internal/*) echo internal ;;
    src/tools/*) echo tools ;;
    src/*) echo engine ;;
    checkpoint/*) echo checkpoint ;;
    wrap_policies/*) echo wrap_policies ;;
    examples/*/*) echo "example:$(echo "$1" | cut -d/ -f2)" ;;
    *) echo "other:$1" ;;
  esac
}

BAD=0
CHECKED=0
while IFS= read -r -d '' file; do
  own="$(folder_of "$file")"
  dir="$(dirname "$file")"
  while IFS= read -r inc; do
    CHECKED=$((CHECKED + 1))
    if [ -f "$dir/$inc" ]; then
      target="$(realpath --relative-to="$ROOT" "$dir/$inc")"
    elif [ -f "include/$inc" ]; then
      target="include/$inc"
    elif [ -f "src/$inc" ]; then
      target="src/$inc"
    else
      echo "check_layout: $file includes \"$inc\", which is in none of its folder, include/ or src/" >&2
      BAD=$((BAD + 1))
      continue
    fi
    to="$(folder_of "$target")"
    if [ "$to" = "$own" ] || [ "$to" = public ] || { [ "$to" = internal ] && [ "$own" != public ]; }; then
      continue
    fi
    echo "check_layout: $file (folder $own) includes \"$inc\" = $target, a private file of folder $to;" \
         "move what both need into src/internal/ (or the public API)" >&2
    BAD=$((BAD + 1))
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file")
done < <(find include src checkpoint wrap_policies examples -type f \
           \( -name '*.h' -o -name '*.cpp' -o -name '*.inc' \) -print0)

[ "$CHECKED" -gt 50 ] || { echo "check_layout: found only $CHECKED includes under $ROOT: wrong root?" >&2; exit 1; }
if [ "$BAD" -gt 0 ]; then
  echo "check_layout: $BAD include(s) cross a folder's boundary (of $CHECKED checked)" >&2
  exit 1
fi
echo "check_layout: $CHECKED quoted includes, none reaches into another folder's private files"
