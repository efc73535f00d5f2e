#!/usr/bin/env bash
# Enforces the layering tables of docs/design.md, "Layout" (read from there, so the
# document and this check cannot drift apart):
#   1. every file of the library lives in a folder of the folder table; directly in src/
#      only the files that table names there; every src/engine file has a rank;
#   2. a quoted #include, or an #include <fsdp/...>, names a file of a folder the
#      includer's folder may include (an example: its own folder, never another example's);
#   3. the facade (include/fsdp/fully_sharded_module.h and every header that includes it,
#      src/internal/model_view.h and its views among them) is included only by the folders whose
#      "Facade" column says yes, and inside src/engine only from the top rank;
#   4. inside src/engine a file includes engine files of its own rank or below;
#   5. src/comm and the engine below its top rank never name WrapPointImpl, ShardedModel
#      or EngineAccess: they do not know the public handles.
# An include is resolved as the compiler does: beside the includer first, then in
# include/, then in src/. tests/ may use anything and is not checked.
# Usage: tests/check_layout.sh [SOURCE_ROOT]; prints every violation, exits 1 if any.
set -euo pipefail
ROOT="$(cd "${1:-$(dirname "$0")/..}" && pwd -P)"
cd "$ROOT"
DOC=docs/design.md
[ -f "$DOC" ] || { echo "check_layout: no $DOC under $ROOT" >&2; exit 1; }

# The rows of the table after the marker line `<!-- layering: NAME -->`, one per line,
# cells separated by '|' (the header and rule rows dropped).
table() {
  awk -v m="<!-- layering: $1 -->" '
    $0 == m { on = 1; next }
    on && /^\|/ { if (++n > 2) print; next }
    on && n > 0 { exit }' "$DOC"
}
ticks() { grep -o '`[^`]*`' <<<"$1" | tr -d '`' || true; }  # the backticked words of a cell

declare -A MAY FACADE_OK ROOT_FILES RANK
FOLDERS=()
while IFS='|' read -r _ folder holds may facade _; do
  f="$(ticks "$folder")"
  [ -n "$f" ] || continue
  FOLDERS+=("$f")
  MAY[$f]=" $(ticks "$may" | tr '\n' ' ')"
  case "$facade" in *yes*) FACADE_OK[$f]=1 ;; esac
  if [ "$f" = src ]; then
    for h in $(ticks "$holds"); do ROOT_FILES[$h]=1; done
  fi
done < <(table folders)
TOP_RANK=-1
while IFS='|' read -r _ rank files _; do
  r="$(tr -dc '0-9' <<<"$rank")"
  [ -n "$r" ] || continue
  for pat in $(ticks "$files"); do RANK[$pat]=$r; done
  [ "$r" -gt "$TOP_RANK" ] && TOP_RANK=$r
done < <(table engine)
[ "${#FOLDERS[@]}" -ge 8 ] && [ "$TOP_RANK" -ge 1 ] ||
  { echo "check_layout: could not read the layering tables from $DOC (markers <!-- layering: folders|engine -->)" >&2; exit 1; }

BAD=0
bad() { echo "check_layout: $*" >&2; BAD=$((BAD + 1)); }

folder_of() {  # the table folder holding PATH: the longest matching one ('examples/*' matches each example)
  local best="" f
  for f in "${FOLDERS[@]}"; do
    case "$f" in
      'examples/*') [[ "$1" == examples/*/* ]] && [ -z "$best" ] && best="$f" ;;
      src) [[ "$1" == src/* && "$1" != src/*/* ]] && [ -z "$best" ] && best=src ;;
      *) [[ "$1" == "$f"/* ]] && [ "${#f}" -gt "${#best}" ] && best="$f" ;;
    esac
  done
  echo "$best"
}
example_of() { cut -d/ -f2 <<<"$1"; }
rank_of() {  # rank of an engine file: its name, or its stem with '.*'
  local b
  b="$(basename "$1")"
  if [ -n "${RANK[$b]:-}" ]; then echo "${RANK[$b]}"; elif [ -n "${RANK[${b%.*}.*]:-}" ]; then echo "${RANK[${b%.*}.*]}"; fi
}

mapfile -d '' FILES < <(find include src checkpoint wrap_policies examples -type f \
  \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.inc' -o -name '*.cu' \) -print0 | sort -z)

# Rule 1, and each file's folder.
declare -A FOLDER
for file in "${FILES[@]}"; do
  f="$(folder_of "$file")"
  if [ -z "$f" ]; then
    bad "$file is in no folder of the layering table ($DOC, \"Layout\"): move it into the folder of its concept"
    continue
  fi
  if [ "$f" = src ] && [ -z "${ROOT_FILES[$(basename "$file")]:-}" ]; then
    bad "$file sits directly in src/, which holds only $(echo "${!ROOT_FILES[@]}"): move it into the folder of its concept"
    continue
  fi
  if [ "$f" = src/engine ] && [ -z "$(rank_of "$file")" ]; then
    bad "$file has no rank in the engine table ($DOC): give it one"
  fi
  FOLDER[$file]="$f"
done

# Every resolved include, as "includer<TAB>included".
resolve() {  # resolve INCLUDER NAME -> path relative to ROOT, or nothing
  local dir
  dir="$(dirname "$1")"
  if [ -f "$dir/$2" ]; then realpath --relative-to="$ROOT" "$dir/$2"
  elif [ -f "include/$2" ]; then echo "include/$2"
  elif [ -f "include/$2.in" ]; then echo "include/$2.in"  # configured into the build tree (version.h)
  elif [ -f "src/$2" ]; then echo "src/$2"
  elif [ -f "$2" ]; then echo "$2"  # from the project's root (the tools' "checkpoint/offline/offline.h")
  fi
}
EDGES=()
CHECKED=0
for file in "${FILES[@]}"; do
  while IFS= read -r inc; do
    CHECKED=$((CHECKED + 1))
    target="$(resolve "$file" "$inc")"
    if [ -z "$target" ]; then
      bad "$file includes \"$inc\", which is in none of its folder, include/ or src/"
      continue
    fi
    EDGES+=("$file	$target")
  done < <(sed -n -e 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' \
                  -e 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*<\(fsdp\/[^>]*\)>.*/\1/p' "$file")
done

# The facade: fully_sharded_module.h and, transitively, every header of the public API or
# src/internal that includes it (a header elsewhere that includes it is itself reported).
declare -A FACADE=([include/fsdp/fully_sharded_module.h]=1)
grown=1
while [ "$grown" = 1 ]; do
  grown=0
  for e in "${EDGES[@]}"; do
    from="${e%%	*}" to="${e#*	}"
    if [ -n "${FACADE[$to]:-}" ] && [ -z "${FACADE[$from]:-}" ] && [[ "$from" == *.h ]] &&
       [[ "$from" == include/* || "$from" == src/internal/* ]]; then
      FACADE[$from]=1
      grown=1
    fi
  done
done

for e in "${EDGES[@]}"; do
  from="${e%%	*}" to="${e#*	}"
  own="${FOLDER[$from]:-}" theirs="${FOLDER[$to]:-}"
  [ -n "$own" ] && [ -n "$theirs" ] || continue
  # Rule 2 (an example's own files are its folder's; another example's are never).
  if [ "$theirs" = 'examples/*' ]; then
    if [ "$own" != 'examples/*' ] || [ "$(example_of "$from")" != "$(example_of "$to")" ]; then
      bad "$from includes $to, a file of another example: an example includes the public API, what examples share and its own files"
      continue
    fi
  elif [[ "${MAY[$own]}" != *" $theirs "* ]]; then
    bad "$from ($own) includes $to ($theirs), but $own may include only$(sed 's/ \(.*\) $/ \1/; s/ \([^ ]\)/, \1/g; s/^,//' <<<"${MAY[$own]}")"
    continue
  fi
  # Rule 3.
  if [ -n "${FACADE[$to]:-}" ] && [ -z "${FACADE[$from]:-}" ]; then
    if [ -z "${FACADE_OK[$own]:-}" ]; then
      bad "$from ($own) includes $to, which is (or includes) the public module header: $own sits below the engine's facade"
    elif [ "$own" = src/engine ] && [ "$(rank_of "$from")" != "$TOP_RANK" ]; then
      bad "$from (engine rank $(rank_of "$from")) includes $to, which is (or includes) the public module header: only the engine's top rank ($TOP_RANK) knows the public handles"
    fi
  fi
  # Rule 4.
  if [ "$own" = src/engine ] && [ "$theirs" = src/engine ]; then
    rf="$(rank_of "$from")" rt="$(rank_of "$to")"
    if [ -n "$rf" ] && [ -n "$rt" ] && [ "$rt" -gt "$rf" ]; then
      bad "$from (engine rank $rf) includes $to (rank $rt): calls run down the ranks, never up"
    fi
  fi
done

# Rule 5.
for file in "${FILES[@]}"; do
  own="${FOLDER[$file]:-}"
  if [ "$own" = src/comm ] || { [ "$own" = src/engine ] && [ "$(rank_of "$file")" != "$TOP_RANK" ]; }; then
    # Comments aside (// to the end of the line).
    names="$(sed 's@//.*@@' "$file" | grep -o -w -E 'WrapPointImpl|ShardedModel|EngineAccess' | sort -u | tr '\n' ' ' || true)"
    if [ -n "$names" ]; then
      bad "$file ($own$( [ "$own" = src/engine ] && echo ", rank $(rank_of "$file")")) names ${names% }: only the engine's top rank knows the public handles"
    fi
  fi
done

# Rule 6.
declare -A OWNER
for h in include/fsdp/*.h include/fsdp/tools/*.h; do
  o="$(sed -n 's@^// Implemented in \([a-z_/]*\)\.$@\1@p' "$h" | head -1)"
  if [ -z "$o" ]; then
    impl="$(find src checkpoint wrap_policies -name "$(basename "$h" .h).cpp" | head -1)"
    [ -z "$impl" ] || o="${FOLDER[$impl]:-}"
  fi
  [ -z "$o" ] || OWNER[$h]="$o"
done
declare -A HANDLE
for h in "${!OWNER[@]}"; do
  grep -q '^// A public handle: every folder may use it\.$' "$h" && HANDLE[$h]=1
done
for e in "${EDGES[@]}"; do
  from="${e%%	*}" to="${e#*	}"
  theirs="${OWNER[$to]:-}"
  [ -n "$theirs" ] && [ -z "${HANDLE[$to]:-}" ] || continue
  if [[ "$from" == include/* ]]; then
    own="${OWNER[$from]:-}"
    [ -n "$own" ] || continue  # a header of declarations (or fsdp.h, which includes all)
    as="$from (as part of $own, which implements it)"
  else
    own="${FOLDER[$from]:-}"
    [ -n "$own" ] && [ "$own" != 'examples/*' ] && [ "$own" != examples/common ] && [ "$own" != src/tools ] || continue
    as="$from ($own)"
  fi
  [ "$own" != "$theirs" ] || continue
  if [ "$to" = include/fsdp/fully_sharded_module.h ]; then
    [ -n "${FACADE_OK[$own]:-}" ] || bad "$as includes the public module header, implemented in $theirs: $own sits below the engine's facade"
    continue
  fi
  if [[ "${MAY[$own]}" != *" $theirs "* ]]; then
    bad "$as includes $to, implemented in $theirs, but $own may include only$(sed 's/ \(.*\) $/ \1/; s/ \([^ ]\)/, \1/g; s/^,//' <<<"${MAY[$own]}")"
  fi
done

[ "$CHECKED" -gt 50 ] || { echo "check_layout: found only $CHECKED includes under $ROOT: wrong root?" >&2; exit 1; }
if [ "$BAD" -gt 0 ]; then
  echo "check_layout: $BAD violation(s) of the layering in $DOC (of $CHECKED includes checked)" >&2
  exit 1
fi
echo "check_layout: ${#FILES[@]} files in ${#FOLDERS[@]} folders, $CHECKED includes: every one follows the layering of $DOC"
