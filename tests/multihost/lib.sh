# shellcheck shell=bash
# Shared by the tests/multihost scripts (sourced): two "hosts" made as network namespaces
# joined by a veth link, torn down on any exit; ranks started in them with their time to
# exit recorded. Needs root and iproute2; without them the caller exits 77 (ctest: skipped).
#   mh_setup NAME SUBNET   e.g. mh_setup link_cut 10.9.3  (hosts SUBNET.1 and SUBNET.2)
# sets H1 H2 (namespaces), L1 L2 (the link's two ends), A1 A2 (addresses), OUT (scratch).

mh_cleanup() {
  local pid h
  for pid in "${MH_PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  # What still runs inside the two hosts was started here (ranks, torchrun's agents):
  # deleting a namespace does not end its processes.
  for h in "$H1" "$H2"; do
    for pid in $(ip netns pids "$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  ip netns del "$H1" 2>/dev/null || true
  ip netns del "$H2" 2>/dev/null || true
  [ -n "${OUT:-}" ] && [ -z "${MH_KEEP:-}" ] && rm -rf "$OUT"
}

mh_setup() {
  local name="$1" subnet="$2"
  MH_PIDS=()
  [ "$(id -u)" = 0 ] || { echo "$name: needs root for network namespaces; skipped"; exit 77; }
  command -v ip >/dev/null || { echo "$name: needs ip (iproute2); skipped"; exit 77; }
  local tag="fsdpmn$$"
  H1="${tag}a" H2="${tag}b" L1="${tag}x" L2="${tag}y" A1="$subnet.1" A2="$subnet.2"
  OUT="$(mktemp -d "/tmp/fsdp-$name.XXXXXX")"
  trap mh_cleanup EXIT
  trap 'exit 130' INT TERM
  if ! ip netns add "$H1" 2>"$OUT/ns.err"; then
    echo "$name: cannot make network namespaces here ($(cat "$OUT/ns.err")); skipped"
    exit 77
  fi
  ip netns add "$H2"
  if ! ip link add "$L1" type veth peer name "$L2" 2>"$OUT/veth.err"; then
    echo "$name: cannot make a veth link here ($(cat "$OUT/veth.err")); skipped"
    exit 77
  fi
  ip link set "$L1" netns "$H1"
  ip link set "$L2" netns "$H2"
  ip -n "$H1" addr add "$A1/24" dev "$L1"
  ip -n "$H2" addr add "$A2/24" dev "$L2"
  local h
  for h in "$H1" "$H2"; do ip -n "$h" link set lo up; done
  ip -n "$H1" link set "$L1" up
  ip -n "$H2" link set "$L2" up
}

# mh_run HOST LOG CMD...: runs CMD in HOST's namespace in the background; when it ends,
# LOG.exit holds "RC MS END_MS" (its exit status, how long it ran, and when it ended, in ms
# since the epoch). Appends to MH_PIDS.
mh_run() {
  local host="$1" log="$2"
  shift 2
  (
    s=$(date +%s%N)
    rc=0
    ip netns exec "$host" "$@" >"$log" 2>&1 || rc=$?
    e=$(date +%s%N)
    echo "$rc $(((e - s) / 1000000)) $((e / 1000000))" >"$log.exit.tmp"
    mv "$log.exit.tmp" "$log.exit"
  ) &
  MH_PIDS+=($!)
}

# Shapes both ends of the link with a root qdisc and its arguments ("tbf rate 1gbit ...",
# "netem ..."), or removes it ("none").
mh_shape() {
  local dev h ns
  for h in 1 2; do
    if [ "$h" = 1 ]; then dev="$L1" && ns="$H1"; else dev="$L2" && ns="$H2"; fi
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    # shellcheck disable=SC2086
    [ "$1" = none ] || ip netns exec "$ns" tc qdisc add dev "$dev" root $1
  done
}

# mh_now_ms: milliseconds since the epoch.
mh_now_ms() { echo $(($(date +%s%N) / 1000000)); }

# mh_wait_all: waits for every mh_run job.
mh_wait_all() {
  local pid
  for pid in "${MH_PIDS[@]}"; do wait "$pid" || true; done
  MH_PIDS=()
}

# mh_rank_env R WORLD: the torchrun variables of rank R (2 ranks a host).
mh_rank_env() {
  echo "RANK=$1 WORLD_SIZE=$2 LOCAL_RANK=$(($1 % 2)) LOCAL_WORLD_SIZE=2"
}

# mh_losses_match W1_JSONL WN_JSONL STEPS LABEL PYTHON: the losses of the two logs agree.
mh_losses_match() {
  "$5" - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
def losses(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    return [r["loss"] for r in rows if "step" in r and "loss" in r]
one, many, n, label = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if len(one) != n or len(many) != n:
    print(f"{label}: expected {n} losses from each run, got {len(one)} (1 rank) and {len(many)}")
    sys.exit(1)
worst = max(abs(a - b) / abs(a) for a, b in zip(one, many))
print(f"{label}: {n} losses vs 1 rank, max rel diff {worst:.2e}; "
      f"first {many[0]:.6f} (1 rank {one[0]:.6f}), last {many[-1]:.6f} (1 rank {one[-1]:.6f})")
sys.exit(0 if worst <= 1e-5 else 1)
PY
}
